"""End to end: a real `ember serve` process on a temporary socket, the demo model, the SDKs."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from ember.client import AsyncClient, Client
from ember.client.errors import BadRequest, Busy, LimitExceeded, UnknownModel
from ember.daemon.engine.sequence import Sequence
from ember.daemon.step.defaults import KV_BLOCK

PROMPT = "def fibonacci(n):"


def expected_tokens(model, prompt: str, **options) -> list[int]:  # type: ignore[no-untyped-def]
    return list(model.generate(prompt, **options))


@pytest.mark.asyncio
@pytest.mark.parametrize("options", [
    {"max_tokens": 40},
    {"max_tokens": 40, "temperature": 0.9, "top_p": 0.95, "seed": 1234},
    {"max_tokens": 40, "temperature": 1.1, "top_k": 20, "min_p": 0.02, "repetition_penalty": 1.2, "seed": 5},
])
async def test_streaming_equals_in_process_generate(daemon, demo_model, options) -> None:  # type: ignore[no-untyped-def]
    expected = expected_tokens(demo_model, PROMPT, **options)
    async with AsyncClient(daemon.socket) as client:
        stream = client.generate(PROMPT, **options)
        chunks = [chunk async for chunk in stream]
    assert [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == demo_model.detokenize(expected)
    assert stream.finished is not None and stream.finished.usage.completion_tokens == len(expected)
    assert stream.finished.reason == ("stop" if expected[-1] in demo_model.tokenizer.eos_ids else "length")


@pytest.mark.asyncio
async def test_concurrent_clients_get_their_own_complete_streams_in_order(daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    jobs = [(f"def f{i}(x):", {"max_tokens": 24, "temperature": 0.8, "seed": i, "ignore_eos": True}) for i in range(6)]

    async def one_client(mine: list[tuple[str, dict]]) -> list[list[int]]:  # type: ignore[type-arg]
        async with AsyncClient(daemon.socket) as client:
            streams = [client.generate(p, **o) for p, o in mine]

            async def read(stream) -> list[int]:  # type: ignore[no-untyped-def]
                ids = [t async for chunk in stream for t in chunk.token_ids]
                assert stream.finished.reason == "length"
                return ids

            return await asyncio.gather(*[read(s) for s in streams])

    results = await asyncio.gather(*[one_client(jobs[i : i + 2]) for i in range(0, 6, 2)])
    got = [ids for per_client in results for ids in per_client]
    assert got == [expected_tokens(demo_model, p, **o) for p, o in jobs]


def test_sync_client_streams_and_helpers(daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.socket) as client:
        assert [m.name for m in client.models()] == ["ember-demo"]
        assert client.health().status == "ok"
        ids = client.tokenize(PROMPT)
        assert ids == demo_model.tokenize(PROMPT)
        assert client.detokenize(ids) == demo_model.detokenize(ids)
        stream = client.generate(ids, max_tokens=10)  # token ids as the prompt
        assert [t for c in stream for t in c.token_ids] == expected_tokens(demo_model, PROMPT, max_tokens=10)
        before = client.stats()
        assert before.requests_total >= 1 and before.active == 0


def test_errors_are_typed(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.socket) as client:
        with pytest.raises(UnknownModel):
            client.generate("x", model="no-such-model").text()
        with pytest.raises(LimitExceeded, match="max_tokens"):
            client.generate("x", max_tokens=1_000_000).text()
        with pytest.raises(BadRequest, match="temperature"):
            client.generate("x", temperature=-1.0).text()
        with pytest.raises(BadRequest, match="token ids"):
            client.generate([1, 2, 10**6]).text()
        with pytest.raises(BadRequest, match="messages is empty"):
            client.chat([]).text()
        with pytest.raises(BadRequest):
            client.detokenize([-1])
        assert client.health().status == "ok"  # and the daemon goes on


def test_cancel_ends_the_stream_with_cancelled(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.socket) as client:
        stream = client.generate("x", max_tokens=4000, ignore_eos=True)
        next(stream)
        stream.cancel()
        rest = list(stream)
        assert stream.finished.reason == "cancelled"
        assert stream.finished.usage.completion_tokens == 1 + sum(len(c.token_ids) for c in rest)
        stream.cancel()  # twice is harmless


def test_busy_when_the_queue_is_full(daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    # the shared daemon admits max_active + max_queued = 6 requests
    with Client(daemon.socket) as client:
        streams = [client.generate("x", max_tokens=4000, ignore_eos=True) for _ in range(6)]
        with pytest.raises(Busy):
            client.generate("y", max_tokens=1).text()
        for s in streams:
            s.cancel()
        for s in streams:
            list(s)
            assert s.finished.reason == "cancelled"
        again = client.generate("y", max_tokens=1, ignore_eos=True)  # room again
        assert again.text() == demo_model.detokenize(expected_tokens(demo_model, "y", max_tokens=1, ignore_eos=True))
        assert again.finished.reason == "length" and again.finished.usage.completion_tokens == 1


@pytest.mark.asyncio
async def test_logits_via_shared_memory_equal_model_logits(daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    ids = demo_model.tokenize(PROMPT)
    engine = demo_model.engine(8 * KV_BLOCK)  # what the daemon runs for a request alone
    engine.add(Sequence(ids, 20, wants_logits=True))
    in_process = []
    while engine.has_work:
        in_process += [o.logits for o in engine.step().outputs]
    async with AsyncClient(daemon.socket) as client:
        # 20 tokens through a 4-slot ring: the request pauses whenever the ring is full
        stream = client.generate(PROMPT, max_tokens=20, return_logits=True)
        tokens, rows = [], []
        async for chunk in stream:
            assert chunk.logits is not None and chunk.logits.shape == (1, demo_model.config.vocab)
            assert not chunk.logits.flags.writeable
            tokens += chunk.token_ids
            rows.append(chunk.logits[0].copy())
            await client.health()  # a slow reader: the daemon runs ahead into a full ring
    assert len(rows) == len(in_process) == 20
    for got, want in zip(rows, in_process):
        assert got.tobytes() == want.tobytes()  # the transport is exact, and so is the computation
    # and Model.logits agrees: it reads the text as a prompt where generated tokens met the weights
    # one at a time, both with q8_0 activations of slightly different inputs (engine.decode_act,
    # engine.prompt_act; tests/test_engine_core.py checks f32 decode against Model.logits to 1e-5)
    reference = demo_model.logits(ids + tokens[:-1])[len(ids) - 1 :]
    span = reference.max(axis=1) - reference.min(axis=1)
    assert (np.abs(np.stack(rows) - reference).max(axis=1) <= 0.02 * span).all()


def test_an_end_tokens_text_never_reaches_the_user(daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    """A completion that ends by itself carries the end token's id, not its text (<|endoftext|>), in
    every request of a batch."""
    eos = demo_model.tokenizer.eos_id
    with Client(daemon.socket) as client:
        streams = [client.generate(PROMPT, max_tokens=8, logit_bias={eos: bias}, seed=i)
                   for i, bias in enumerate((100.0, 100.0, 0.0))]
        results = [list(s) for s in streams]
    for chunks in results[:2]:
        assert [t for c in chunks for t in c.token_ids] == [eos] and "".join(c.text for c in chunks) == ""
    assert "<|endoftext|>" not in "".join(c.text for c in results[2])


def test_logprobs_arrive_with_tokens(daemon) -> None:  # type: ignore[no-untyped-def]
    with Client(daemon.socket) as client:
        chunks = list(client.generate(PROMPT, max_tokens=5, logprobs=True, top_logprobs=3))
    assert sum(len(c.token_ids) for c in chunks) == 5
    for c in chunks:  # a chunk may carry several tokens (a decode burst), each with its own
        assert len(c.logprobs) == len(c.top_logprobs) == len(c.token_ids) and all(lp <= 0.0 for lp in c.logprobs)
        for token, top in zip(c.token_ids, c.top_logprobs, strict=True):
            assert len(top) == 3 and top[0][0] == token  # greedy: the best


def test_command_line_generate_and_status(daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run([sys.executable, "-m", "ember.client.cli", "generate", PROMPT, "--max-tokens", "12", "--temperature", "0",
                          "--socket", str(daemon.socket)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    greedy = expected_tokens(demo_model, PROMPT, max_tokens=12, repetition_penalty=demo_model.sampling.repetition_penalty)
    assert out.stdout == PROMPT + demo_model.detokenize(greedy) + "\n"  # over the demo's recommended penalty
    status = subprocess.run([sys.executable, "-m", "ember.client.cli", "status", "--socket", str(daemon.socket)],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "ok" in status.stdout and "ember-demo" in status.stdout


def test_requests_run_as_one_batch_and_stats_show_the_cache(daemon, demo_model) -> None:  # type: ignore[no-untyped-def]
    # a prompt of several full KV blocks, sent again: its blocks come from the prefix cache
    prompt = "import os\nimport sys\nimport json\n\n\ndef main(argv):\n    parser = make_parser()\n" * 3
    with Client(daemon.socket) as client:
        before = client.stats()
        streams = [client.generate(prompt, max_tokens=200, ignore_eos=True) for _ in range(3)]
        for s in streams:
            next(s)
        during = client.stats()  # all three decode together: one forward pass per step for all of them
        for _ in range(200):  # the rate needs two steps that produced tokens: a few ms more
            if during.tokens_per_s > 0:
                break
            during = client.stats()
        for s in streams:
            s.cancel()
            list(s)
        assert [t for c in client.generate(prompt, max_tokens=8) for t in c.token_ids] == \
            list(demo_model.generate(prompt, max_tokens=8))
        after = client.stats()
    assert during.active == 3 and during.queued == 0 and during.kv_blocks_used > 0
    assert after.prefix_hit_rate > before.prefix_hit_rate and after.kv_blocks_free > 0
    assert during.tokens_per_s > 0
