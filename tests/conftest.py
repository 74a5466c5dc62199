"""Shared fixtures."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tiny_models import build_hf_model


@pytest.fixture
def hf_model(tmp_path: Path) -> Callable[..., tuple[Path, Any]]:
    def make(arch: str, **overrides: Any) -> tuple[Path, Any]:
        return build_hf_model(arch, tmp_path / arch, **overrides)

    return make
