"""Precision policies: the dtype of each narrow store, chosen in one place for the whole process.

  act      activation staging (rows crossing a device boundary of a layer split): f32, f16 or bf16.
           Auto: bf16 on devices with native bf16 (CUDA compute capability >= 8.0), f16 on other CUDA
           devices, f32 on the CPU; across the devices of a split, the first of bf16, f16, f32 that
           every device handles natively, so both sides of every boundary agree.
  feature  the speculative-decoding feature mirror: f32 (default), f16, bf16 or q8_0.
  kv       the KV cache: f16 (default, as llama.cpp's), f32, bf16 or q8_0.

Each is chosen by, lowest to highest precedence: the default (auto for act), the config file, the
environment (EMBER_ACT_DTYPE, EMBER_FEATURE_DTYPE, EMBER_KV_DTYPE), the command line. Storage may be
narrow; compute is float32: `StagedRows.to_compute()` widens rows back to f32 before they reach a norm
(every narrow store is read at a norm boundary: a layer's input norm, the draft's input norm).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ember.kernels.convert import DEFAULT_KV_DTYPE, KV_DTYPES, STORAGE_DTYPES, decode_rows, encode_rows

ACT_DTYPES = ("f32", "f16", "bf16")  # the dtypes devices compute in (DeviceCaps.native): never q8_0
FEATURE_DTYPES = STORAGE_DTYPES  # the feature mirror takes any storage dtype
# KV_DTYPES (kernels/convert.py) is imported above for CHOICES and re-exported to this module's callers.
CHOICES = {"act": ACT_DTYPES, "feature": FEATURE_DTYPES, "kv": KV_DTYPES}
ENV_VARS = {"act": "EMBER_ACT_DTYPE", "feature": "EMBER_FEATURE_DTYPE", "kv": "EMBER_KV_DTYPE"}
DEFAULTS = {"feature": "f32", "kv": DEFAULT_KV_DTYPE}  # act has no fixed default: it follows the devices
_ACT_PREFERENCE = ("bf16", "f16", "f32")  # narrowest first: halves boundary traffic where native


class PrecisionError(ValueError):
    """A dtype setting is not one of the choices; the message names the setting and its source."""


@dataclass(frozen=True)
class DeviceCaps:
    """What a device computes natively, as far as the policies care."""

    device: str  # "cpu" or "cuda:N"
    native: tuple[str, ...]  # activation dtypes its kernels handle without emulation

    @classmethod
    def of(cls, device: str, compute_capability: tuple[int, int] | None = None) -> DeviceCaps:
        """cpu: f32 only (numba has no half types). cuda: bf16 from compute capability 8.0 (Ampere);
        f16 otherwise, and when the capability is unknown (every CUDA GPU ember supports has f16)."""
        if device == "cpu" or device.startswith(("cpu:", "ray:")):  # ray:N/cpu: CPU kernels on a Ray node
            return cls(device, ("f32",))
        if not device.startswith("cuda"):
            raise PrecisionError(f"unknown device {device!r} (cpu, cpu:N or cuda:N)")
        if compute_capability is not None and compute_capability >= (8, 0):
            return cls(device, ("bf16", "f16", "f32"))
        return cls(device, ("f16", "f32"))


def auto_act_dtype(devices: Sequence[DeviceCaps]) -> str:
    """The narrowest activation dtype every device of the split handles natively."""
    return next(d for d in _ACT_PREFERENCE if all(d in c.native for c in devices))


@dataclass(frozen=True)
class PrecisionSettings:
    """One layer of overrides (the config file's, or the command line's); None leaves it alone."""

    act: str | None = None
    feature: str | None = None
    kv: str | None = None


@dataclass(frozen=True)
class PrecisionPolicy:
    act: str
    feature: str
    kv: str
    # knob -> where its value came from: "auto", "default", "config", "flag" or the variable's name
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)


def resolve_policy(devices: Sequence[DeviceCaps], config: PrecisionSettings | None = None,
                   env: Mapping[str, str] | None = None, flags: PrecisionSettings | None = None) -> PrecisionPolicy:
    """The policy for a model placed on `devices`: defaults < config < environment < flags. `env`: the
    EMBER_*_DTYPE variables, read by the caller at the top (None: no environment layer)."""
    env = {} if env is None else env
    if not devices:
        raise PrecisionError("no devices to choose a precision for")
    chosen = {"act": auto_act_dtype(devices), **DEFAULTS}
    sources = {"act": "auto", "feature": "default", "kv": "default"}
    layers: list[tuple[str, PrecisionSettings]] = [("config", config or PrecisionSettings())]
    env_layer = PrecisionSettings(**{k: env.get(v) or None for k, v in ENV_VARS.items()})
    layers += [("env", env_layer), ("flag", flags or PrecisionSettings())]
    for source, settings in layers:
        for knob in CHOICES:
            value = getattr(settings, knob)
            if value is None:
                continue
            where = ENV_VARS[knob] if source == "env" else source
            value = value.strip().lower()
            if value not in CHOICES[knob]:
                raise PrecisionError(f"{knob} dtype {value!r} (from {where}) is not one of {', '.join(CHOICES[knob])}")
            chosen[knob], sources[knob] = value, where
    return PrecisionPolicy(chosen["act"], chosen["feature"], chosen["kv"], sources)


# --- narrow storage, f32 compute ------------------------------------------------------------------
@dataclass(frozen=True)
class StagedRows:
    """Rows [..., width] held in a storage dtype (kernels/convert.py layouts)."""

    data: np.ndarray
    dtype: str
    width: int

    @classmethod
    def stage(cls, x: np.ndarray, dtype: str) -> StagedRows:
        return cls(encode_rows(x, dtype), dtype, int(np.shape(x)[-1]))

    def to_compute(self) -> np.ndarray:
        """float32 rows: what a norm (and everything after it) computes on."""
        return decode_rows(self.data, self.dtype, self.width)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)
