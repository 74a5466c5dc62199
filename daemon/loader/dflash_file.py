"""Reading a feature-conditioned draft in llama.cpp's `dflash` GGUF architecture (src/models/dflash.cpp,
conversion/qwen.py DFlashModel): what it says beyond a ModelConfig, and the variants ember refuses.

A plain DFlash draft holds `fc` [hidden, len(target_layers) x hidden] over the concatenated target
features, `enc.output_norm` after it, Qwen3-style layers (attention with q/k norms, SwiGLU FFN) and a
final `output_norm`; `token_embd` and `output` are optional (absent: the target's are shared).
Metadata: `dflash.target_layers` (the target layers whose *input* hidden states are captured: the
converter writes Hugging Face's `target_layer_ids` + 1), `dflash.block_size` (the trained block),
`tokenizer.ggml.mask_token_id` (the noise token). DFlash2 (conv + selector), DSpark (Markov head),
DeepSeek-V4 hyper-connection drafts and reduced-vocabulary (d2t) drafts are refused, each by name, as
are the optional per-layer extras ember does not compute (sinks, post-norms, sliding windows).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.loader.model_file import ModelFile
from ember.daemon.loader.model_file_error import ModelFileError

ARCH = "dflash"
DEFAULT_BLOCK = 16  # llama.cpp's when dflash.block_size is absent (common/speculative.cpp)

# (what in the file shows it, why it is refused)
_TENSOR_VARIANTS = (
    ("selector_hidden.weight", "a DFlash2 draft (conv + candidate selector)"),
    ("markov_w1.weight", "a DSpark draft (Markov head)"),
    ("output_hc_fn.weight", "a DeepSeek-V4 DSpark draft (hyper-connections)"),
    ("d2t", "a reduced-vocabulary draft (d2t map)"),
)
_LAYER_EXTRAS = (
    ("attn_conv_base", "DFlash2 convolutions"),
    ("attn_sinks.weight", "attention sinks"),
    ("post_attention_norm.weight", "post-attention norms"),
    ("post_ffw_norm.weight", "post-FFN norms"),
    ("layer_output_scale.weight", "layer output scales"),
)
_KEY_VARIANTS = (
    ("hyper_connection.count", "a DeepSeek-V4 DSpark draft (hyper-connections)"),
    ("selector_rank", "a DFlash2 draft (candidate selector)"),
    ("attention.sliding_window", "sliding-window attention"),
    ("rope.dimension_sections", "M-RoPE sections"),
    ("attention.scale", "a custom attention scale"),
    ("attention.value_scale", "an attention value scale"),
)


@dataclass(frozen=True)
class DFlashSpec:
    target_layers: tuple[int, ...]  # target layers whose input hidden states feed fc, in fc's order
    block_size: int  # tokens per noise block it was trained on (the last verified one + block_size - 1 masks)
    mask_id: int  # the noise token
    embedding_scale: float  # the noise block's embeddings are multiplied by it; 0: not at all
    own_embedding: bool  # the file carries token_embd (else the target's is used)
    own_output: bool  # the file carries output (else the target's head is used)

    @property
    def max_proposals(self) -> int:
        return self.block_size - 1


def is_dflash(mf: ModelFile) -> bool:
    return mf.config.arch == ARCH


def read_dflash(mf: ModelFile) -> DFlashSpec:
    """The DFlash metadata of `mf`, or ModelFileError naming what ember does not run."""
    source, meta, names = str(mf.path), mf.metadata, set(mf.tensors)
    if not is_dflash(mf):
        raise ModelFileError(source, f"not a DFlash draft (architecture {mf.config.arch!r}, not {ARCH!r})")
    refuse_variants(source, meta, names)
    act = meta.get(f"{ARCH}.hidden_activation", "silu")
    if act != "silu":
        raise ModelFileError(source, f"hidden activation {act!r} is not supported (DFlash drafts in ember use silu)")
    if meta.get(f"{ARCH}.attention.causal"):
        raise ModelFileError(source, "a causal DFlash block (dflash.attention.causal) is not supported")
    layers = meta.get(f"{ARCH}.target_layers")
    if layers is None or not len(layers):
        raise ModelFileError(source, f"missing metadata key {ARCH}.target_layers (the target layers it reads)")
    if "tokenizer.ggml.mask_token_id" not in meta:
        raise ModelFileError(source, "missing metadata key tokenizer.ggml.mask_token_id (the DFlash noise token)")
    for i in range(mf.config.n_layers):
        if f"blk.{i}.attn_v.weight" not in names:
            raise ModelFileError(source, f"blk.{i} has no attn_v (K shared as V): not supported")
    block = int(meta.get(f"{ARCH}.block_size", DEFAULT_BLOCK))
    if block < 2:
        raise ModelFileError(source, f"{ARCH}.block_size is {block}: a block must hold the last token and a mask")
    return DFlashSpec(
        target_layers=tuple(int(i) for i in layers), block_size=block,
        mask_id=int(meta["tokenizer.ggml.mask_token_id"]),
        embedding_scale=float(meta.get(f"{ARCH}.embedding_scale", 0.0)),
        own_embedding="token_embd.weight" in names, own_output="output.weight" in names,
    )


def refuse_variants(source: str, meta: Mapping[str, Any], names: Collection[str]) -> None:
    """ModelFileError for a DFlash variant ember does not run, named by what its file holds. The GGUF
    loader calls it before reading tensors (a d2t map is I64, which would be refused less clearly)."""
    for name, what in _TENSOR_VARIANTS:
        if name in names:
            raise ModelFileError(source, f"{what} is not supported: ember runs plain DFlash drafts only")
    for key, what in _KEY_VARIANTS:
        if meta.get(f"{ARCH}.{key}"):
            raise ModelFileError(source, f"{what} ({ARCH}.{key}) is not supported: ember runs plain DFlash drafts only")
    for suffix, what in _LAYER_EXTRAS:
        if any(n.startswith("blk.") and n.endswith(suffix) for n in names):
            raise ModelFileError(source, f"{what} (blk.N.{suffix}) are not supported: ember runs plain DFlash drafts only")
    scaled = sorted(n for n in names if n.endswith((".scale", ".input_scale")))
    if scaled:
        raise ModelFileError(source, f"scaled (NVFP4-style) tensors such as {scaled[0]} are not supported")


def check_fits(spec: DFlashSpec, draft: ModelConfig, target: ModelConfig, source: str) -> None:
    """Refuse a draft that cannot read this target's features or speak its vocabulary."""
    if draft.hidden != target.hidden:
        raise ModelFileError(source, f"the DFlash draft's hidden size ({draft.hidden}) differs from the target's "
                             f"({target.hidden}): its fc reads {len(spec.target_layers)} x the target's hidden states")
    # layer i's input; i = n_layers is the last layer's output (llama.cpp's converter writes HF's ids + 1)
    bad = [i for i in spec.target_layers if not 0 <= i <= target.n_layers]
    if bad:
        raise ModelFileError(source, f"the DFlash draft reads target layers {list(spec.target_layers)}, but the target has "
                             f"layers 0-{target.n_layers - 1} (an input of layer {bad[0]} does not exist)")
    if draft.vocab != target.vocab:
        raise ModelFileError(source, f"the draft's vocabulary ({draft.vocab} tokens) differs from the model's "
                             f"({target.vocab}): a draft must share the tokenizer")
    if not 0 <= spec.mask_id < target.vocab:
        raise ModelFileError(source, f"mask token {spec.mask_id} is outside the vocabulary of {target.vocab}")
