"""Gemma 4: tiny random configurations against transformers' Gemma4ForCausalLM (HF directories):
sliding and full layers of their own shapes, values from the keys' projection, KV sharing, per-layer
embeddings, the double-wide FFN of the shared layers and the soft-capped head."""
from __future__ import annotations

import numpy as np
import pytest

import ember
from ember.daemon.loader.model_file import open_model_file
from ember.daemon.text.chat_template import ChatTemplate
from ember.daemon.text.tokenizer import Tokenizer
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
        assert (c.k_eq_v, c.layer_input_dim, c.logit_softcap, c.rope_turning) == (True, 16, 30.0, 0.25)
    rng = np.random.default_rng(3)
    for n in (1, 7, 40):
        ids = rng.integers(1, c.vocab, n).tolist()
        expected = hf_logits(ref, ids)
        assert np.abs(model.logits(ids) - expected).max() <= 1e-4 * (expected.max() - expected.min()), f"{n} tokens"
    prompt = rng.integers(1, c.vocab, 6).tolist()
    model32 = ember.load(path, decode_act="f32", kv_dtype="f32")
    assert list(model32.generate(prompt, max_tokens=64, ignore_eos=True)) == hf_greedy(ref, prompt, 64)


def test_shared_layers_keep_no_cache(hf_model) -> None:
    """The KV cache holds the four layers that compute K/V, each in its own shape; the two that share
    hold none."""
    path, _ = hf_model("gemma4")
    model = ember.load(path, kv_dtype="f32")
    cache = model.net.new_cache(4, 16, "f32")
    assert cache.shapes == [(2, 32), (2, 32), (1, 64), (2, 32)]
    assert len(cache.k) == len(cache.v) == 4


def test_config_and_names_from_a_directory(hf_model) -> None:
    """Every tensor gets the name llama.cpp's converter gives it, the by-hand ones included; the shared
    layers have no K/V projections and the full layers (k_eq_v) no V projection."""
    path, _ = hf_model("gemma4")
    names = set(open_model_file(path).tensors)
    assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight",
            "blk.0.inp_gate.weight", "blk.0.proj.weight", "blk.0.post_norm.weight", "blk.0.layer_output_scale.weight",
            "blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.attn_v.weight"} <= names
    assert "blk.2.attn_v.weight" not in names and "blk.4.attn_k.weight" not in names


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
