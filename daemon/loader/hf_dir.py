"""Reading Hugging Face model directories: config.json and *.safetensors (sharded or not), tensors
mmap'd without copies and renamed to GGUF names so the models see one naming scheme.

Names come from gguf-py's TensorNameMap for the config's architecture and layer count: the table
llama.cpp's converter (convert_hf_to_gguf.py) renames with, so a directory's tensors get the names the
converted GGUF file would have. Tensors it has no name for (buffers, per-expert MoE weights, anything
unknown) are dropped; a model missing a tensor it needs fails when it asks for it.

Only the names follow the converter. It also permutes llama's q/k rows so rotary pairs are adjacent;
these tensors keep the Hugging Face half-split row order, and ModelFile.rope_interleaved (False for
"hf") makes the rotary kernel pair halves to match. Tied embeddings need nothing here: save_pretrained
writes no lm_head.weight, and the model falls back to token_embd.weight when output.weight is absent.

MoE experts: TensorNameMap names only a layer's experts stacked into one 3-D tensor
(model.layers.N.mlp.experts.gate_proj.weight -> blk.N.ffn_gate_exps.weight; Mixtral, converted as
llama: layers.N.block_sparse_moe.experts.w1.weight), because the converter stacks the per-expert
tensors (model.layers.N.mlp.experts.E.gate_proj.weight, block_sparse_moe.experts.E.w1.weight) in
expert order under that merged name. Stacking here would copy (safetensors stores each expert apart),
so each expert keeps its own tensor, named by the merged name with the expert's index before
".weight" (blk.N.ffn_gate_exps.E.weight); ModelFile.experts reads either layout. Routers
(mlp.gate.weight -> blk.N.ffn_gate_inp.weight) map as they are.
"""
from __future__ import annotations

import functools
import json
import re
import struct
from pathlib import Path

import gguf
import numpy as np

from ember.daemon.loader.model_config import config_from_hf
from ember.daemon.loader.model_file import ModelFile
from ember.daemon.loader.model_file_error import ModelFileError
from ember.kernels.raw_tensor import RawTensor
from ember.kernels.tensor_types import TensorType

_DTYPES = {"F32": (TensorType.F32, np.float32), "F16": (TensorType.F16, np.uint16), "BF16": (TensorType.BF16, np.uint16)}

_GGUF_ARCHES = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
# ember's arch names are GGUF's, except where llama.cpp converts a model type under another one:
# its converter registers MixtralForCausalLM on LlamaModel (MODEL_ARCH.LLAMA). gguf-py before 0.20
# has no laguna: its tensors are named from step35's table, which holds every one of them under the
# name the converter gives it (attn_gate from self_attn.g_proj, exp_probs_b, the shared expert's)
_CONVERTED_AS = {"mixtral": "llama"} | ({} if "laguna" in _GGUF_ARCHES else {"laguna": "step35"})
_DENSE_FFN = re.compile(r"\.mlp\.(gate|up|down)_proj\.")
# buffers, not weights: the converter skips these before mapping (TensorNameMap would otherwise name
# llama's rotary_emb.inv_freq blk.N.attn_rot_embd)
_SKIPPED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
# qwen35: a multimodal checkpoint's language model, and the DeltaNet's dt_bias (Qwen3NextModel.modify_tensors);
# a router's selection bias, as the converter's base modify_tensors renames it, and laguna's, kept
# beside its experts, where gguf-py's table before laguna looks for it (beside the router)
_RENAMED = (("model.language_model.", "model."), (".linear_attn.dt_bias", ".linear_attn.dt_proj.bias"),
            (".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
            ("e_score_correction_bias", "e_score_correction.bias"))
# as the converter's map_tensor_name: the table's keys are module paths, parameters add these
_PARAM_SUFFIXES = (".weight", ".bias")
# a per-expert tensor: (the module path up to "experts") (expert index) (the projection and parameter)
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(.*)")
# tensors the converter names by hand (gemma4's Gemma4Model.filter_tensors and modify_tensors): the
# router's input scale and per-expert output scale, the layer's output scalar, the stacked experts
_BY_HAND = {"gemma4": tuple((re.compile(rf"model\.layers\.(\d+)\.{hf}"), gguf) for hf, gguf in (
    (r"router\.scale", "blk.{}.ffn_gate_inp.scale"), (r"router\.per_expert_scale", "blk.{}.ffn_down_exps.scale"),
    (r"layer_scalar", "blk.{}.layer_output_scale.weight"), (r"experts\.gate_up_proj", "blk.{}.ffn_gate_up_exps.weight"),
    (r"experts\.down_proj", "blk.{}.ffn_down_exps.weight")))}


def open_hf_dir(path: Path) -> ModelFile:
    source = str(path)
    config_path = path / "config.json"
    if not config_path.exists():
        raise ModelFileError(source, "not a model directory: no config.json")
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFileError(str(config_path), f"invalid JSON ({e})") from None
    config = config_from_hf(cfg, source)
    raws = [t for shard in _shards(path) for t in _read_safetensors(shard).values()]
    tensors = _with_gguf_names(raws, config.arch, config.n_layers, source)
    if "token_embd.weight" not in tensors:
        raise ModelFileError(source, "missing tensor model.embed_tokens.weight")
    return ModelFile(path=path, format="hf", config=config, tensors=tensors, metadata=cfg)


def _with_gguf_names(raws: list[RawTensor], arch: str, n_layers: int, source: str) -> dict[str, RawTensor]:
    """The tensors that have a GGUF name, under it (same data, no copy)."""
    by_name: dict[str, RawTensor] = {}  # still under their HF names, for the message below
    for t in raws:
        name = gguf_name(t.name, arch, n_layers)
        if name is None:
            continue
        if name in by_name:
            # TensorNameMap knows many models' spellings of each tensor; two of them in one checkpoint
            # (or one name in two shards) must not silently replace each other
            raise ModelFileError(source, f"tensors {by_name[name].name} and {t.name} both map to {name}")
        by_name[name] = t
    return {name: RawTensor(name, t.ttype, t.shape, t.data) for name, t in by_name.items()}


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        shards = [path / name for name in sorted(set(weight_map.values()))]
    else:
        shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(str(path), "no *.safetensors files")
    for s in shards:
        if not s.exists():
            raise ModelFileError(str(s), "shard named in model.safetensors.index.json is missing")
    return shards


def _read_safetensors(path: Path) -> dict[str, RawTensor]:
    """Parse a safetensors file (8-byte header length, JSON header, data) into mmap'd views.

    Parsed by hand because the safetensors numpy API copies and has no bfloat16.
    """
    source = str(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(source, "truncated safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, 100 << 20):
            raise ModelFileError(source, "truncated or corrupt safetensors header")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelFileError(source, "corrupt safetensors header") from None
    mm = np.memmap(path, np.uint8, "r")
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ModelFileError(source, f"tensor {name} has unsupported dtype {info['dtype']} (supported: F32, F16, BF16)")
        ttype, dtype = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if base + end > size or end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize:
            raise ModelFileError(source, f"truncated file: tensor {name} extends past the end")
        data = mm[base + begin : base + end].view(dtype).reshape(shape)
        tensors[name] = RawTensor(name, ttype, shape, data)
    return tensors


def gguf_name(hf_name: str, arch: str, n_layers: int) -> str | None:
    """The GGUF name llama.cpp's converter gives `hf_name` in an `arch` model (ember's architecture
    name, e.g. "qwen3") of `n_layers` blocks; None for the buffers it skips and for names it has none for.
    One expert's tensor gets its stacked tensor's name with the expert index: blk.N.ffn_up_exps.E.weight."""
    if hf_name.endswith(_SKIPPED_SUFFIXES):
        return None
    for old, new in _RENAMED:  # as the converter does before mapping
        if old in hf_name:
            hf_name = hf_name.replace(old, new)
    for pattern, name in _BY_HAND.get(arch, ()):
        if (hand := pattern.fullmatch(hf_name)) is not None:
            return name.format(hand.group(1))
    expert = _PER_EXPERT.fullmatch(hf_name)
    if expert is not None:
        merged = gguf_name(f"{expert.group(1)}.{expert.group(3)}", arch, n_layers)
        if merged is None or not merged.endswith(".weight"):
            return None
        return f"{merged[: -len('.weight')]}.{int(expert.group(2))}.weight"
    name = tensor_name_map(arch, n_layers).get_name(hf_name, try_suffixes=_PARAM_SUFFIXES)
    if name is None and _DENSE_FFN.search(hf_name):
        # a dense layer of a MoE model (Qwen3MoE's mlp_only_layers, decoder_sparse_step): gguf-py's table
        # for the MoE architecture has no dense FFN, so it takes the name a dense model gives it
        name = tensor_name_map("llama", n_layers).get_name(hf_name, try_suffixes=_PARAM_SUFFIXES)
    return name


@functools.lru_cache(maxsize=8)
def tensor_name_map(arch: str, n_layers: int) -> gguf.TensorNameMap:
    """gguf-py's HF -> GGUF table for one architecture, expanded for n_layers blocks (built once: it
    holds every known spelling of every tensor of every block)."""
    # arch is one of model_config.HF_ARCHITECTURES' values, which all name a gguf-py architecture
    return gguf.TensorNameMap(_GGUF_ARCHES[_CONVERTED_AS.get(arch, arch)], n_layers)
