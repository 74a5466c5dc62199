"""Gemma 4: tiny random configurations against transformers' Gemma4ForCausalLM (HF directories):
sliding and full layers of their own shapes, values from the keys' projection, KV sharing, per-layer
embeddings, the double-wide FFN of the shared layers, the MoE block and the soft-capped head; the
same models converted and quantized by llama.cpp against llama.cpp; Gemma 4's tokenizer and chat
template against llama.cpp's test vectors and transformers."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ember
from ember.daemon.engine.sequence import Sequence as EngineSequence
from ember.daemon.loader.model_file import open_model_file
from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.planning.planner import (GiB, Device, ModelHeaders, PlanRequest, TensorInfo, build_plan, explain,
                                          plan_model)
from ember.daemon.planning.precision import DeviceCaps, resolve_policy
from ember.daemon.text.chat_template import ChatTemplate
from ember.daemon.text.tokenizer import Tokenizer
from ember.kernels.cpu.backend import CpuOps
from cold_experts import cold_equals_all_hot
from llama_cpp_tools import llama_cpp_file
from references import hf_greedy, hf_logits
from tiny_models import DEMO_TOKENIZER
from tokenizer_fixtures import corpus, gguf_metadata

CASES = {
    "e2b": {},  # tiny_models.GEMMA4: every feature of the small models
    # the large dense models' layout: no per-layer embedding, no KV sharing, values projected apart
    "31b": dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                attention_k_eq_v=False, final_logit_softcapping=None),
    # the 26B-A4B layout: routed experts beside every layer's dense FFN
    "moe": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64),
    # the sliding layers alone share (the full layers compute their own): sharing by layer kind
    "shared_sliding": dict(layer_types=["sliding_attention", "full_attention"] + ["sliding_attention"] * 3
                           + ["full_attention"], num_kv_shared_layers=3),
}


@pytest.mark.parametrize("case", CASES)
def test_gemma4_matches_transformers(hf_model, case: str) -> None:
    """Logits within 1e-4 of their range at 1, 7 and 40 tokens (past the window of 8), and 64 greedy
    tokens, as transformers gives them."""
    path, ref = hf_model("gemma4", **CASES[case])
    model = ember.load(path, kv_dtype="f32")
    c = model.config
    if case == "e2b":
        assert c.layer_head_dims == (32, 32, 64, 32, 32, 64) and c.layer_kv_heads == (2, 2, 1, 2, 2, 1)
        assert [c.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 3, 2] and c.attention_layers == 4
        assert (c.layer_input_dim, c.logit_softcap, c.rope_turning) == (16, 30.0, 0.25)
    rng = np.random.default_rng(3)
    for n in (1, 7, 40):
        ids = rng.integers(1, c.vocab, n).tolist()
        expected = hf_logits(ref, ids)
        assert np.abs(model.logits(ids) - expected).max() <= 1e-4 * (expected.max() - expected.min()), f"{n} tokens"
    prompt = rng.integers(1, c.vocab, 6).tolist()
    model32 = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    assert list(model32.generate(prompt, max_tokens=64, ignore_eos=True)) == hf_greedy(ref, prompt, 64)


def test_speculative_decoding_keeps_the_output(hf_model) -> None:
    """A Gemma 4 draft proposing for a Gemma 4 target (itself: greedy proposals are all accepted),
    always speculating: greedy tokens as without a draft, past the window, and sampled tokens of one
    seed alike run after run."""
    path, _ = hf_model("gemma4")
    plain = ember.load(path)
    spec = ember.load(path, draft=path, draft_tokens=3)
    spec.adaptive_draft = False
    prompt = np.random.default_rng(6).integers(1, 8192, 12).tolist()
    assert list(spec.generate(prompt, max_tokens=40, ignore_eos=True)) == list(
        plain.generate(prompt, max_tokens=40, ignore_eos=True))
    stats = spec.spec_stats()
    assert stats.steps > 0 and stats.accepted == stats.proposed > 0  # its own proposals: all kept
    sampled = [list(spec.generate(prompt, max_tokens=24, temperature=0.9, top_k=50, seed=3, ignore_eos=True))
               for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 24


def test_shared_layers_keep_no_cache(hf_model) -> None:
    """The KV cache holds the four layers that compute K/V, each in its own shape; the two that share
    hold none."""
    path, _ = hf_model("gemma4")
    model = ember.load(path, kv_dtype="f32")
    cache = model.net.new_cache(4, 16, "f32")
    assert cache.shapes == [(2, 32), (2, 32), (1, 64), (2, 32)]
    assert len(cache.k) == len(cache.v) == 4


def test_released_checkpoints_layout(tmp_path: Path) -> None:
    """The released checkpoints' layout (Gemma4ForConditionalGeneration, model_type gemma4): the text
    config nested in text_config, the language model's weights under model.language_model., vision
    and audio towers beside it. ember takes the language model alone and gives transformers' text
    logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tiny_models import GEMMA4, TINY

    config = transformers.Gemma4Config(
        text_config=transformers.Gemma4TextConfig(**(TINY | GEMMA4)),
        vision_config=transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, num_key_value_heads=2, head_dim=16),
        audio_config=transformers.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                    output_proj_dims=32, subsampling_conv_channels=[8, 4]))
    torch.manual_seed(0)
    ref = transformers.Gemma4ForConditionalGeneration(config).eval()
    ref.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TOKENIZER / f, tmp_path / f)
    names = set(open_model_file(tmp_path).tensors)
    assert "per_layer_token_embd.weight" in names and not any("vision" in n or "audio" in n for n in names)
    ids = np.random.default_rng(3).integers(1, 8192, 40).tolist()
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor([ids])).logits[0].numpy()
    got = ember.load(tmp_path, kv_dtype="f32").logits(ids)
    assert np.abs(got - expected).max() <= 1e-4 * (expected.max() - expected.min())


def test_window_layers_keep_only_their_window(hf_model) -> None:
    """With at most 16 positions a step, the sliding layers (window 8) keep a ring of 2 blocks a
    sequence (7 + 16 live positions): three sequences of 6 + 90 tokens (decode bursts included) wrap
    their rings twice over and give
    transformers' greedy tokens, while the rings' bytes stay what they were at the start and the full
    layers' blocks grow with the sequences (prefix reuse is off: no block holds a ring's keys)."""
    path, ref = hf_model("gemma4")
    model = ember.load(path, decode_act="f32", prompt_act="f32", kv_dtype="f32")
    engine = model.engine(3 * 112, max_running=3, max_step_tokens=16)
    cache = engine.runner.cache
    assert cache.ring == 2 and cache.windowed == [True, True, False, True]
    rings = cache.bytes_of(True)
    # 3 sliding layers' K and V: 3 slots of 2 blocks of 16 positions, 2 KV heads of 32 float32s
    assert rings == 3 * 2 * (3 * 2) * 16 * 2 * 32 * 4 and not engine.blocks.prefix_caching
    rng = np.random.default_rng(4)
    seqs = [EngineSequence(rng.integers(1, 8192, 40).tolist(), 60, stop_ids=frozenset()) for _ in range(3)]
    for seq in seqs:
        engine.add(seq)
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, engine.blocks.n_blocks - engine.blocks.num_free)
    assert cache.bytes_of(True) == rings and most >= 7  # 100 positions: 7 full-layer blocks a sequence
    for seq in seqs:
        assert seq.generated == hf_greedy(ref, seq.prompt, 60)


@pytest.mark.parametrize(("ctx", "seqs", "ring"), [(32, 2, 0), (512, 3, 2)])
def test_plan_kv_equals_what_the_cache_allocates(hf_model, ctx: int, seqs: int, ring: int) -> None:
    """ember plan's KV cache for the tiny Gemma 4 equals the bytes the engine's cache holds for the
    same request: the full layers' own shapes over every position, nothing for the shared layers, and
    the sliding layers' rings where they take less than every position (512 positions, steps of 16)."""
    path, _ = hf_model("gemma4")
    request = PlanRequest(devices=(Device("cpu", 1 << 34),), policy=resolve_policy([DeviceCaps.of("cpu")]),
                          ctx=ctx, seqs=seqs, prefill_chunk=16)
    plan = plan_model(path, request)
    model = ember.load(path, kv_dtype=request.policy.kv)
    cache = model.engine(seqs * ctx, max_running=seqs, max_step_tokens=16).runner.cache
    assert cache.ring == ring and plan.devices[0].kv_cache == sum(cache.layer_bytes)
    # K and V in f16 over every position: three sliding layers of 2 heads of 32, one full of 1 head of 64
    full = 2 * (seqs * ctx) * (3 * 2 * 32 * 2 + 1 * 64 * 2)
    assert ring or plan.devices[0].kv_cache == full


def test_config_and_names_from_a_directory(hf_model) -> None:
    """Every tensor gets the name llama.cpp's converter gives it, the by-hand ones included; the shared
    layers have no K/V projections and the full layers (k_eq_v) no V projection."""
    path, _ = hf_model("gemma4")
    names = set(open_model_file(path).tensors)
    assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight",
            "blk.0.inp_gate.weight", "blk.0.proj.weight", "blk.0.post_norm.weight", "blk.0.layer_output_scale.weight",
            "blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.attn_v.weight"} <= names
    assert "blk.2.attn_v.weight" not in names and "blk.4.attn_k.weight" not in names


# --- GGUF files made by llama.cpp -------------------------------------------------------------------
# quantizable shapes (rows of 256 values) and a Gemma-style tokenizer (what the converter takes)
GGUF_SHAPE = dict(hidden_size=256, intermediate_size=256, head_dim=64, global_head_dim=128)


def converted_model(tmp: Path, **overrides: Any) -> tuple[Path, Any]:
    """(the float32 file llama.cpp's converter makes of a tiny Gemma 4, the transformers model)."""
    from llama_cpp_tools import convert
    from tiny_models import build_hf_model, write_gemma_tokenizer

    (tmp / "tokenizer").mkdir(parents=True)
    n = write_gemma_tokenizer(tmp / "tokenizer")
    path, ref = build_hf_model("gemma4", tmp / "hf", **(GGUF_SHAPE | dict(vocab_size=n, vocab_size_per_layer_input=n)
                                                        | overrides))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp / "tokenizer" / f, path / f)
    return convert(path, tmp / "f32.gguf", "f32"), ref


@pytest.fixture(scope="module", params=["dense", "moe"])
def unshared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """Converted without KV sharing (llama.cpp aborts on it: docs/models.md), dense and with the MoE block."""
    moe = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=256)
    return converted_model(tmp_path_factory.mktemp(f"gemma4-{request.param}"), num_kv_shared_layers=0,
                           **(moe if request.param == "moe" else {}))


@pytest.mark.oracle
def test_gguf_with_shared_kv_matches_transformers(tmp_path: Path) -> None:
    """The small models' layout (KV sharing, per-layer embeddings, k_eq_v) converted by llama.cpp:
    ember reads every key and tensor the converter writes (the full layers' proportional rope as its
    rope_freqs divisors, values from attn_k where attn_v is absent) and gives transformers' logits."""
    path, ref = converted_model(tmp_path)
    model = ember.load(path, kv_dtype="f32")
    c = model.config
    assert (c.kv_shared_layers, c.layer_input_dim, c.layer_head_dims) == (2, 16, (64, 64, 128, 64, 64, 128))
    ids = np.random.default_rng(5).integers(1, c.vocab, 40).tolist()
    expected = hf_logits(ref, ids)
    assert np.abs(model.logits(ids) - expected).max() <= 1e-4 * (expected.max() - expected.min())


@pytest.mark.oracle
@pytest.mark.parametrize("ftype", ["F32", "Q8_0", "Q4_K_M"])
def test_gguf_matches_llama_cpp(unshared, tmp_path: Path, monkeypatch, ftype: str) -> None:
    """The converted file and llama.cpp's quantizations of it, against llama.cpp on the same weights
    at float32 (a dequantized copy). llama.cpp's CPU GELU is a float16 table (references.ggml_gelu),
    ~1e-3 off per value: it moves its logits from transformers' by up to ~1e-2 of the range here.
    ember keeps the exact GELU, so it differs from llama.cpp by what llama.cpp differs from
    transformers; with llama.cpp's table in the GELU's place it equals llama.cpp to 2e-3 of the range
    (what is left: upstream float rounding sending a value across a float16 step). On the quantized
    files llama.cpp quantizes its activations too: ember differs from it by no more than llama.cpp
    differs from itself at float32 plus what the GELU table makes them differ by on the same weights
    (docs/models.md)."""
    from gguf_copy import copy_gguf
    from llama_cpp_tools import quantize
    from references import ggml_gelu, llama_cpp_logits

    f32, ref = unshared
    path = f32 if ftype == "F32" else quantize(f32, tmp_path / f"{ftype}.gguf", ftype)
    ids = np.random.default_rng(5).integers(1, ember.load(f32).config.vocab, 40).tolist()
    ours = ember.load(path, kv_dtype="f32", prompt_act="f32").logits(ids)  # the file read exactly (f32 prompt rows)
    same_weights = path if ftype == "F32" else copy_gguf(path, tmp_path / "dequantized.gguf", dequantize=True)
    exact = llama_cpp_logits(same_weights, ids)
    span = exact.max() - exact.min()
    if ftype == "F32":
        expected = hf_logits(ref, ids)
        assert np.abs(ours - expected).max() <= 1e-4 * span
        assert np.abs(ours - exact).max() <= np.abs(exact - expected).max() + 1e-4 * span
    else:
        theirs = llama_cpp_logits(path, ids)
        noise = np.abs(theirs - exact).max(axis=1)
        gelu = np.abs(ours - exact).max()  # on the same weights: llama.cpp's GELU table, as at float32
        assert (np.abs(ours - theirs).max(axis=1) <= noise + gelu + 1e-4 * span).all()
    monkeypatch.setattr(CpuOps, "geglu", lambda self, gate, up: ggml_gelu(gate) * up)
    monkeypatch.setattr(CpuOps, "geglu_matmul", lambda self, x, gate, up, rows=None:
                        ggml_gelu(self.matmul(x, gate, rows)) * self.matmul(x, up, rows))
    as_llama_cpp = ember.load(path, kv_dtype="f32", prompt_act="f32").logits(ids)
    # 3e-3: float32 rounding between two engines, which moves with llama.cpp's build (2.4e-3 of the span
    # against its AVX2 build on the dense Q8_0 file, Zen 3, 2026-11-30; within 2e-3 on AVX-512 machines)
    assert np.abs(as_llama_cpp - exact).max() <= min(3e-3 * span, np.abs(ours - exact).max())
    if ftype != "F32":  # prompt_act q8_0 (the default with VNNI): as far from the exact logits as llama.cpp's quantized
        monkeypatch.undo()  # activations take it (measured 18-40% of the range on this random model, both)
        quantized = ember.load(path, kv_dtype="f32", prompt_act="q8_0").logits(ids)
        assert np.abs(quantized - exact).max() <= 1.25 * noise.max() + 1e-4 * span


# --- tokenizer and chat template ----------------------------------------------------------------------
def test_tokenizer_equals_llama_cpp_test_vectors() -> None:
    """Gemma 4's vocabulary (262144 tokens, llama.cpp's ggml-vocab-gemma-4.gguf): every one of
    llama.cpp's test texts (multilingual, whitespace runs, emoji; the ids transformers' tokenizer gave
    them when llama.cpp made the file) encodes to its ids, and decodes back to the text."""
    vocab = llama_cpp_file("models/ggml-vocab-gemma-4.gguf")
    tok = Tokenizer.from_gguf(gguf_metadata(vocab))
    texts = vocab.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = vocab.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) >= 40
    for text, ids in zip(texts, expected, strict=False):
        got = tok.encode(text, add_special=False)
        assert got == [int(i) for i in ids.split()], repr(text)
        assert tok.decode(got) == text
    assert tok.encode("Hi")[0] == tok.bos_id == 2 and tok.add_bos  # llama.cpp adds BOS to every gemma4 prompt


@pytest.mark.oracle
def test_tokenizer_equals_llama_cpp() -> None:
    """The tokenizer corpus with Gemma 4's turn markers mixed in, special tokens parsed, BOS added: the
    ids llama.cpp gives on the same vocabulary."""
    llama_cpp = pytest.importorskip("llama_cpp")
    vocab = llama_cpp_file("models/ggml-vocab-gemma-4.gguf")
    tok = Tokenizer.from_gguf(gguf_metadata(vocab))
    llm = llama_cpp.Llama(model_path=str(vocab), vocab_only=True, verbose=False)
    for text in corpus(300, specials=("<|turn>", "<turn|>", "<eos>")):
        assert tok.encode(text) == llm.tokenize(text.encode(), add_bos=True, special=True), repr(text)


CONVERSATIONS = [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Bonjour ! Ça va ?"},
      {"role": "assistant", "content": "Oui, merci."}, {"role": "user", "content": "日本語で答えて。"}], {}),
    ([{"role": "user", "content": "Think first: 17 * 23?"}], {"enable_thinking": True}),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
          "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
      {"role": "tool", "name": "get_weather", "content": "{\"temp\": 21, \"sky\": \"sunny\"}"},
      {"role": "assistant", "content": "21 °C and sunny."}], {"tools": [{"type": "function", "function": {
          "name": "get_weather", "description": "The weather in a city.", "parameters": {
              "type": "object", "properties": {"city": {"type": "string"},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
              "required": ["city"]}}}]}),
]


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_chat_template_equals_transformers(case: int, generation_prompt: bool) -> None:
    """Gemma 4's own chat template (google-gemma-4-31B-it.jinja, as llama.cpp keeps it) renders each
    conversation (system, multilingual turns, thinking, tools with calls and results) as transformers'
    apply_chat_template does."""
    transformers = pytest.importorskip("transformers")
    source = llama_cpp_file("models/templates/google-gemma-4-31B-it.jinja").read_text(encoding="utf-8")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO_TOKENIZER / "tokenizer.json"),
                                              bos_token="<bos>", eos_token="<eos>")
    messages, extra = CONVERSATIONS[case]
    expected = hf.apply_chat_template(messages, chat_template=source, tokenize=False,
                                      add_generation_prompt=generation_prompt, **extra)
    assert ChatTemplate(source, "<bos>", "<eos>").render(messages, generation_prompt, **extra) == expected


# --- the seed's 24 GB card (modular PR #6698) ---------------------------------------------------------
# Gemma 4 31B's published shape: 60 layers, every 6th full (head_dim 512, 4 KV heads assumed, values
# from keys), the rest sliding over 1024 positions (head_dim 256, 16 KV heads), 32 query heads,
# hidden 5376, FFN 21504, 262144 tokens; weights at 4.5 bits (Q4_K's 144 bytes a 256-value row)
GEMMA4_31B = ModelConfig(
    arch="gemma4", n_layers=60, hidden=5376, n_heads=32, n_kv_heads=16, head_dim=512, ffn=21504, vocab=262144,
    context_length=262144, rope_theta=1e6, norm_eps=1e-6, sliding_layers=tuple((i + 1) % 6 != 0 for i in range(60)),
    sliding_window=1024, rope_theta_swa=1e4, rope_dim_swa=256, rope_turning=0.25,
    layer_kv_heads=tuple(4 if (i + 1) % 6 == 0 else 16 for i in range(60)),
    layer_head_dims=tuple(512 if (i + 1) % 6 == 0 else 256 for i in range(60)), attn_scale=1.0, ffn_act="gelu_tanh",
    embed_scale=5376**0.5, logit_softcap=30.0)
FLAT_RULE = 15 * 10**9  # what the seed's engine reserved for activations on every device


def four_bit(cfg: ModelConfig) -> ModelHeaders:
    def q4(name: str, rows: int, cols: int) -> TensorInfo:
        return TensorInfo(name, (rows, cols), rows * cols // 256 * 144)

    tensors = [q4("token_embd.weight", cfg.vocab, cfg.hidden)]
    for i in range(cfg.n_layers):
        q, kv = cfg.heads(i) * cfg.head_dim_at(i), cfg.kv_heads(i) * cfg.head_dim_at(i)
        tensors += [q4(f"blk.{i}.attn_q.weight", q, cfg.hidden), q4(f"blk.{i}.attn_k.weight", kv, cfg.hidden),
                    q4(f"blk.{i}.attn_output.weight", cfg.hidden, q),
                    *(q4(f"blk.{i}.ffn_{p}.weight", cfg.ffn, cfg.hidden) for p in ("gate", "up")),
                    q4(f"blk.{i}.ffn_down.weight", cfg.hidden, cfg.ffn)]
        tensors += [] if not cfg.window(i) else [q4(f"blk.{i}.attn_v.weight", kv, cfg.hidden)]
    return ModelHeaders("/models/gemma-4-31b-q4.gguf", "gguf", cfg, tuple(tensors))


@pytest.mark.parametrize("ctx", [4096, 32768])
def test_31b_on_a_24gib_card(ctx: int) -> None:
    """The seed: a 4-bit Gemma 4 31B on a 24 GiB GPU, refused by a flat 15 GB activation reservation,
    fits ember's plan: activations sized from the batch and the dimensions (the 21504-wide FFN
    over a 256-token step), the sliding layers' KV a ring of their window."""
    request = PlanRequest.create((Device("cuda:0", 24 * GiB, (8, 9)),), env={}, ctx=ctx, seqs=1)
    plan = build_plan(four_bit(GEMMA4_31B), request)
    device = plan.devices[0]
    assert plan.fits, explain(plan)
    assert device.activations.bytes < 1 * GiB < FLAT_RULE
    assert device.weights.total + device.kv_cache + FLAT_RULE > 24 * GiB  # the flat rule refuses it
    # KV in f16: 10 full layers of 4 heads of 512 over ctx, 50 sliding ones of 16 heads of 256 over a
    # ring of (1023 + 256) positions rounded up to whole blocks (1280)
    assert device.kv_cache == 2 * 2 * (10 * 4 * 512 * ctx + 50 * 16 * 256 * 1280)


# --- hot and cold experts -----------------------------------------------------------------------------
@pytest.mark.slow
def test_cold_experts_on_gemma4_equal_all_hot(hf_model, tmp_path: Path, monkeypatch) -> None:
    """The MoE block with half of each layer's experts hot and the rest computed by two cold workers
    (GELU experts, scaled per expert, there too): the logits of a 40-token prompt (past the window) and
    24 decoded tokens are the all-hot model's; the lossy `mask` policy runs and differs."""
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))  # routing statistics of this test only
    path, _ = hf_model("gemma4", **CASES["moe"])
    hot, s = cold_equals_all_hot(path, "50%")
    assert sum(hot) == 24 and all(0 < h < 8 for h in hot)  # 6 layers of 8 experts, half hot
    assert s.total_experts == 48 and s.cold_slots > 0 and s.worker_restarts == 0
