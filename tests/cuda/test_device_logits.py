"""Device logits (Generate.device_logits, protocol/device_ring.py): each token's logits stay on the GPU
and reach the client through CUDA IPC.

- Everywhere (the simulator): the engine's whole path, a micro model on cuda:0 behind the text worker,
  with the ring over tests/fake_ipc.py's host stand-in for CUDA: kept rows stay device arrays until
  the ring's write, every Tokens frame names its slot, the rows are the CPU model's logits, and a
  full ring holds the request until the client releases a slot.
- On a GPU (CuPy): a ring made in one process and read in another started with spawn (CUDA refuses
  a process its own handles), and `ember serve --device cuda:0` streaming device logits to a client
  that reads them as CuPy arrays, equal to the same request's shared-memory logits.
"""
from __future__ import annotations

import multiprocessing
import queue
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ember
from ember.daemon.server.request import request_from_generate
from ember.daemon.server.text_worker import Output, TextWorker
from ember.protocol.device_ring import DeviceRing, DeviceRingReader
from ember.protocol.limits import Limits
from ember.protocol.messages import DeviceSlot, Finished, Generate, Tokens
from tests.fake_ipc import HostIpc

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "daemon"))

from ipc_child import read_in_child  # noqa: E402
from micro_model import write_micro_model  # noqa: E402

pytestmark = pytest.mark.cuda

PROMPT = (1, 17, 300)
WAIT = 120.0


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_micro_model(tmp_path_factory.mktemp("micro"))


def _cupy_gpu() -> Any:
    from ember.kernels.cuda.device import SIMULATOR

    if SIMULATOR:
        pytest.skip("CUDA IPC needs a GPU (the simulator test above covers the engine's path)")
    return pytest.importorskip("cupy")


def test_the_engine_streams_device_logits_through_its_ring(micro: Path) -> None:
    model = ember.load(micro, device="cuda:0", kv_dtype="f32")
    cpu = ember.load(micro, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    ipc, rings, outputs, stopped = HostIpc(device_arrays=True), [], queue.Queue(), threading.Event()

    def new_ring(user: int, device: bool) -> DeviceRing:
        assert device
        rings.append(DeviceRing(ipc, 2, model.config.vocab * 4))
        return rings[-1]

    def publish(frames: list[Output]) -> None:
        for frame in frames:
            outputs.put(frame)

    worker = TextWorker(cores={"m": model.engine(64 * 16, max_running=2)}, limits=Limits(), publish=publish,
                        on_stopped=stopped.set, new_ring=new_ring)
    worker.start()
    try:
        worker.submit(request_from_generate(b"c", Generate(1, token_ids=PROMPT, max_tokens=4, ignore_eos=True,
                                                           device_logits=True), {"m": model}, Limits()))
        reader, frames, rows = DeviceRingReader(ipc), [], []
        while not frames or not isinstance(frames[-1], Finished):
            try:
                _, message = outputs.get(timeout=2.0 if len(frames) >= 2 else WAIT)
            except queue.Empty:  # both slots held: the engine waits for the client
                assert len(frames) == 2 and rings[0].free_slots == 0
                for t in frames:
                    rows.append(np.array(reader.view(t.device_logits[0])))
                    worker.release(b"c", [t.device_logits[0].slot], device=True)
                frames.clear()
                continue
            assert not (isinstance(message, Tokens) and len(frames) >= 2), "a third frame while two slots were held"
            assert not isinstance(message, Tokens) or (message.device_logits and not message.logits)
            frames.append(message)
        rows += [np.array(reader.view(t.device_logits[0])) for t in frames if isinstance(t, Tokens)]
        tokens = list(cpu.generate(list(PROMPT), max_tokens=4, ignore_eos=True))
        want = cpu.logits(list(PROMPT) + tokens[:-1])[len(PROMPT) - 1:]
        got = np.concatenate(rows)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-5 * (want.max() - want.min())
        reader.close()
        assert not ipc.open
    finally:
        worker.shutdown(0.0)
        assert stopped.wait(WAIT)


def test_a_ring_made_here_is_read_by_another_process() -> None:
    cupy = _cupy_gpu()
    import msgspec

    from ember.protocol.device_ring import CupyIpc

    ring = DeviceRing(CupyIpc(), 3, 1000 * 4)
    rows = [cupy.arange(1000, dtype=cupy.float32).reshape(1, 1000) * k for k in (1, 2)]
    slots = [msgspec.msgpack.encode(ring.write(ring.acquire(), r)) for r in rows]
    with pytest.raises(Exception):  # noqa: B017 - CUDA's own refusal, whatever CuPy calls it
        DeviceRingReader().view(msgspec.msgpack.decode(slots[0], type=DeviceSlot))
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=read_in_child, args=(slots, out))
    child.start()
    status, got = out.get(timeout=WAIT)
    child.join(WAIT)
    assert status == "ok", got
    assert [np.asarray(g, np.float32).tolist() for g in got] == [r.get().tolist() for r in rows]
    ring.close()


def test_a_daemon_on_a_gpu_streams_device_logits_to_a_client(micro: Path) -> None:
    """`ember serve --device cuda:0`: a client asking for device_logits reads CuPy arrays equal to the
    shared-memory logits of the same request."""
    cupy = _cupy_gpu()
    from daemon_process import DaemonProcess

    from ember.client import Client

    daemon = DaemonProcess("[engine]\nwarmup = false\n", args=("--device", "cuda:0", "--model", str(micro)))
    daemon.wait_ready(timeout=240)
    try:
        with Client(daemon.socket, timeout=240) as client:
            host = [np.array(c.logits) for c in client.generate(list(PROMPT), max_tokens=4, ignore_eos=True,
                                                                   return_logits=True)]
            device = []
            for chunk in client.generate(list(PROMPT), max_tokens=4, ignore_eos=True, device_logits=True):
                assert isinstance(chunk.logits, cupy.ndarray)
                device.append(chunk.logits.get())
        assert np.array_equal(np.concatenate(device), np.concatenate(host))
    finally:
        assert daemon.stop() == 0
