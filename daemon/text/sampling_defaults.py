"""SamplingDefaults: how a model's authors recommend sampling it — what a request that names no
sampling parameter gets (`ember generate`, `ember chat`, `ember run` and the OpenAI gateway send none
unless asked). Per parameter, from the first source that has it: the GGUF file's `general.sampling.*`
keys, or a Hugging Face directory's generation_config.json; else llama.cpp's own defaults. Greedy stays
one flag away (temperature 0)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp's common_params_sampling defaults (common/common.h): temp 0.8, top_k 40, top_p 0.95, min_p
# 0.05, repeat_penalty 1 (off)
LLAMA_CPP_SOURCE = "llama.cpp's defaults"
_GGUF_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
              "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p",
              "repetition_penalty": "general.sampling.penalty_repeat"}
_HF_KEYS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    # parameter -> where its value came from (a GGUF key, generation_config.json, llama.cpp's defaults)
    sources: Mapping[str, str] = field(default_factory=lambda: dict.fromkeys(_GGUF_KEYS, LLAMA_CPP_SOURCE),
                                       compare=False)

    def as_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sources"}

    def filled(self, **given: float | int | None) -> dict[str, float | int]:
        """The parameters `given`, each one left to the model (None) replaced by its recommendation."""
        return {name: getattr(self, name) if value is None else value for name, value in given.items()}


def from_gguf(metadata: Mapping[str, Any]) -> SamplingDefaults:
    """The file's general.sampling.* keys over llama.cpp's defaults (a float32 key as the decimal it
    was written as: 0.8, not 0.800000011920929)."""
    return _over_llama_cpp({name: (_shortest(metadata.get(key)), key) for name, key in _GGUF_KEYS.items()})


def _shortest(value: Any) -> Any:
    """A float as the shortest decimal that is the same float32 (GGUF stores float32)."""
    if isinstance(value, float):
        return float(str(np.float32(value)))
    return value


def from_hf_dir(path: str | Path) -> SamplingDefaults:
    """generation_config.json's values over llama.cpp's defaults; `do_sample: false` there means greedy
    (transformers then ignores the other values)."""
    file = Path(path) / "generation_config.json"
    try:
        config = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    where = file.name
    if config.get("do_sample") is False:
        return _over_llama_cpp({"temperature": (0.0, f"{where} (do_sample false)")})
    return _over_llama_cpp({name: (config.get(key), where) for name, key in _HF_KEYS.items()})


def _over_llama_cpp(found: Mapping[str, tuple[Any, str]]) -> SamplingDefaults:
    """Each value found (a number of the right kind, in range) in place of llama.cpp's."""
    out = SamplingDefaults()
    sources = dict(out.sources)
    for name, (value, where) in found.items():
        value = _valid(name, value)
        if value is not None:
            out = replace(out, **{name: value})
            sources[name] = where
    return replace(out, sources=sources)


def _valid(name: str, value: Any) -> float | int | None:
    """`value` as the parameter takes it, or None where it is missing or out of range (the default stands)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if name == "top_k":
        return int(value) if value >= 0 and float(value).is_integer() else None
    ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1,
          "repetition_penalty": value > 0}[name]
    return float(value) if ok else None
