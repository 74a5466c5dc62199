"""The gateway driven by the real openai SDK, sync and async, against a real daemon on the demo model.

The reference is the native SDK (ember.client.Client) asking the same daemon the same thing: greedy
generations must give the same text, token counts and finish reason through both, so the translation is
checked end to end without re-implementing it in the test."""
from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from gateway_setup import MODEL
from gateway_thread import GatewayThread

from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.text.text_model import open_text_model

PROMPT = "def fibonacci(n):"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


# what the gateway leaves to the model when a request names no repetition penalty (OpenAI has none):
# the demo file's recommendation, which the native SDK's greedy requests must name to match
PENALTY = open_text_model(DEMO_MODEL).sampling.repetition_penalty


def native_text(native: Any, *, messages: Any = None, prompt: Any = None, **options: Any) -> tuple[str, Any]:
    options.setdefault("repetition_penalty", PENALTY)
    stream = native.chat(messages, **options) if messages is not None else native.generate(prompt, **options)
    text = "".join(chunk.text for chunk in stream)
    return text, stream.finished


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].owned_by == "ember"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_whole_matches_the_native_sdk(client: openai.OpenAI, native: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    text, finished = native_text(native, messages=CHAT, max_tokens=24, temperature=0.0)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == finished.reason and choice.logprobs is None
    assert r.usage is not None and r.usage.prompt_tokens == finished.usage.prompt_tokens
    assert r.usage.completion_tokens == finished.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_is_the_whole_answer_in_pieces(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)  # type: ignore[arg-type]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,  # type: ignore[arg-type]
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in body][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # include_usage: one last chunk, counts
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_whole_and_stream_match_the_native_sdk(client: openai.OpenAI, native: Any) -> None:
    text, finished = native_text(native, prompt=PROMPT, max_tokens=32, temperature=0.0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == text
    assert r.choices[0].finish_reason == finished.reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (
        finished.usage.prompt_tokens, finished.usage.completion_tokens)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)
    ids = native.tokenize(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=32, temperature=0)
    assert by_ids.choices[0].text == native_text(native, prompt=ids, max_tokens=32, temperature=0.0)[0]


def test_stop_strings_end_the_text_before_them(client: openai.OpenAI, native: Any) -> None:
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    stop = next(word for word in ("(", "\n", " ") if word in free.strip())  # a string the free run produces
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert free.startswith(r.choices[0].text) and len(r.choices[0].text) < len(free)
    assert r.choices[0].text == native_text(native, prompt=PROMPT, max_tokens=40, temperature=0.0, stop=[stop, "@@@"])[0]
    free_chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40,  # type: ignore[arg-type]
                                               temperature=0).choices[0].message.content or ""
    stop = next(word for word in ("(", "\n", " ") if word in free_chat.strip())
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0, stop=stop)  # type: ignore[arg-type]
    assert chat.choices[0].finish_reason == "stop" and stop not in (chat.choices[0].message.content or "")
    assert free_chat.startswith(chat.choices[0].message.content or "")


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=seed)
        return r.choices[0].text

    assert sample(1234) == sample(1234) and sample(-5) == sample(-5)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1  # sampled at temperature 1: seeds matter


def test_ember_extras_and_logit_bias(client: openai.OpenAI, native: Any) -> None:
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    top1 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
                                     extra_body={"top_k": 1, "min_p": 0.0})
    assert top1.choices[0].text == greedy  # top_k=1 reached the sampler: greedy whatever the temperature
    token = native.tokenize(" banana", add_special=False)[0]
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100})
    assert forced.choices[0].text == native.detokenize([token]) * 4  # keys are token ids as strings


def test_chat_logprobs(client: openai.OpenAI, native: Any) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, logprobs=True,  # type: ignore[arg-type]
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert r.usage is not None and len(content) == r.usage.completion_tokens == 12
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        alternatives = [a.logprob for a in t.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert t.top_logprobs[0].token == t.token and t.logprob == pytest.approx(alternatives[0])  # greedy: the best
        assert t.logprob <= 0 and bytes(t.bytes or []) == t.token.encode()
    reference = [lp for chunk in native.chat(CHAT, max_tokens=12, temperature=0.0, logprobs=True, repetition_penalty=PENALTY)
                 for lp in chunk.logprobs]
    assert [t.logprob for t in content] == pytest.approx(reference, abs=1e-4)
    streamed = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,  # type: ignore[arg-type]
                                              logprobs=True, stream=True)
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or ()]
    assert [t.token for t in tokens] == [t.token for t in content] and all(t.top_logprobs == [] for t in tokens)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(10)]
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(chosen)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))


@pytest.mark.asyncio
async def test_async_client_concurrent_streams_match_alone(gateway: Any) -> None:
    async with openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
        async def run(prompt: str, stream: bool) -> str:
            if not stream:
                r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
                return r.choices[0].text
            chunks = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in chunks])

        prompts = ["import os\n", "class Stack:", "def add(a, b):", "# sort a list\n"]
        alone = [await run(p, stream=False) for p in prompts]
        together = await asyncio.gather(*(run(p, stream=True) for p in prompts))
        assert list(together) == alone
        chat = await client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.completion_tokens == 8


def test_no_max_tokens_runs_to_the_gateways_default(daemon: Any) -> None:
    gateway = GatewayThread(socket=daemon.socket, default_max_tokens=20)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0) as client:
            r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    finally:
        gateway.stop()
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 20


def test_n_choices_whole_and_streamed(client: openai.OpenAI, native: Any) -> None:
    """n > 1: choice i is sampled with seed + i, so each equals the native SDK's request with that seed;
    usage counts the prompt once and every choice's tokens; a stream interleaves the choices by index."""
    options = dict(max_tokens=12, temperature=1.0, top_p=0.9)
    extra = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}  # the native SDK's defaults, not the model's
    want = [native_text(native, prompt=PROMPT, seed=5 + i, **options, **extra)[0] for i in range(3)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=5, extra_body=extra, **options)
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.text for c in r.choices] == want
    assert r.usage is not None and r.usage.completion_tokens == 36 and r.usage.prompt_tokens == len(native.tokenize(PROMPT))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, n=3, seed=5, stream=True, extra_body=extra,
                                            **options))
    assert ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)] == want
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1, 2]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, seed=5, max_tokens=8)  # type: ignore[arg-type]
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage is not None and chat.usage.completion_tokens == 16
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "import os"], seed=5, extra_body=extra, **options)
    assert [c.text for c in batch.choices] == [want[0], native_text(native, prompt="import os", seed=5, **options,
                                                                    **extra)[0]]
    assert batch.usage is not None and batch.usage.prompt_tokens == len(native.tokenize(PROMPT)) + len(
        native.tokenize("import os"))  # LangChain's OpenAI.batch: one request, each prompt once


def test_n_choices_share_their_prompt(client: openai.OpenAI, native: Any) -> None:
    """The choices after a prompt's first start once its first token is out: they find the prompt's full
    KV blocks in the daemon's prefix cache (the daemon's count of blocks found) instead of computing them.
    (Started together they often would too, when the engine's first step takes the first choice alone;
    the gateway's order makes it certain.)"""
    # a prompt of its own, short enough that all three choices would fit in one step together (256 tokens)
    prompt = "".join(f"def step_{i}(state):\n    return state + {i}\n" for i in range(6))
    blocks = len(native.tokenize(prompt)) // 16  # the daemon's KV blocks of 16 tokens
    before = native.stats().prefix_hits
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, seed=1, max_tokens=4, temperature=1.0)
    assert len(r.choices) == 3 and blocks >= 5
    assert native.stats().prefix_hits - before >= 2 * blocks - 2  # the 2 later choices, (nearly) every block


def test_responses_whole_streamed_and_continued(client: openai.OpenAI, native: Any) -> None:
    """/v1/responses through openai's responses.create: the text is the chat's, streamed as Responses'
    events; previous_response_id continues the conversation; max_output_tokens makes it incomplete."""
    extra = {"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    user = [{"role": "user", "content": "Sort a list."}]
    want = native_text(native, messages=[{"role": "system", "content": "You write Python."}, *user], max_tokens=12,
                       temperature=0.0, repetition_penalty=1.0)[0]
    r = client.responses.create(model=MODEL, input="Sort a list.", instructions="You write Python.",
                                max_output_tokens=12, temperature=0, extra_body=extra)
    assert r.object == "response" and r.output_text == want and r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 12
    events = list(client.responses.create(model=MODEL, input=user, instructions="You write Python.",  # type: ignore[arg-type]
                                          max_output_tokens=12, temperature=0, stream=True, extra_body=extra))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert [e.sequence_number for e in events] == list(range(len(events)))
    follow = client.responses.create(model=MODEL, input="Now reverse it.", previous_response_id=r.id,
                                     max_output_tokens=8, temperature=0, extra_body=extra)
    continued = native_text(native, messages=[*user, {"role": "assistant", "content": want},
                                              {"role": "user", "content": "Now reverse it."}],
                            max_tokens=8, temperature=0.0, repetition_penalty=1.0)[0]
    assert follow.output_text == continued  # the earlier instructions are not carried over, the answer is
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert e.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "function", "name": "f", "parameters": {}}])  # type: ignore[list-item]
    assert e.value.param == "tools"
