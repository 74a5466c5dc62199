"""ModelConfig: the dimensions and hyper-parameters of a model, read from GGUF metadata or an HF
config.json, and nothing else (no weights) — the runtime builds models from it and the memory planner
sizes memory from it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ember.daemon.loader.model_file_error import ModelFileError

# HF model_type -> the GGUF architecture name ember uses internally
HF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "mixtral": "mixtral",
                    "qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "qwen3_5_moe": "qwen35moe",
                    "qwen3_5_moe_text": "qwen35moe", "laguna": "laguna",
                    "gemma4": "gemma4", "gemma4_text": "gemma4"}

# architectures with linear-attention (Gated DeltaNet) layers beside full attention
HYBRID_ARCHES = ("qwen35", "qwen35moe")
# architectures with sliding-window layers, and which layers slide in a GGUF file that does not say
# (no attention.sliding_window_pattern): llama.cpp's default, every n-th layer full from layer 0
SLIDING_PATTERNS = {"laguna": 4, "gemma4": 6}
# GGUF expert_gating_func (gguf.ExpertGatingFuncType) -> ModelConfig.expert_gating
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear", "llama3" or "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    # yarn: the ramp between interpolated and extrapolated frequencies (its bounds in rotations, whether
    # they round outward, how much of the extrapolation it keeps), and the factor on cos and sin
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    ext_factor: float = 1.0
    attn_factor: float = 1.0


@dataclass(frozen=True)
class LinearAttention:
    """The Gated DeltaNet layers of a hybrid model (qwen35): which layers they are and their shapes.

    Each has a causal conv1d of `conv_kernel` taps over its q/k/v channels and a per-head recurrent
    state [k_dim, v_dim]; v_heads may be a multiple of k_heads (a key head serves several value heads)."""
    conv_kernel: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    recurrent: tuple[bool, ...]  # per layer: linear attention (True) or full attention

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def state_floats(self) -> int:
        """float32 values of one sequence's state in one linear layer: the conv window and the DeltaNet state."""
        return (self.conv_kernel - 1) * self.conv_channels + self.v_heads * self.k_dim * self.v_dim

    @property
    def n_layers(self) -> int:
        return sum(self.recurrent)


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context_length: int
    rope_theta: float
    norm_eps: float
    rope_scaling: RopeScaling | None = None
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    rope_dim: int = 0  # dimensions of a head that rotate (partial rotary); 0: all of head_dim
    linear: LinearAttention | None = None  # hybrid models: their linear-attention layers

    @property
    def rotary_dim(self) -> int:
        return self.rope_dim or self.head_dim

    @property
    def rope_attn_factor(self) -> float:
        """What rope multiplies cos and sin by (yarn's attention factor; 1 otherwise): the rotated
        dimensions of q and k scaled by it, their dot products by its square. Never on sliding layers."""
        s = self.rope_scaling
        return s.attn_factor if s is not None and s.kind == "yarn" else 1.0

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache of their own: all but a hybrid model's linear-attention layers and
        gemma4's KV-shared ones."""
        return self.n_layers - (self.linear.n_layers if self.linear else 0) - self.kv_shared_layers

    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (hybrid models; 0 for others): float32, every linear layer."""
        return 4 * self.linear.state_floats * self.linear.n_layers if self.linear else 0
    # renormalise the top-k routing weights to sum to 1 (HF norm_topk_prob; Mixtral always does)
    expert_norm: bool = True
    # how a router scores its experts: "softmax", or "sigmoid" (laguna: each expert's sigmoid, the
    # top-k picked by score + a per-expert bias, blk.N.exp_probs_b), its logits first soft-capped
    # to +-router_softcap (0: not), the chosen weights times expert_scale
    expert_gating: str = "softmax"
    expert_scale: float = 1.0
    router_softcap: float = 0.0
    # per layer, where they differ (laguna): query heads (n_heads is their largest), and whether
    # the layer attends through a sliding window of its last `sliding_window` keys; () for none
    layer_heads: tuple[int, ...] = ()
    sliding_layers: tuple[bool, ...] = ()
    sliding_window: int = 0
    # the sliding layers' own rope (laguna), unscaled: 0 takes rope_theta / all of head_dim
    rope_theta_swa: float = 0.0
    rope_dim_swa: int = 0
    # gemma4's full layers rotate by "proportional" rope: the first share of a head's frequency
    # pairs turn, the rest have frequency 0 (1.0: every pair turns)
    rope_turning: float = 1.0
    # per layer, where they differ (gemma4's full-attention layers): KV heads and head_dim; n_kv_heads
    # and head_dim are then the largest
    layer_kv_heads: tuple[int, ...] = ()
    layer_head_dims: tuple[int, ...] = ()
    # gemma4: the last kv_shared_layers layers compute no K/V; each attends over that of the last
    # earlier layer of its kind (sliding or full) — see kv_source
    kv_shared_layers: int = 0
    attn_scale: float = 0.0  # the scores' scale (0: head_dim^-1/2; gemma4's is 1, its q/k norms scale)
    ffn_act: str = "silu"  # the gated FFN's activation: "silu" or "gelu_tanh" (gemma4)
    embed_scale: float = 1.0  # the embedding's rows times this (gemma4: sqrt(hidden))
    logit_softcap: float = 0.0  # the logits soft-capped to +-this (0: not)
    # gemma4's per-layer embedding (PLE): a layer_input_dim-wide input per layer and token (0: none)
    layer_input_dim: int = 0

    def heads(self, layer: int) -> int:
        """Query heads of `layer`."""
        return self.layer_heads[layer] if self.layer_heads else self.n_heads

    def kv_heads(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.n_kv_heads

    def head_dim_at(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over: itself, or for gemma4's KV-shared
        layers the last layer of the same kind before the first of them (transformers'
        kv_sharing_modes)."""
        first = self.n_layers - self.kv_shared_layers
        if layer < first:
            return layer
        kind = self.window(layer)
        return max(i for i in range(first) if self.window(i) == kind)

    def owns_kv(self, layer: int) -> bool:
        """Whether `layer` keeps K/V of its own: an attention layer that shares none."""
        return (self.linear is None or not self.linear.recurrent[layer]) and self.kv_source(layer) == layer

    def window(self, layer: int) -> int:
        """The keys `layer` attends to back from each token, itself included (0: all of them)."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else 0

    def inv_freq(self, freq_factors: np.ndarray | None = None, sliding: bool = False) -> np.ndarray:
        """Rotary inverse frequencies [rotary_dim / 2] (float32), with any scaling applied; those of
        the sliding-window layers where `sliding` (their own theta and width, never scaled).

        GGUF llama3 files carry the scaling as a `rope_freqs` tensor of per-frequency divisors, which
        takes precedence over computing it.
        """
        if sliding:
            dim, theta = self.rope_dim_swa or self.head_dim, self.rope_theta_swa or self.rope_theta
            return (1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(np.float32)
        dim = self.rotary_dim
        inv = 1.0 / self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        if freq_factors is not None:
            inv = inv / freq_factors.astype(np.float64)
        elif self.rope_scaling is not None:
            inv = _scaled_inv_freq(inv, self.rope_scaling, self.rope_theta, dim)
        inv[int(self.rope_turning * dim // 2):] = 0.0  # proportional rope's still pairs (transformers' int())
        return inv.astype(np.float32)


def _scaled_inv_freq(inv: np.ndarray, s: RopeScaling, theta: float, dim: int) -> np.ndarray:
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "yarn":
        return _yarn_inv_freq(inv, s, theta, dim)
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    return np.where(wavelen > low_wavelen, inv / s.factor, np.where(wavelen < high_wavelen, inv, blended))


def _yarn_inv_freq(inv: np.ndarray, s: RopeScaling, theta: float, dim: int) -> np.ndarray:
    """YaRN (transformers' _compute_yarn_parameters, ggml's rope_yarn): frequencies that turn fewer than
    beta_slow times over the original context are interpolated (divided by the factor), those that
    turn more than beta_fast times kept, a linear ramp between."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / max(high - low, 0.001), 0, 1)
    kept = (1 - ramp) * s.ext_factor  # the share of each frequency extrapolated as it is
    return inv / s.factor * (1 - kept) + inv * kept


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def config_from_gguf(meta: Mapping[str, Any], n_vocab_rows: int, source: str) -> ModelConfig:
    arch = _require(meta, "general.architecture", source)

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelFileError(source, f"missing metadata key {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    layer_heads = _per_layer(get("attention.head_count"))
    n_heads = max(layer_heads)
    layer_kv_heads = _per_layer(get("attention.head_count_kv", n_heads))
    if len(set(layer_kv_heads)) != 1 and arch != "gemma4":
        raise ModelFileError(source, f"KV heads differ between layers ({sorted(set(layer_kv_heads))}): not supported")
    n_layers = int(get("block_count"))
    window = int(meta.get(f"{arch}.attention.sliding_window", 0)) if arch in SLIDING_PATTERNS else 0
    gating = int(meta.get(f"{arch}.expert_gating_func", 2 if arch == "laguna" else 1))
    if gating not in _GATING_FUNCS:
        raise ModelFileError(source, f"unsupported expert gating function {gating} (supported: 1 softmax, 2 sigmoid)")
    scaling = None
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind not in ("linear", "yarn"):
            raise ModelFileError(source, f"unsupported rope scaling type {kind!r} (supported: linear, llama3, yarn)")
        scaling = (RopeScaling("linear", float(get("rope.scaling.factor"))) if kind == "linear"
                   else _gguf_yarn(meta, arch, float(get("rope.scaling.factor")), int(get("context_length", 4096))))
    config = ModelConfig(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=max(layer_kv_heads),
        head_dim=int(get("attention.key_length", hidden // n_heads)),
        ffn=max(_per_layer(get("feed_forward_length", 0))),
        vocab=int(meta.get(f"{arch}.vocab_size", n_vocab_rows)),
        context_length=int(get("context_length", 4096)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_scaling=scaling,
        n_experts=int(get("expert_count", 0)),
        n_experts_used=int(get("expert_used_count", 0)),
        expert_ffn=int(get("expert_feed_forward_length", 0)),
        rope_dim=int(get("rope.dimension_count", 0)),
        linear=_gguf_linear(meta, arch, n_layers, source),
        # llama.cpp renormalises llama (Mixtral) and qwen3moe experts whatever the file says
        expert_norm=bool(meta.get(f"{arch}.expert_weights_norm", True)),
        expert_gating=_GATING_FUNCS[gating],
        expert_scale=float(meta.get(f"{arch}.expert_weights_scale", 0.0)) or 1.0,  # llama.cpp: 0 is unset
        layer_heads=_varying(layer_heads, n_layers),
        sliding_layers=_gguf_sliding(meta, arch, n_layers) if window else (),
        sliding_window=window,
        rope_theta_swa=float(meta.get(f"{arch}.rope.freq_base_swa", 0.0)) if window else 0.0,
        rope_dim_swa=int(meta.get(f"{arch}.rope.dimension_count_swa", 0)) if window else 0,
    )
    return _gguf_gemma4(config, meta, layer_kv_heads) if arch == "gemma4" else config


def _gguf_gemma4(config: ModelConfig, meta: Mapping[str, Any], kv_heads: list[int]) -> ModelConfig:
    """What llama.cpp's gemma4 reads beside the common keys: the sliding layers' own head_dim
    (key_length_swa; key_length is the full layers'), KV heads per layer, shared KV layers, the
    per-layer embedding width and the final soft-cap. Full layers' proportional rope comes as the
    rope_freqs tensor (a divisor of 1e30 on the pairs that stay still)."""
    n = config.n_layers
    swa_dim = int(meta.get("gemma4.attention.key_length_swa", config.head_dim))
    head_dims = [swa_dim if config.window(i) else config.head_dim for i in range(n)]
    kv_heads = kv_heads * n if len(kv_heads) == 1 else kv_heads[:n]
    return replace(
        config, layer_kv_heads=_varying(kv_heads, n), layer_head_dims=_varying(head_dims, n),
        rope_dim_swa=config.rope_dim_swa or swa_dim,
        kv_shared_layers=int(meta.get("gemma4.attention.shared_kv_layers", 0)),
        logit_softcap=float(meta.get("gemma4.final_logit_softcapping", 0.0)),
        layer_input_dim=int(meta.get("gemma4.embedding_length_per_layer_input", 0)), **_gemma4_fixed(config))


def _gemma4_fixed(config: ModelConfig) -> dict[str, Any]:
    """What every Gemma 4 has, whatever its file says: unscaled scores (the q/k norms scale), GELU-tanh,
    the embedding times sqrt(hidden), the sliding layers' rope theta 10000 unless given."""
    return dict(attn_scale=1.0, ffn_act="gelu_tanh", embed_scale=float(config.hidden) ** 0.5,
                rope_theta_swa=config.rope_theta_swa or 10000.0)


def _gguf_yarn(meta: Mapping[str, Any], arch: str, factor: float, context: int) -> RopeScaling:
    """YaRN as llama.cpp applies it: its attention factor is get_mscale(factor) (the file's
    yarn_attn_factor is overridden, llama_context's cparams), or DeepSeek's ratio where the file has a
    yarn_log_multiplier, times the file's rope.scaling.attn_factor."""
    def key(name: str, default: Any) -> Any:
        return meta.get(f"{arch}.rope.scaling.{name}", default)

    log_mul = float(key("yarn_log_multiplier", 0.0))
    attn = _yarn_mscale(factor) / (_yarn_mscale(factor, log_mul) if log_mul else 1.0)
    return RopeScaling("yarn", factor, original_context=int(key("original_context_length", context)),
                       beta_fast=float(key("yarn_beta_fast", 32.0)), beta_slow=float(key("yarn_beta_slow", 1.0)),
                       ext_factor=float(key("yarn_ext_factor", 1.0)),
                       attn_factor=attn * float(key("attn_factor", 1.0)))


def _per_layer(value: Any) -> list[int]:
    """A GGUF per-layer count, stored as one number or one per layer."""
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _varying(values: list[int], n_layers: int) -> tuple[int, ...]:
    """ModelConfig.layer_heads: () where every layer has the same count."""
    return () if len(set(values)) == 1 else tuple(values[:n_layers])


def _gguf_sliding(meta: Mapping[str, Any], arch: str, n_layers: int) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp's load_swa_pattern reads it: a per-layer array, or every
    n-th layer full (n from the file, else the architecture's default), layer 0 full."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", SLIDING_PATTERNS[arch])
    if isinstance(pattern, list):
        return tuple(bool(p) for p in pattern[:n_layers])
    n = int(pattern)
    return tuple(n == 0 or i % n != 0 for i in range(n_layers))


def _gguf_linear(meta: Mapping[str, Any], arch: str, n_layers: int, source: str) -> LinearAttention | None:
    if arch not in HYBRID_ARCHES:
        return None
    def get(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ModelFileError(source, f"missing metadata key {arch}.{key}")
        return meta[f"{arch}.{key}"]
    v_heads = int(get("ssm.time_step_rank"))
    recurrent = meta.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:  # as llama.cpp: every full_attention_interval-th layer attends
        interval = int(meta.get(f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    return LinearAttention(conv_kernel=int(get("ssm.conv_kernel")), k_heads=int(get("ssm.group_count")),
                           v_heads=v_heads, k_dim=int(get("ssm.state_size")),
                           v_dim=int(get("ssm.inner_size")) // v_heads,
                           recurrent=tuple(bool(r) for r in list(recurrent)[:n_layers]))


def config_from_hf(cfg: Mapping[str, Any], source: str) -> ModelConfig:
    if "text_config" in cfg:  # a multimodal checkpoint (Qwen3_5ForConditionalGeneration): its language model
        cfg = {**cfg["text_config"], "model_type": cfg.get("model_type")}
    model_type = _require(cfg, "model_type", source)
    if model_type not in HF_ARCHITECTURES:
        raise ModelFileError(source, f"unknown architecture {model_type!r} (supported: {', '.join(HF_ARCHITECTURES)})")
    hidden, n_heads = int(_require(cfg, "hidden_size", source)), int(_require(cfg, "num_attention_heads", source))
    n_layers = int(_require(cfg, "num_hidden_layers", source))
    # transformers >= 5 nests rope settings in rope_parameters; older configs use rope_theta/rope_scaling
    rope = dict(cfg.get("rope_scaling") or {}) | dict(cfg.get("rope_parameters") or {})
    # per layer type (laguna): the full layers' rope is the model's, the sliding layers' their own
    swa_rope = dict(rope.get("sliding_attention") or {})
    rope = dict(rope.get("full_attention", rope))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    layer_heads = [int(h) for h in cfg.get("num_attention_heads_per_layer") or [n_heads]]
    sliding = _hf_sliding(cfg, n_layers)
    laguna = model_type == "laguna"
    config = ModelConfig(
        arch=HF_ARCHITECTURES[model_type],
        n_layers=n_layers,
        hidden=hidden,
        n_heads=max(layer_heads),
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(cfg.get("head_dim") or hidden // n_heads),
        ffn=int(cfg.get("intermediate_size", 0)),
        vocab=int(_require(cfg, "vocab_size", source)),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_scaling=_hf_rope_scaling(rope, source, cfg),
        n_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
        n_experts_used=int(cfg.get("num_experts_per_tok") or 0),
        expert_ffn=int(cfg.get("moe_intermediate_size") or (cfg.get("intermediate_size", 0) if model_type == "mixtral" else 0)),
        rope_dim=_hf_rope_dim(cfg, rope, hidden // n_heads),
        linear=_hf_linear(cfg, HF_ARCHITECTURES[model_type]),
        expert_norm=bool(cfg.get("norm_topk_prob", False)) if model_type == "qwen3_moe" else True,
        expert_gating="sigmoid" if laguna else "softmax",
        expert_scale=float(cfg.get("moe_routed_scaling_factor", 1.0)) if laguna else 1.0,
        router_softcap=float(cfg.get("moe_router_logit_softcapping") or 0.0) if laguna else 0.0,
        layer_heads=_varying(layer_heads, n_layers),
        sliding_layers=sliding,
        sliding_window=int(cfg.get("sliding_window") or 0) if any(sliding) else 0,
        rope_theta_swa=float(swa_rope.get("rope_theta", 0.0)),
        rope_dim_swa=_hf_rope_dim(cfg, swa_rope, hidden // n_heads) if swa_rope else 0,
    )
    return _hf_gemma4(config, cfg, rope, source) if config.arch == "gemma4" else config


def _hf_gemma4(config: ModelConfig, cfg: Mapping[str, Any], rope: Mapping[str, Any], source: str) -> ModelConfig:
    """What Gemma4TextConfig adds: its layer types (every 6th layer full by default, the last always),
    the full layers' own head_dim and KV heads (per_layer_config, else global_head_dim and
    num_global_key_value_heads), KV sharing, per-layer embeddings, the MoE block beside the FFN,
    GELU-tanh, unscaled scores, the embedding scale and the final soft-cap."""
    n = config.n_layers
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types[n - 1] = "full_attention"
    sliding = tuple(t == "sliding_attention" for t in types[:n])
    per_layer = {int(k): v for k, v in (cfg.get("per_layer_config") or {}).items()}
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    global_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
    full = {"head_dim": int(cfg.get("global_head_dim") or 512)} | ({"num_key_value_heads": int(global_kv)} if global_kv
                                                                   else {})
    overrides = [per_layer.get(i, {}) if per_layer else ({} if sliding[i] else full) for i in range(n)]
    head_dims = [int(o.get("head_dim", config.head_dim)) for o in overrides]
    kv_heads = [int(o.get("num_key_value_heads", config.n_kv_heads)) for o in overrides]
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    first_shared = n - shared
    if shared and {s for s in sliding[first_shared:]} - {s for s in sliding[:first_shared]}:
        raise ModelFileError(source, "a KV-shared layer has no earlier layer of its kind to share with")
    moe = bool(cfg.get("enable_moe_block", False))
    softcap = cfg.get("final_logit_softcapping")
    return replace(
        config, n_kv_heads=max(kv_heads), head_dim=max(head_dims),
        layer_kv_heads=_varying(kv_heads, n), layer_head_dims=_varying(head_dims, n),
        sliding_layers=sliding if any(sliding) else (), sliding_window=int(cfg.get("sliding_window") or 0) if any(sliding) else 0,
        rope_dim_swa=int(cfg.get("head_dim") or config.head_dim),
        rope_dim=0, rope_turning=float(rope.get("partial_rotary_factor", 1.0)) if rope.get("rope_type") == "proportional" else 1.0,
        rope_theta=float(rope.get("rope_theta", 1_000_000.0)),
        kv_shared_layers=shared, logit_softcap=float(softcap or 0.0),
        layer_input_dim=int(cfg.get("hidden_size_per_layer_input") or 0),
        n_experts=int(cfg.get("num_experts") or 0) if moe else 0, n_experts_used=int(cfg.get("top_k_experts") or 0) if moe else 0,
        expert_ffn=int(cfg.get("moe_intermediate_size") or 0) if moe else 0, **_gemma4_fixed(config))


def _hf_sliding(cfg: Mapping[str, Any], n_layers: int) -> tuple[bool, ...]:
    """Which layers slide (transformers' layer_types), for the architectures that have them."""
    if cfg.get("model_type") not in ("laguna",) or not cfg.get("sliding_window"):
        return ()
    types = list(cfg.get("layer_types") or ["full_attention"] * n_layers)
    return tuple(t == "sliding_attention" for t in types[:n_layers]) if "sliding_attention" in types else ()


def _hf_rope_dim(cfg: Mapping[str, Any], rope: Mapping[str, Any], default_head_dim: int) -> int:
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    return 0 if factor is None else int(int(cfg.get("head_dim") or default_head_dim) * float(factor))


def _hf_linear(cfg: Mapping[str, Any], arch: str) -> LinearAttention | None:
    if arch not in HYBRID_ARCHES:
        return None
    n_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(n_layers)]
    return LinearAttention(conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
                           k_heads=int(cfg["linear_num_key_heads"]), v_heads=int(cfg["linear_num_value_heads"]),
                           k_dim=int(cfg["linear_key_head_dim"]), v_dim=int(cfg["linear_value_head_dim"]),
                           recurrent=tuple(t == "linear_attention" for t in types[:n_layers]))


def _hf_rope_scaling(rope: Mapping[str, Any], source: str, cfg: Mapping[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default" or (kind == "proportional" and float(rope.get("factor", 1.0)) == 1.0):
        return None
    if kind == "proportional":  # gemma4: its frequencies divided by the factor (ModelConfig.rope_turning: which turn)
        return RopeScaling("linear", float(rope["factor"]))
    if kind == "yarn":
        return _hf_yarn(rope, cfg)
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope.get("low_freq_factor", 1.0)),
            float(rope.get("high_freq_factor", 4.0)),
            int(rope.get("original_max_position_embeddings", 8192)),
        )
    raise ModelFileError(source, f"unsupported rope scaling type {kind!r} (supported: linear, llama3, yarn)")


def _hf_yarn(rope: Mapping[str, Any], cfg: Mapping[str, Any]) -> RopeScaling:
    """transformers' _compute_yarn_parameters: `truncate` read from the top level of rope_parameters
    (as it reads it, also where they are keyed by layer type)."""
    original = int(rope.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096))
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else int(cfg.get("max_position_embeddings", original)) / original
    attn = rope.get("attention_factor")
    if attn is None:
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attn = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim
                else _yarn_mscale(factor))
    top = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return RopeScaling("yarn", factor, original_context=original, beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(top.get("truncate", True)),
                       attn_factor=float(attn))


def _require(mapping: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in mapping:
        raise ModelFileError(source, f"missing {key!r}")
    return mapping[key]
