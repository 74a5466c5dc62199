"""Gemma 4: tiny random configurations against transformers' Gemma4ForCausalLM (HF directories):
sliding and full layers of their own shapes, values from the keys' projection, KV sharing, per-layer
embeddings, the double-wide FFN of the shared layers and the soft-capped head."""
from __future__ import annotations

import numpy as np
import pytest

import ember
from ember.daemon.loader.model_file import open_model_file
from references import hf_greedy, hf_logits

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
