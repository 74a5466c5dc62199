"""A DFlash draft on cuda:0 beside the micro model: the same draft network and feature path as on the
CPU (no backend `if`s), so greedy tokens equal decoding without a draft, on the device."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import ember

sys.path.insert(0, str(Path(__file__).parent))

from dflash_files import write_dflash  # noqa: E402
from micro_model import write_micro_model  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_micro_model(tmp_path_factory.mktemp("micro"))


def test_dflash_greedy_on_cuda_equals_the_target_alone(micro: Path, tmp_path: Path) -> None:
    draft = write_dflash(tmp_path / "dflash.gguf", micro, target_layers=(1, 2), block_size=4, mask_id=3, heads=2,
                         kv_heads=1, head_dim=32, ffn=64)
    plain = ember.load(micro, device="cuda:0")
    spec = ember.load(micro, device="cuda:0", draft=draft, draft_tokens=3, feature_dtype="bf16")
    want = list(plain.generate([1, 17, 300], max_tokens=5, ignore_eos=True))
    assert list(spec.generate([1, 17, 300], max_tokens=5, ignore_eos=True)) == want
    assert spec.spec_stats().steps > 0
