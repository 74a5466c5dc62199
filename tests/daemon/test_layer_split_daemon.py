"""The daemon serving a layer-split model (`ember serve --devices cpu:0,cpu:1 --split 3,2`): every
sampling option gives what the unsplit model gives in process (f32 staging computes the same
logits), a killed stage fails its requests with a clear error and the daemon serves on, and bad
split specs stop the start with what to change."""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from daemon_process import DaemonProcess, alive, wait_until
from ember.client import Client
from ember.client.errors import GenerationFailed
from ember.daemon.step.defaults import KV_BLOCK
from ember.daemon.engine.sequence import Sequence
from ember.kernels.sampling import SamplingParams
from ember.protocol.shm_ring import owner_id, remove_dead_segments

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):"
CONFIG = """
[engine]
max_active = 3
act_dtype = "f32"
"""


@pytest.fixture(scope="module")
def split_daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(CONFIG, args=("--devices", "cpu:0,cpu:1", "--split", "3,2")).wait_ready(120)
    yield d
    d.stop()


def in_process(model, prompt: str, n: int, params: SamplingParams, seed: int | None = None,  # type: ignore[no-untyped-def]
               logits: bool = False) -> Sequence:
    """The same request on the unsplit model's engine, as the daemon runs one alone."""
    engine = model.engine(8 * KV_BLOCK)
    seq = Sequence(model.tokenize(prompt), n, params, seed, frozenset(model.tokenizer.eos_ids), wants_logits=logits,
                   wants_logprob=True)
    engine.add(seq)
    seq.rows = []  # type: ignore[attr-defined]
    while engine.has_work:
        seq.rows += [o.logits[0] for o in engine.step().outputs if o.logits is not None]  # type: ignore[attr-defined]
    return seq


@pytest.mark.parametrize("options", [
    {},  # greedy
    {"temperature": 0.9, "seed": 11},
    {"temperature": 1.0, "top_k": 5, "seed": 12},
    {"temperature": 1.0, "top_p": 0.8, "seed": 13},
    {"temperature": 1.0, "min_p": 0.1, "seed": 14},
    {"repetition_penalty": 1.3},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.5},
    {"temperature": 0.7, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5, "seed": 15},
    {"logit_bias": {25: 3.0, 198: -100.0}},
], ids=["greedy", "temperature", "top_k", "top_p", "min_p", "repetition", "frequency", "presence", "penalties",
        "logit_bias"])
def test_each_sampling_option_equals_unsplit(split_daemon, demo_model, options) -> None:  # type: ignore[no-untyped-def]
    want = in_process(demo_model, PROMPT, 32, SamplingParams(**{k: v for k, v in options.items() if k != "seed"}),
                      options.get("seed"))
    with Client(split_daemon.socket) as client:
        stream = client.generate(PROMPT, max_tokens=32, **options)
        got = [t for chunk in stream for t in chunk.token_ids]
    assert got == want.generated
    if "logit_bias" in options:
        assert 198 not in got


def test_seeds_repeat_and_differ(split_daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    with Client(split_daemon.socket) as client:
        runs = [[t for c in client.generate(PROMPT, max_tokens=24, temperature=1.2, seed=s, ignore_eos=True)
                 for t in c.token_ids] for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]
    assert runs[2] == list(demo_model.generate(PROMPT, 24, temperature=1.2, seed=2, ignore_eos=True))


def test_logprobs_equal_unsplit(split_daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    want = in_process(demo_model, PROMPT, 8, SamplingParams(temperature=0.8), seed=3)
    with Client(split_daemon.socket) as client:
        chunks = list(client.generate(PROMPT, max_tokens=8, temperature=0.8, seed=3, logprobs=True, top_logprobs=2))
    assert [t for c in chunks for t in c.token_ids] == want.generated
    got = [lp for c in chunks for lp in c.logprobs]
    assert np.allclose(got, [c.logprob for c in want.choices], rtol=0, atol=1e-5)
    assert all(len(c.top_logprobs[0]) == 2 for c in chunks)


def test_stop_strings_end_the_text(split_daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    full = demo_model.detokenize(demo_model.generate(PROMPT, 40, ignore_eos=True))
    assert "called from" in full
    with Client(split_daemon.socket) as client:
        stream = client.generate(PROMPT, max_tokens=40, stop=["called from"], ignore_eos=True)
        text = stream.text()
    assert stream.finished.reason == "stop" and text == full[: full.index("called from")]


def test_logits_to_clients_equal_unsplit(split_daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    want = in_process(demo_model, PROMPT, 6, SamplingParams(), logits=True)
    with Client(split_daemon.socket) as client:
        rows = [c.logits[0].copy() for c in client.generate(PROMPT, max_tokens=6, return_logits=True)]
    got, ref = np.stack(rows), np.stack(want.rows)  # type: ignore[attr-defined]
    assert got.shape == ref.shape and np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()


def test_staging_segments_are_the_daemons_and_private(split_daemon) -> None:  # type: ignore[no-untyped-def]
    """Named after the daemon's socket like its logits rings: the next daemon there removes what a
    killed one left (protocol/shm_ring.remove_dead_segments)."""
    from pathlib import Path

    from ember.protocol.shm_ring import owner_id

    modes = {}
    for path in Path("/dev/shm").glob(f"ember-{split_daemon.engine_pid}-{owner_id(split_daemon.socket)}*"):
        try:
            modes[path.name] = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:  # a finished client's logits ring, freed between the listing and here
            continue
    assert len(modes) >= 2, modes  # the boundary's staging and the logits rows, held while the daemon lives
    assert set(modes.values()) == {0o600}, modes


def test_a_killed_stage_fails_its_requests_and_the_daemon_serves_on(split_daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    pids = [e["pid"] for e in split_daemon.log_events() if e.get("event") == "layer-split stage ready"]
    assert len(pids) == 2
    with Client(split_daemon.socket) as client:
        stream = client.generate(PROMPT, max_tokens=4000, ignore_eos=True)
        next(stream)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(GenerationFailed, match=r"stage cpu:1 \(layers 3-4\) died: killed by signal 9; restarted"):
            list(stream)
        again = [t for c in client.generate(PROMPT, max_tokens=16) for t in c.token_ids]
    assert again == list(demo_model.generate(PROMPT, 16))


def test_the_last_stage_on_the_daemons_engine_thread(demo_model) -> None:  # type: ignore[no-untyped-def]
    """`--devices cpu:0,cpu`: sampled tokens with penalties, logprobs and logits rows are the unsplit
    model's; the worker killed mid-stream fails that request, and the daemon serves on."""
    d = DaemonProcess(CONFIG, args=("--devices", "cpu:0,cpu", "--split", "3,2")).wait_ready(120)
    try:
        stages = {e["stage"]: e["pid"] for e in d.log_events() if e.get("event") == "layer-split stage ready"}
        assert stages == {"stage cpu:0 (layers 0-2)": stages["stage cpu:0 (layers 0-2)"],
                          "stage cpu (layers 3-4)": d.engine_pid}
        options = {"temperature": 0.7, "repetition_penalty": 1.1, "frequency_penalty": 0.5, "seed": 15}
        want = in_process(demo_model, PROMPT, 24, SamplingParams(**{k: v for k, v in options.items() if k != "seed"}),
                          options["seed"], logits=True)
        with Client(d.socket) as client:
            chunks, rows = [], []
            for chunk in client.generate(PROMPT, max_tokens=24, logprobs=True, return_logits=True, **options):
                chunks.append(chunk)
                rows.append(chunk.logits.copy())  # a view of the daemon's ring until the next chunk
            assert [t for c in chunks for t in c.token_ids] == want.generated
            assert np.allclose([lp for c in chunks for lp in c.logprobs], [c.logprob for c in want.choices], rtol=0,
                               atol=1e-5)
            got, ref = np.concatenate(rows), np.stack(want.rows)  # type: ignore[attr-defined]
            assert got.shape == ref.shape and np.abs(got - ref).max() <= 1e-6 * np.abs(ref).max()

            stream = client.generate(PROMPT, max_tokens=4000, ignore_eos=True)
            next(stream)
            os.kill(stages["stage cpu:0 (layers 0-2)"], signal.SIGKILL)
            with pytest.raises(GenerationFailed, match=r"stage cpu:0 \(layers 0-2\) died: killed by signal 9; restarted"):
                list(stream)
            again = [t for c in client.generate(PROMPT, max_tokens=16) for t in c.token_ids]
        assert again == list(demo_model.generate(PROMPT, 16))
    finally:
        d.stop()


@pytest.mark.parametrize(("args", "message"), [
    (("--devices", "cpu:0,cpu:1", "--split", "3,3"), "split 3,3 adds up to 6 layers; the model has 5: e.g. --split 3,2"),
    (("--devices", ",".join(f"cpu:{i}" for i in range(6))), "6 devices .* 5 layers: every stage needs a layer; name at most 5"),
    (("--devices", "cpu:0,npu:1"), "not a device: 'npu:1'"),
])
def test_bad_split_specs_stop_the_start(tmp_path, args, message) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run([sys.executable, "-m", "ember.client.cli", "serve", "--socket", str(tmp_path / "s.sock"), *args],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("EMBER_")})
    assert out.returncode == 1
    assert out.stderr.startswith("ember: error:") and re.search(message, out.stderr), out.stderr


def test_split_configuration_keys_and_environment() -> None:
    from ember.daemon.config import ConfigError, load_config

    config = load_config(env={"EMBER_ACT_DTYPE": "bf16"}, flags={"engine.devices": "cpu:0,cpu:1", "engine.split": "3,2"})
    assert (config.engine.devices, config.engine.split, config.engine.act_dtype) == ("cpu:0,cpu:1", "3,2", "bf16")
    assert load_config(env={"EMBER_ACT_DTYPE": "bf16"}, flags={"engine.act_dtype": "f16"}).engine.act_dtype == "f16"
    for flags, message in [({"engine.act_dtype": "q8_0"}, "act_dtype must be one of auto, f32, f16, bf16"),
                           ({"engine.devices": "cpu:0,tpu"}, "not a device: 'tpu'"),
                           ({"engine.split": "3,2"}, "needs devices to split across"),
                           ({"engine.devices": "cpu:0,cpu:1", "engine.split": "3,x"}, "give layer counts")]:
        with pytest.raises(ConfigError, match=message):
            load_config(env={}, flags=flags)


def test_a_killed_split_daemon_leaves_no_staging_segments() -> None:
    """SIGKILL the daemon: its engine dies with it (nobody can unlink there) and the stage workers,
    finding their engine gone, unlink the staging and logits segments they mapped."""
    d = DaemonProcess(CONFIG, args=("--devices", "cpu:0,cpu:1", "--split", "3,2")).wait_ready(120)
    try:
        engine = d.engine_pid
        stages = [e["pid"] for e in d.log_events() if e.get("event") == "layer-split stage ready"]
        pattern = f"ember-{engine}-{owner_id(d.socket)}*"
        assert len(list(Path("/dev/shm").glob(pattern))) >= 2
        d.proc.kill()
        d.proc.wait()
        assert wait_until(lambda: not any(alive(pid) for pid in (engine, *stages)), 30)
        assert list(Path("/dev/shm").glob(pattern)) == []
    finally:
        d.stop()
        remove_dead_segments(owner_id(d.socket))
