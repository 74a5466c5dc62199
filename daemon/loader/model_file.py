"""ModelFile: one model on disk — its config, its tensors (zero-copy views of the mmap'd file) and
what the tokenizer needs — whichever format it came in. `open_model_file` picks the reader.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ember.daemon.loader.model_config import ModelConfig
from ember.daemon.loader.model_file_error import ModelFileError
from ember.kernels.raw_tensor import RawTensor


@dataclass
class ModelFile:
    path: Path
    format: str  # "gguf" or "hf"
    config: ModelConfig
    # tensors under GGUF names (token_embd.weight, blk.0.attn_q.weight, ...), whatever the format
    tensors: dict[str, RawTensor]
    # GGUF: the whole metadata (tokenizer.ggml.* included); HF: config.json
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rope_interleaved(self) -> bool:
        # llama.cpp's converter permutes llama q/k rows so rotary pairs are adjacent; it leaves the
        # qwen family in the Hugging Face half-split layout
        return self.format == "gguf" and self.config.arch in ("llama", "mixtral")

    @property
    def file_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` routes to experts (MoE files may keep some layers dense)."""
        return f"blk.{layer}.ffn_gate_inp.weight" in self.tensors

    def experts(self, layer: int, proj: str) -> list[RawTensor]:
        """One 2-D tensor [rows, cols] per expert of `proj` ("gate", "up" or "down") in block `layer`,
        each a view of the file: slices of GGUF's stacked blk.N.ffn_{proj}_exps.weight [experts, rows,
        cols], or the HF directory's own per-expert tensors (blk.N.ffn_{proj}_exps.E.weight)."""
        n = self.config.n_experts
        fused = self.tensors.get(f"blk.{layer}.ffn_gate_up_exps.weight") if proj in ("gate", "up") else None
        if fused is not None:  # gemma4: each expert's gate rows, then its up rows, in one tensor
            if len(fused.shape) != 3 or fused.shape[0] != n or fused.shape[1] % 2:
                raise ModelFileError(str(self.path), f"{fused.name} has shape {fused.shape}, not [{n}, 2 x rows, cols]")
            half = fused.shape[1] // 2
            part = slice(0, half) if proj == "gate" else slice(half, None)
            return [RawTensor(f"{fused.name}[{e}].{proj}", fused.ttype, (half, fused.shape[2]), fused.data[e, part])
                    for e in range(n)]
        stacked = self.tensors.get(f"blk.{layer}.ffn_{proj}_exps.weight")
        if stacked is not None:
            if len(stacked.shape) != 3 or stacked.shape[0] != n:
                raise ModelFileError(str(self.path), f"{stacked.name} has shape {stacked.shape}, not [{n}, rows, cols]")
            return [RawTensor(f"{stacked.name}[{e}]", stacked.ttype, stacked.shape[1:], stacked.data[e]) for e in range(n)]
        return [self.tensor(f"blk.{layer}.ffn_{proj}_exps.{e}.weight") for e in range(n)]

    def tensor(self, name: str) -> RawTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFileError(str(self.path), f"missing tensor {name}") from None


def open_model_file(path: str | Path) -> ModelFile:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelFileError(str(p), "no such file or directory")
    if p.is_dir():
        from ember.daemon.loader.hf_dir import open_hf_dir

        return open_hf_dir(p)
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from ember.daemon.loader.gguf_file import open_gguf

        return open_gguf(p)
    raise ModelFileError(str(p), "not a GGUF file (bad magic) and not a Hugging Face model directory")
