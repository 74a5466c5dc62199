"""The memory planner (daemon/planning/planner.py) and `ember plan`: byte counts computed by hand in each test
(never by calling the planner's own helpers), metadata read from real GGUF files and HF directories
without reading weights, the refusal message, and the activation estimate against a measured peak."""
from __future__ import annotations

import ctypes
import json
import os
import re
import tracemalloc
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from ember.daemon.loader.demo_model import DEMO_MODEL
from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.planning.planner import (GiB, MiB, Device, DraftModel, ModelHeaders, PlanDoesNotFit, PlanError,
                                  PlanRequest, SpeculativeSettings, TensorInfo, build_plan, layer_of, parse_device,
                                  parse_size, plan_model, read_model_info, split_layers, weight_class, with_request,
                                  LayerWeights)
from ember.daemon.planning.precision import PrecisionSettings
from gguf_writer import write_out

QWEN3_8B = ModelConfig(arch="qwen3", n_layers=36, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=12288,
                       vocab=151936, context_length=40960, rope_theta=1e6, norm_eps=1e-6)
MIXTRAL = ModelConfig(arch="llama", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336,
                      vocab=32000, context_length=32768, rope_theta=1e6, norm_eps=1e-5, n_experts=8, n_experts_used=2)
CPU = Device("cpu", 64 * GiB)


def shape_only(cfg: ModelConfig) -> ModelHeaders:
    return ModelHeaders("/models/shape-only.gguf", "gguf", cfg, (TensorInfo("token_embd.weight", (cfg.vocab, cfg.hidden), 0),))


def plan(cfg: ModelConfig, devices: tuple[Device, ...] = (CPU,), kv: str | None = None, feature: str | None = None,
         **options: object):
    options.setdefault("cpu_threads", 2)
    request = PlanRequest.create(devices, flags=PrecisionSettings(kv=kv, feature=feature), env={}, **options)
    return build_plan(shape_only(cfg), request)


# --- KV cache ---------------------------------------------------------------------------------------
def test_kv_cache_qwen3_8b_by_hand() -> None:
    # 36 layers x 8 kv heads x 128 x 2 (K and V) x ctx x bytes (f16 by default)
    assert plan(QWEN3_8B, ctx=4096).devices[0].kv_cache == 36 * 8 * 128 * 2 * 4096 * 2 == 603_979_776
    assert plan(QWEN3_8B, ctx=4096, kv="f32").devices[0].kv_cache == 1_207_959_552
    assert plan(QWEN3_8B, ctx=4096, kv="bf16").devices[0].kv_cache == 603_979_776
    # q8_0: each head's 128 values are 4 blocks of 34 bytes
    assert plan(QWEN3_8B, ctx=4096, kv="q8_0").devices[0].kv_cache == 36 * 8 * (4 * 34) * 2 * 4096 == 320_864_256


def test_kv_cache_rounds_to_whole_blocks_per_sequence() -> None:
    # ctx 1000 -> 63 blocks of 16 = 1008 tokens, for each of 3 sequences
    assert plan(QWEN3_8B, ctx=1000, seqs=3, kv="f16").devices[0].kv_cache == 36 * 8 * 128 * 2 * 1008 * 3 * 2 == 445_906_944


def test_default_ctx_is_the_models_and_beyond_it_is_refused() -> None:
    assert plan(QWEN3_8B).ctx == 40960
    with pytest.raises(PlanError, match="ctx 50000 exceeds the model's context length 40960"):
        plan(QWEN3_8B, ctx=50000)


def test_q8_0_kv_needs_whole_blocks_per_head() -> None:
    odd = ModelConfig(**{**QWEN3_8B.__dict__, "head_dim": 80})
    with pytest.raises(PlanError, match="q8_0 KV cache needs head_dim divisible by 32; this model's is 80"):
        plan(odd, kv="q8_0")


# --- activations --------------------------------------------------------------------------------------
def test_activation_estimate_by_hand() -> None:
    a = plan(QWEN3_8B, ctx=4096, act_safety=4.0).devices[0].activations
    # widest = max(hidden 4096, q 32 x 128, ffn 12288) = 12288; tokens = max(1 seq, chunk 256) = 256
    assert (a.widest, a.tokens, a.elem_bytes, a.rule) == (12288, 256, 4, "estimate")
    assert a.buffers == 12288 * 256 * 4 * 4 == 50_331_648
    assert a.logits == 151936 * 4 == 607_744
    assert a.sampler == 12 * 607_744 == 7_292_928
    assert a.scratch == 2 * (16 * 12288 + 4096) * 4 == 1_605_632  # 2 threads: 16 weight rows + a score row
    # the layers' buffers outweigh logits + sampler, so they make the peak
    assert a.bytes == a.estimate == 50_331_648 + 1_605_632


def test_measured_safety_factor_by_hand() -> None:
    # 1.02 x (3 widest-sized + 3 hidden-sized buffers per token): 1.02 x (3 + 3 x 4096 / 12288) = 4.08
    a = plan(QWEN3_8B, ctx=4096).devices[0].activations
    assert a.safety == pytest.approx(4.08)
    assert a.buffers == 51_338_281  # ceil(12288 x 256 x 4 x 4.08) = ceil(51_338_280.96)
    assert a.bytes == 51_338_281 + 1_605_632
    wide = ModelConfig(**{**QWEN3_8B.__dict__, "ffn": 4096 * 8})  # hidden/ffn 1/8: 1.02 x 3.375
    assert plan(wide, ctx=4096).devices[0].activations.safety == pytest.approx(3.4425)


def test_logits_make_the_peak_with_many_sequences() -> None:
    a = plan(QWEN3_8B, ctx=4096, seqs=64, prefill_chunk=16, act_safety=4.0).devices[0].activations
    assert a.tokens == 64  # max(64 sequences, chunk 16)
    assert a.buffers == 12288 * 64 * 4 * 4 == 12_582_912
    assert a.bytes == 64 * 151936 * 4 + 12 * 151936 * 4 + 1_605_632 == 47_794_176


def test_activation_cap_and_fallback() -> None:
    capped = plan(QWEN3_8B, ctx=4096, act_safety=4.0, act_cap=32 * MiB).devices[0].activations
    assert (capped.bytes, capped.rule, capped.estimate) == (33_554_432, "cap", 51_937_280)
    no_ffn = ModelConfig(**{**QWEN3_8B.__dict__, "ffn": 0})  # FFN width missing from the metadata
    fallback = plan(no_ffn, ctx=4096).devices[0].activations
    assert (fallback.bytes, fallback.rule, fallback.estimate) == (2 * GiB, "fallback", None)
    gpu = plan(no_ffn, devices=(Device("cuda:0", 24 * GiB),), ctx=4096).devices[0].activations
    assert (gpu.bytes, gpu.rule) == (1 * GiB, "fallback")


def test_activation_on_a_gpu_uses_the_staging_dtype() -> None:
    d = plan(QWEN3_8B, devices=(Device("cuda:0", 24 * GiB, (8, 9)),), ctx=4096, act_safety=4.0).devices[0]
    assert d.activations.elem_bytes == 2  # bf16: native from compute capability 8.0
    # no sampler or kernel scratch on the device: sampling runs on the host
    assert d.activations.bytes == 12288 * 256 * 2 * 4 == 25_165_824
    assert d.graph_headroom == 256 * MiB


def test_moe_widest_buffer_is_expert_width_times_experts_used() -> None:
    # Mixtral GGUF has no expert_feed_forward_length: an expert is as wide as the FFN
    a = plan(MIXTRAL, ctx=4096, act_safety=4.0).devices[0].activations
    assert a.widest == 14336 * 2 == 28672
    assert a.buffers == 28672 * 256 * 4 * 4


# --- layer split, staging, feature mirror -----------------------------------------------------------------
def test_split_layers_gives_every_device_a_layer_then_the_rest_by_budget() -> None:
    def counts(n: int, *budgets: int) -> list[int]:
        return [b - a for a, b in split_layers(n, [Device(f"d{i}", b) for i, b in enumerate(budgets)])]

    assert counts(2, 128 * GiB, 80 * GiB) == [1, 1]  # proportional rounding alone left the GPU no layer
    assert counts(5, 1, 1) == [3, 2]  # a tie: the earlier device takes the odd layer
    assert counts(7, 1, 1, 1) == [3, 2, 2]
    assert counts(36, 24, 8) == [27, 9]
    assert counts(3, 1, 1000) == [1, 2]
    assert counts(10, 0, 0) == [5, 5]  # no budgets: equal shares


def test_split_layers_balances_bytes_with_the_head_on_the_last_device() -> None:
    def counts(weights: LayerWeights, *budgets: int) -> list[int]:
        bounds = split_layers(len(weights.layers), [Device(f"d{i}", b) for i, b in enumerate(budgets)], None, weights)
        return [b - a for a, b in bounds]

    qwen3_8b = LayerWeights((200,) * 36, 680)  # a vocab x hidden head as heavy as 3.4 layers
    assert counts(qwen3_8b, 1, 1) == [20, 16]  # not 18, 18: half of 36 x 200 + 680 is 3940 bytes
    assert counts(qwen3_8b, 3, 1) == [30, 6]  # 6000 : 1880 bytes, nearest 3 : 1
    assert counts(LayerWeights((100,) * 4, 100), 1, 1) == [3, 1]  # 300 : 200 or 200 : 300, a tie: the earlier
    assert counts(LayerWeights((100,) * 2, 10_000), 1, 1) == [1, 1]  # a layer each, whatever the head
    assert counts(LayerWeights((100,) * 5, 0), 1, 1, 1) == [2, 1, 2]  # cuts nearest 166.7 and 333.3
    demo = LayerWeights.of(read_model_info(DEMO_MODEL))
    assert demo.layers == (1674752,) * 5 and demo.head == 3342336  # tied: the embedding's bytes


def test_split_staging_and_kv_per_device() -> None:
    devices = (Device("cuda:0", 24 * GiB, (8, 9)), Device("cuda:1", 24 * GiB, (7, 5)))
    p = plan(QWEN3_8B, devices=devices, ctx=4096)
    assert p.request.policy.act == "f16"  # common to both: cuda:1 has no native bf16
    d0, d1 = p.devices
    assert (d0.layers, d1.layers) == ((0, 18), (18, 36))  # proportional to equal budgets
    assert d0.kv_cache == d1.kv_cache == 18 * 8 * 128 * 2 * 4096 * 2 == 301_989_888
    # one boundary: hidden x tokens per step (256) x 2 bytes (f16) x 2 buffers, on the receiving device;
    # and the last stage's logits rows: 2 lanes x 256 tokens x vocab x 4 bytes
    assert (d0.staging, d1.staging) == (0, 4096 * 256 * 2 * 2 + 2 * 256 * 151936 * 4) == (0, 315_359_232)
    assert d0.activations.logits == 0 and d1.activations.logits == 151936 * 4  # logits on the last device only
    uneven = plan(QWEN3_8B, devices=(Device("cuda:0", 24 * GiB), Device("cuda:1", 12 * GiB)), ctx=4096)
    assert [d.layers for d in uneven.devices] == [(0, 24), (24, 36)]
    given = plan(QWEN3_8B, devices=devices, ctx=4096, split=(20, 16))
    assert [d.layers for d in given.devices] == [(0, 20), (20, 36)]
    with pytest.raises(PlanError, match="split 20,10 does not add up to the model's 36 layers"):
        plan(QWEN3_8B, devices=devices, split=(20, 10))


@pytest.mark.parametrize("dtype, expected", [
    ("f32", 2048 * 3 * 4096 * 4),  # 100_663_296
    ("f16", 2048 * 3 * 4096 * 2),
    ("bf16", 2048 * 3 * 4096 * 2),
    ("q8_0", 2048 * (3 * 4096 // 32) * 34),  # 26_738_688: 34 bytes per 32 values
])
def test_feature_mirror(dtype: str, expected: int) -> None:
    spec = SpeculativeSettings(feature_layers=3)
    assert plan(QWEN3_8B, ctx=2048, feature=dtype, speculative=spec).devices[0].feature_mirror == expected
    # a row per KV-cache position: each sequence has its own, rounded up to whole KV blocks
    assert plan(QWEN3_8B, ctx=1020, seqs=2, feature=dtype, speculative=spec).devices[0].feature_mirror == expected


def test_no_mirror_without_speculation() -> None:
    assert plan(QWEN3_8B, ctx=4096).devices[0].feature_mirror == 0


# --- weights by class -------------------------------------------------------------------------------------
def tiny_inventory(tied: bool = False) -> ModelHeaders:
    cfg = ModelConfig(arch="llama", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, vocab=100,
                      context_length=256, rope_theta=1e4, norm_eps=1e-5)
    q8 = lambda rows, cols: rows * cols // 32 * 34  # noqa: E731
    t = [TensorInfo("token_embd.weight", (100, 64), q8(100, 64)), TensorInfo("output_norm.weight", (64,), 256),
         TensorInfo("rope_freqs.weight", (16,), 64)]
    if not tied:
        t.append(TensorInfo("output.weight", (100, 64), q8(100, 64)))
    layer = {"attn_norm": (64,), "attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
             "ffn_norm": (64,), "ffn_gate": (128, 64), "ffn_up": (128, 64), "ffn_down": (64, 128)}
    for i in range(2):
        t += [TensorInfo(f"blk.{i}.{k}.weight", s, 256 if len(s) == 1 else q8(*s)) for k, s in layer.items()]
    return ModelHeaders("/models/tiny.gguf", "gguf", cfg, tuple(t))


def test_weights_by_class_on_the_cpu() -> None:
    w = build_plan(tiny_inventory(), PlanRequest.create([CPU], env={})).devices[0].weights
    # matrices at file size (mmap'd); vectors: their f32 copy (n x 4) plus the mapped file bytes
    assert w.embeddings == 100 * 2 * 34 == 6800
    assert w.output == 6800 + (64 * 4 + 256) == 7312
    assert w.attention == 2 * ((64 * 4 + 256) + 4352 + 2176 + 2176 + 4352) == 27136
    assert w.dense_ffn == 2 * ((64 * 4 + 256) + 3 * 8704) == 53248
    assert w.other == 16 * 4 + 64 == 128
    assert (w.experts, w.total) == (0, 94624)


def test_weights_split_across_gpus_and_tied_output_copied() -> None:
    gpus = [Device("cuda:0", GiB), Device("cuda:1", GiB)]
    d0, d1 = build_plan(tiny_inventory(), PlanRequest.create(gpus, env={})).devices
    # on a GPU a vector is its f32 copy only; layer 0 on cuda:0, layer 1 on cuda:1
    assert (d0.weights.embeddings, d0.weights.output, d0.weights.attention) == (6800, 0, 256 + 13056)
    assert (d1.weights.embeddings, d1.weights.output, d1.weights.dense_ffn) == (0, 6800 + 256, 256 + 3 * 8704)
    assert d0.weights.other == d1.weights.other == 64  # rope_freqs: every device reads it
    t0, t1 = build_plan(tiny_inventory(tied=True), PlanRequest.create(gpus, env={})).devices
    assert (t0.weights.embeddings, t1.weights.output) == (6800, 256 + 6800)  # the output projection IS the embedding


@pytest.mark.parametrize("name, cls, layer", [
    ("token_embd.weight", "embeddings", None), ("model.embed_tokens.weight", "embeddings", None),
    ("output.weight", "output", None), ("lm_head.weight", "output", None), ("model.norm.weight", "output", None),
    ("blk.3.attn_q.weight", "attention", 3), ("blk.3.attn_norm.weight", "attention", 3),
    ("model.layers.3.self_attn.k_proj.weight", "attention", 3), ("model.layers.0.input_layernorm.weight", "attention", 0),
    ("blk.2.ffn_down.weight", "dense_ffn", 2), ("blk.2.ffn_gate_inp.weight", "dense_ffn", 2),
    ("blk.2.ffn_up_shexp.weight", "dense_ffn", 2), ("model.layers.1.mlp.gate.weight", "dense_ffn", 1),
    ("model.layers.1.post_attention_layernorm.weight", "dense_ffn", 1),
    ("model.layers.1.block_sparse_moe.gate.weight", "dense_ffn", 1),
    ("blk.2.ffn_gate_exps.weight", "experts", 2), ("model.layers.12.mlp.experts.7.down_proj.weight", "experts", 12),
    ("model.layers.1.block_sparse_moe.experts.0.w1.weight", "experts", 1), ("rope_freqs.weight", "other", None),
])
def test_weight_classes(name: str, cls: str, layer: int | None) -> None:
    assert (weight_class(name), layer_of(name)) == (cls, layer)


# --- MoE ----------------------------------------------------------------------------------------------------
def moe_inventory() -> ModelHeaders:
    cfg = ModelConfig(arch="qwen3moe", n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn=128, vocab=100,
                      context_length=256, rope_theta=1e4, norm_eps=1e-6, n_experts=4, n_experts_used=2, expert_ffn=32)
    t = [TensorInfo("token_embd.weight", (100, 64), 6800)]
    for i in range(2):  # 4 experts x [32, 64] at q8_0: 4 x 32 x 2 blocks x 34 = 8704 bytes per tensor
        t += [TensorInfo(f"blk.{i}.ffn_{k}_exps.weight", (4, 32, 64) if k != "down" else (4, 64, 32), 8704)
              for k in ("gate", "up", "down")]
    return ModelHeaders("/models/moe.gguf", "gguf", cfg, tuple(t))


def test_hot_experts_fill_what_remains_with_offload() -> None:
    info = moe_inventory()
    # fixed on the GPU: embeddings 6800 + KV 2 layers x 2 x 2 heads x 16 x 64 tokens x 2 (f16) + activations capped
    # at 1000
    fixed = 6800 + 2 * 2 * 2 * 16 * 64 * 2 + 1000
    assert fixed == 24184
    one_expert = 3 * 8704 // 4  # its gate, up and down rows in one layer
    gpu = Device("cuda:0", fixed + 3 * one_expert + 100)
    common = dict(env={}, ctx=64, act_cap=1000, graph_headroom=0)
    offload = build_plan(info, PlanRequest.create([gpu], expert_offload=True, **common)).devices[0]
    assert offload.expert_bytes == one_expert == 6528
    assert (offload.fits, offload.experts_hot, offload.free) == (True, 3 * 6528, 100)
    assert offload.weights.experts - offload.experts_hot == 2 * 3 * 8704 - 3 * 6528  # cold: CPU workers
    resident = build_plan(info, PlanRequest.create([gpu], **common))
    assert not resident.fits and resident.devices[0].required == fixed + 2 * 3 * 8704
    with pytest.raises(PlanDoesNotFit, match=r"(?s)Too big: the MoE experts.*--expert-offload"):
        resident.check()


# --- reading metadata from files -------------------------------------------------------------------------------
def write_gguf(path: Path, arch: str, meta: dict[str, int], tensors: dict[str, np.ndarray]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    write_out(w, tensors)
    return path


def test_qwen3moe_gguf_metadata(tmp_path: Path) -> None:
    f16 = lambda *s: np.zeros(s, np.float16)  # noqa: E731
    f32 = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    tensors = {"token_embd.weight": f32(100, 64), "output_norm.weight": f32(64)}
    for i in range(2):
        tensors |= {f"blk.{i}.attn_norm.weight": f32(64), f"blk.{i}.attn_q.weight": f16(64, 64),
                    f"blk.{i}.attn_k.weight": f16(32, 64), f"blk.{i}.attn_v.weight": f16(32, 64),
                    f"blk.{i}.attn_output.weight": f16(64, 64), f"blk.{i}.ffn_norm.weight": f32(64),
                    f"blk.{i}.ffn_gate_inp.weight": f32(4, 64), f"blk.{i}.ffn_gate_exps.weight": f16(4, 32, 64),
                    f"blk.{i}.ffn_up_exps.weight": f16(4, 32, 64), f"blk.{i}.ffn_down_exps.weight": f16(4, 64, 32)}
    meta = {"block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
            "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16, "expert_count": 4,
            "expert_used_count": 2, "expert_feed_forward_length": 32}
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", meta, tensors)
    d = plan_model(path, PlanRequest.create([CPU], env={}, cpu_threads=2)).devices[0]
    assert d.weights.embeddings == 100 * 64 * 4
    assert d.weights.attention == 2 * ((64 * 4 + 256) + 2 * (8192 + 4096))
    assert d.weights.dense_ffn == 2 * ((64 * 4 + 256) + 4 * 64 * 4)  # norm and router
    assert d.weights.experts == 2 * 3 * 4 * 32 * 64 * 2 == 98304
    assert d.expert_bytes == 98304 // (2 * 4)
    assert d.activations.widest == 128  # max(hidden 64, q 64, ffn 128, 32 x 2 experts used)


def test_hf_moe_directory_counts_the_experts(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {"model.embed_tokens.weight": np.zeros((100, 64), np.float32),
               "model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float16),
               "model.layers.0.mlp.gate.weight": np.zeros((4, 64), np.float32)}
    for e in range(4):
        for k, s in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
            tensors[f"model.layers.0.mlp.experts.{e}.{k}.weight"] = np.zeros(s, np.float16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    d = plan_model(tmp_path, PlanRequest.create([CPU], env={})).devices[0]
    assert (d.weights.embeddings, d.weights.attention, d.weights.dense_ffn) == (25600, 8192, 1024)
    assert d.weights.experts == 12 * 32 * 64 * 2 == 49152
    assert d.activations.widest == 128


def test_demo_model_weights_match_the_file() -> None:
    reader = gguf.GGUFReader(DEMO_MODEL)
    matrices = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) > 1)
    vectors = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 1)  # all F32 in this file
    w = plan_model(DEMO_MODEL, PlanRequest.create([CPU], env={})).devices[0].weights
    assert w.total == matrices + 2 * vectors


def test_every_block_type_sized_as_stored(hf_model, tmp_path: Path) -> None:
    """A file of the newer block types (Q4_0 ... IQ4_XS): the plan's weights are the file's bytes."""
    from gguf_writer import NEWER, write_gguf
    from references import state_dict

    _, ref = hf_model("qwen3", hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_gguf(tmp_path / "newer.gguf", ref.config, state_dict(ref), NEWER)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K",
                                                           "IQ4_XS"}
    matrices = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) > 1)
    vectors = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 1)
    assert plan_model(path, PlanRequest.create([CPU], env={})).devices[0].weights.total == matrices + 2 * vectors


# --- no weight is read ------------------------------------------------------------------------------------
def resident_fraction(path: Path, start: int, end: int) -> float:
    """Fraction of the file's pages in [start, end) that are in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED: mapping reads nothing
        vec = (ctypes.c_ubyte * (-(-size // page)))()
        if libc.mincore(addr, size, vec) != 0:
            pytest.skip(f"mincore failed (errno {ctypes.get_errno()})")
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    pages = np.frombuffer(vec, np.uint8) & 1
    return float(pages[start // page : end // page].mean())


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_refused_before_any_weight_is_read(tmp_path: Path) -> None:
    meta = {"block_count": 1, "context_length": 4096, "embedding_length": 1024, "feed_forward_length": 2048,
            "attention.head_count": 8, "attention.head_count_kv": 8}
    big = np.ones((8192, 1024), np.float32)  # 32 MiB of weights
    path = write_gguf(tmp_path / "big.gguf", "llama", meta, {"token_embd.weight": big, "output_norm.weight": big[0]})
    data_start = gguf.GGUFReader(path).data_offset
    end = path.stat().st_size
    drop_from_page_cache(path)
    if resident_fraction(path, data_start, end) > 0.01:
        pytest.skip("this filesystem keeps the file in the page cache; cannot observe reads")
    p = plan_model(path, PlanRequest.create([Device("cpu", 16 * MiB)], env={}))
    with pytest.raises(PlanDoesNotFit, match="does not fit cpu"):
        p.check()
    # the header and the kernel's readahead around it, not the 32 MiB of weights
    assert resident_fraction(path, data_start, end) < 0.05
    # control: reading the weights is visible to the same measurement
    from ember.daemon.loader.model_file import open_model_file

    float(np.asarray(open_model_file(path).tensors["token_embd.weight"].data).sum())
    assert resident_fraction(path, data_start, end) > 0.95


# --- the refusal message ----------------------------------------------------------------------------------
def test_message_names_the_component_and_working_fixes() -> None:
    p = plan_model(DEMO_MODEL, PlanRequest.create([Device("cpu", 30 * MiB)], env={}, ctx=4096, seqs=2,
                                                 cpu_threads=2))
    assert not p.fits
    with pytest.raises(PlanDoesNotFit) as e:
        p.check()
    message = str(e.value)
    assert e.value.plan is p
    assert "ember-demo-dense-q8_0.gguf does not fit cpu" in message
    assert "Too big: the KV cache (20.00 MiB" in message  # 5 layers x 2 heads x 64 x 2 x 4096 x 2 seqs x 2 B (f16)
    assert "--kv-dtype q8_0" in message and "another device" in message
    assert with_request(p, policy=replace(p.request.policy, kv="q8_0")).fits
    ctx = int(re.search(r"--ctx (\d+) fits", message).group(1))
    assert with_request(p, ctx=ctx).fits and not with_request(p, ctx=ctx + 16).fits


# --- measured against planned ------------------------------------------------------------------------------
def test_demo_model_step_peak_within_the_plan() -> None:
    """One 256-token step of the demo model (the default prefill chunk) plus sampling, measured with
    tracemalloc: the plan is above it and not by much. benchmarks/planner_calibration.py has the tight
    comparison over many shapes."""
    from ember.daemon.loader.model_file import open_model_file
    from ember.daemon.models.transformer import Transformer
    from ember.daemon.step.step_batch import StepBatch
    from ember.kernels import get_ops
    from ember.kernels.sampling import SamplingParams
    from ember.kernels.sampling_batch import sample

    net = Transformer(open_model_file(DEMO_MODEL), get_ops("cpu"))
    cache = net.new_cache(16, 16)
    batch = StepBatch.build([(list(range(1, 257)), 0, list(range(16)))], 16)
    params, rng = SamplingParams(temperature=0.8, top_p=0.9), np.random.default_rng(0)

    def step() -> None:
        for row in net.ops.to_numpy(net.forward(batch, cache)):
            sample(row, params, rng, [1], [])

    step()  # compile, touch
    tracemalloc.start()
    try:
        step()
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        step()
        measured = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    planned = plan_model(DEMO_MODEL, PlanRequest.create([CPU], env={}, ctx=256)).devices[0].activations.bytes
    assert measured <= planned <= 1.5 * measured, (planned, measured)


# --- device specs -------------------------------------------------------------------------------------------
def test_sizes_and_devices() -> None:
    assert parse_size("24GiB") == parse_size("24G") == 24 * 2**30
    assert parse_size("16GB") == 16 * 10**9
    assert parse_size("1.5MiB") == 1_572_864
    assert parse_size("4096") == 4096
    assert parse_device("cuda:1=11GiB@8.6") == Device("cuda:1", 11 * 2**30, (8, 6))
    assert parse_device("cuda=8GiB") == Device("cuda:0", 8 * 2**30)
    assert parse_device("cpu").budget > 0
    with pytest.raises(PlanError, match="not a size: '24 parsecs'"):
        parse_size("24 parsecs")
    with pytest.raises(PlanError, match="give the memory budget of cuda:0"):
        parse_device("cuda:0")
    with pytest.raises(PlanError, match="not a device: 'tpu:0=1G'"):
        parse_device("tpu:0=1G")


# --- ember plan ------------------------------------------------------------------------------------------------
def test_cli_json_document(capsys: pytest.CaptureFixture[str]) -> None:
    from ember.client.cli import main

    assert main(["plan", str(DEMO_MODEL), "--ctx", "1024", "--device", "cpu=1GiB", "--kv-dtype", "q8_0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "ember.plan/1" and doc["fits"] is True and doc["problem"] is None
    (dev,) = doc["devices"]
    assert dev["kv_cache"] == 5 * 2 * (2 * 34) * 2 * 1024  # 5 layers x 2 kv heads x 64 values (2 blocks) x K,V x ctx
    assert doc["precision"] == {"act": "f32", "feature": "f32", "kv": "q8_0",
                                "sources": {"act": "auto", "feature": "default", "kv": "flag"}}
    assert dev["required"] == (dev["weights"]["total"] + dev["kv_cache"] + dev["activations"]["bytes"])


def test_cli_table_and_exit_status_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    from ember.client.cli import main

    assert main(["plan", str(DEMO_MODEL), "--device", "cuda:0=200MiB", "--device", "cuda:1=200MiB"]) == 2
    out = capsys.readouterr().out
    assert re.search(r"layers\s+0-2\s+3-4", out)  # 5 layers over two equal budgets (by bytes, the tied head counted)
    assert "does not fit cuda:0" in out and "CUDA-graph headroom" in out
    assert main(["plan", str(DEMO_MODEL), "--device", "cpu=1GiB"]) == 0
    assert "It fits." in capsys.readouterr().out
    assert main(["plan", "/no/such/model.gguf"]) == 1
    assert "no such file" in capsys.readouterr().err


# --- a draft model (speculative decoding) -----------------------------------------------------------------
def test_draft_model_counted_and_allocated_as_planned() -> None:
    """The draft's weights as the target's are counted, its KV cache with the target's blocks in its own
    layers and heads, its proposals' distributions; the runtime's draft cache has exactly the planned
    bytes (the daemon's pool: seqs x ctx rounded to blocks)."""
    import ember
    from ember.daemon.loader.demo_model import DEMO_DRAFT

    reader = gguf.GGUFReader(DEMO_DRAFT)
    matrices = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) > 1)
    vectors = sum(int(t.n_bytes) for t in reader.tensors if len(t.shape) == 1)
    for kv, per_head in (("f32", 64 * 4), ("q8_0", 2 * 34)):
        request = PlanRequest.create([CPU], flags=PrecisionSettings(kv=kv), env={}, ctx=1000, seqs=3)
        alone, (d,) = plan_model(DEMO_MODEL, request).devices[0], plan_model(DEMO_MODEL, request, DEMO_DRAFT, 5).devices
        assert d.draft_weights == matrices + 2 * vectors
        assert d.draft_kv_cache == 2 * 2 * per_head * 2 * 1008 * 3  # 2 layers x 2 kv heads x head x K,V x ctx x seqs
        assert d.draft_proposals == 3 * 5 * 8192 * 8
        assert d.required == alone.required + d.draft + (d.activations.bytes - alone.activations.bytes)
        assert d.activations.logits == 3 * 6 * 8192 * 4  # the last token and 5 proposals per sequence
        model = ember.load(DEMO_MODEL, draft=DEMO_DRAFT, draft_tokens=5, kv_dtype=kv)
        engine = model.engine(3 * 1008, max_running=3)
        for planned, runner in ((d.kv_cache, engine.runner), (d.draft_kv_cache, engine.proposer.runner)):
            stores = runner.cache.k + runner.cache.v  # less the 1-element placeholders of the dtypes not used
            assert planned == sum(a.nbytes for s in stores for a in (s.f32, s.u16, s.i8, s.scales) if a.size > 1)


def test_ngram_proposals_count_their_logits_rows_only() -> None:
    """n-gram lookup (draft "ngram") has no model: the plan holds no draft, and its activations the
    logits of the last token and every proposal per sequence."""
    request = PlanRequest.create([CPU], flags=PrecisionSettings(kv="f16"), env={}, ctx=1000, seqs=3)
    alone, (d,) = plan_model(DEMO_MODEL, request).devices[0], plan_model(DEMO_MODEL, replace(request, proposals=7)).devices
    assert d.draft == 0 and d.kv_cache == alone.kv_cache and d.weights == alone.weights
    assert alone.activations.logits == 3 * 8192 * 4 and d.activations.logits == 3 * 8 * 8192 * 4


def test_a_draft_that_does_not_fit_is_named() -> None:
    from ember.daemon.loader.demo_model import DEMO_DRAFT

    request = PlanRequest.create([CPU], env={}, ctx=1024, seqs=64)
    alone = plan_model(DEMO_MODEL, request).devices[0].required
    two = plan_model(DEMO_MODEL, request, DEMO_DRAFT, 2).devices[0].required
    for budget, fix in ((two, r"fewer draft tokens \(--draft-tokens 2\)"), (alone + MiB, "no draft model")):
        tight = replace(request, devices=(Device("cpu", budget),))
        with pytest.raises(PlanDoesNotFit, match=r"draft model \d+.\d\d MiB\..*\n.*" + fix):
            plan_model(DEMO_MODEL, tight, DEMO_DRAFT, 4).check()
    with pytest.raises(PlanError, match="draft's vocabulary"):
        build_plan(read_model_info(DEMO_MODEL), PlanRequest.create([CPU], env={}), DraftModel(shape_only(QWEN3_8B)))


def test_a_draft_beside_a_split_is_counted_on_its_last_cpu_stage() -> None:
    """The draft runs in the engine's process, where the split's logits are sampled: its bytes go to the
    last stage, which must be a CPU one; a DFlash draft, which reads the target's hidden states, is refused."""
    from ember.daemon.loader.demo_model import DEMO_DFLASH, DEMO_DRAFT

    stages = [Device("cpu:0", 8 * GiB), Device("cpu:1", 8 * GiB)]
    request = PlanRequest.create(stages, env={}, ctx=1024, seqs=2, split=(3, 2))
    alone = plan_model(DEMO_MODEL, request).devices
    first, last = plan_model(DEMO_MODEL, request, DEMO_DRAFT, 4).devices
    assert first.draft == 0 and first.required == alone[0].required
    one = plan_model(DEMO_MODEL, PlanRequest.create([CPU], env={}, ctx=1024, seqs=2), DEMO_DRAFT, 4).devices[0]
    assert last.draft == one.draft > 0
    with pytest.raises(PlanError, match="last stage.*must be a CPU one, not cuda:0"):
        plan_model(DEMO_MODEL, PlanRequest.create([stages[0], Device("cuda:0", 8 * GiB)], env={}), DEMO_DRAFT)
    with pytest.raises(PlanError, match="hidden states.*split"):
        plan_model(DEMO_MODEL, request, DEMO_DFLASH)


def test_cli_counts_the_draft(capsys: pytest.CaptureFixture[str]) -> None:
    from ember.client.cli import main
    from ember.daemon.loader.demo_model import DEMO_DRAFT

    assert main(["plan", str(DEMO_MODEL), "--ctx", "1024", "--device", "cpu=1GiB", "--draft", str(DEMO_DRAFT),
                 "--draft-tokens", "3", "--json"]) == 0
    (dev,) = json.loads(capsys.readouterr().out)["devices"]
    assert dev["draft"]["kv_cache"] == 2 * 2 * 64 * 2 * 2 * 1024  # f16
    assert dev["draft"]["total"] == dev["draft"]["weights"] + dev["draft"]["kv_cache"] + dev["draft"]["proposals"]
    assert dev["required"] == (dev["weights"]["total"] + dev["kv_cache"] + dev["activations"]["bytes"] + dev["draft"]["total"])
