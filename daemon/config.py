"""The daemon's configuration: one msgspec Struct tree, from TOML, then EMBER_* variables, then flags.

    [[models]]                    # none: the built-in demo model
    path = "/var/lib/ember/models/qwen3-8b-q4_k_m.gguf"
    name = "qwen3-8b"             # default: the file name without extension
    draft = "/var/lib/ember/models/qwen3-0.6b-q8_0.gguf"  # optional: speculative decoding (docs/speculative.md); "ngram": prompt lookup
    draft_tokens = 4              # tokens the draft proposes per step
    adaptive_draft = true         # speculate only while that measures faster than decoding without the draft
    feature_dtype = "f32"         # a DFlash draft's feature mirror: f32, f16, bf16, q8_0 (EMBER_FEATURE_DTYPE overrides)
    expert_budget = "50%"         # MoE: hot experts' bytes at most (bytes, "2GiB", "N%"); "": all hot
    cold_workers = 2              # MoE: CPU workers for the cold experts; -1: 2 when some are cold
    cold_policy = "exact"         # MoE: "exact" (default) or "mask" (cold experts dropped: lossy)
    [server]   socket, socket_group, drain_timeout, log_format, log_level, probe_interval, logits_slots,
               max_logits_bytes, max_logits_bytes_per_user, stall_timeout
    [engine]   device, kv_dtype, ctx, max_active, max_queued, max_per_process, max_step_tokens, prefix_caching,
               prefix_sharing,
               decode_burst_ms, warmup, threads, decode_act, prompt_act, cuda_kernels, devices, split, act_dtype,
               stage_threads (a layer split: docs/layer_split.md)
    [limits]   see protocol/limits.py

The `ember serve` flags --expert-budget, --cold-workers and --cold-policy set those keys for every model.
Environment: EMBER_CONFIG (the file), EMBER_SOCKET, EMBER_MODELS (paths separated by ':'), EMBER_KV_DTYPE,
EMBER_ACT_DTYPE, EMBER_FEATURE_DTYPE (every model's feature_dtype), and
EMBER_<SECTION>_<FIELD> for every other scalar (EMBER_ENGINE_MAX_ACTIVE=2). A bad value is refused at
start with the key, the reason and where the value came from.
"""
from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from ember.daemon.engine.decode_burst import DECODE_BURST
from ember.kernels.convert import DECODE_ACTIVATIONS, KV_DTYPES, STORAGE_DTYPES, prompt_act_for
from ember.kernels.cuda.native_kernels import CUDA_KERNELS
from ember.daemon.planning.precision import ACT_DTYPES
from ember.daemon.runner.devices import DeviceName
from ember.daemon.runner.split_spec import parse_devices, parse_split
from ember.protocol.limits import Limits

SYSTEM_CONFIG = Path("/etc/ember/ember.toml")
LOG_FORMATS = ("auto", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key, why, and where it was set."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class ModelSpec(_Section):
    path: str
    name: str = ""
    draft: str = ""  # a draft model for speculative decoding (same vocabulary); "ngram": prompt lookup, no model; "": none
    draft_tokens: int = 4  # tokens the draft proposes per step
    adaptive_draft: bool = True  # a draft speculates only while that measures faster (SpecSwitch); false: always
    feature_dtype: str = ""  # a DFlash draft's feature mirror: f32, f16, bf16 or q8_0; "": EMBER_FEATURE_DTYPE, else f32
    expert_budget: str = ""  # MoE: hot experts' bytes at most (bytes, a size, "N%"); "": every expert hot
    cold_workers: int = -1  # MoE: CPU worker processes for cold experts; -1: 2 when some are cold
    cold_policy: str = "exact"  # MoE: "exact" or "mask" (lossy, opt-in)

    def __post_init__(self) -> None:
        from ember.daemon.experts.expert_manager import COLD_POLICIES
        from ember.daemon.planning.planner import parse_expert_budget

        _check(self.cold_policy in COLD_POLICIES, f"cold_policy must be one of {', '.join(COLD_POLICIES)}, "
                                                  f"got {self.cold_policy!r}")
        _check(self.cold_workers >= -1, f"cold_workers must be >= 0 (or -1: automatic), got {self.cold_workers}")
        if self.expert_budget:
            parse_expert_budget(self.expert_budget, 1)  # raises PlanError (a ValueError) with the reason
        _check(1 <= self.draft_tokens <= 32, f"draft_tokens must be in [1, 32], got {self.draft_tokens}")
        _check(self.feature_dtype in ("", *STORAGE_DTYPES),
               f"feature_dtype must be one of {', '.join(STORAGE_DTYPES)}, got {self.feature_dtype!r}")

    @property
    def experts(self) -> dict[str, Any]:
        """ember.load's keyword arguments for the experts."""
        return dict(expert_budget=self.expert_budget or None, cold_policy=self.cold_policy,
                    cold_workers=None if self.cold_workers < 0 else self.cold_workers)

    @property
    def display_name(self) -> str:
        """Its name; else a hub name as given (Qwen/Qwen3-8B-GGUF:Q4_K_M), a file's stem, a directory's name."""
        from ember.daemon.loader.hub import HubName

        if self.name:
            return self.name
        if HubName.parse(self.path) is not None and not Path(self.path).expanduser().exists():
            return self.path
        return Path(self.path).name.split(".")[0]


class ServerConfig(_Section):
    socket: str = ""  # "" = protocol/endpoint.py's default
    socket_group: str = ""  # "": socket directory 0700; a group: 0750 and that group may connect
    drain_timeout: float = 10.0  # seconds in-flight requests may run on after SIGTERM
    log_format: str = "auto"  # auto: JSON under systemd or without a TTY, readable on a TTY
    log_level: str = "info"
    probe_interval: float = 1.0  # seconds between liveness probes of quiet clients with work
    logits_slots: int = 64  # slots in each client's shared-memory logits ring
    # all clients' logits rings together (one ring is logits_slots x vocab x 4 bytes: 37 MiB at a 152K
    # vocabulary); a client whose ring would go over gets Error{limit}; 0: no logits rings at all
    max_logits_bytes: int = 256 << 20
    # one Unix user's clients' rings together (-1: half of max_logits_bytes), so that one user with many
    # connections cannot leave the others no ring
    max_logits_bytes_per_user: int = -1
    stall_timeout: float = 300.0  # seconds a request may wait on a client that reads none of its stream

    def __post_init__(self) -> None:
        _check(self.drain_timeout >= 0, f"drain_timeout must be >= 0, got {self.drain_timeout}")
        _check(self.log_format in LOG_FORMATS, f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        _check(self.log_level in LOG_LEVELS, f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        _check(0.05 <= self.probe_interval <= 60, f"probe_interval must be in [0.05, 60] s, got {self.probe_interval}")
        _check(1 <= self.logits_slots <= 4096, f"logits_slots must be in [1, 4096], got {self.logits_slots}")
        _check(self.max_logits_bytes >= 0, f"max_logits_bytes must be >= 0, got {self.max_logits_bytes}")
        _check(self.max_logits_bytes_per_user >= -1,
               f"max_logits_bytes_per_user must be >= 0 (-1: half of max_logits_bytes), got {self.max_logits_bytes_per_user}")

    @property
    def logits_bytes_per_user(self) -> int:
        """max_logits_bytes_per_user, its default resolved."""
        if self.max_logits_bytes_per_user < 0:
            return self.max_logits_bytes // 2
        return self.max_logits_bytes_per_user
        _check(self.stall_timeout > 0, f"stall_timeout must be > 0 s, got {self.stall_timeout}")


DEFAULT_CTX = 4096  # tokens per sequence when `ctx` is not set (and the model allows that many)


class EngineConfig(_Section):
    device: str = "cpu"  # cpu or cuda:N
    kv_dtype: str = ""  # f32, f16, bf16 or q8_0; "": the precision policy's (EMBER_KV_DTYPE, else f16)
    ctx: int = 0  # tokens per sequence, prompt and output; 0: the model's context length, at most DEFAULT_CTX
    max_active: int = 4  # sequences generated together (continuous batching); the KV cache holds ctx for each
    max_queued: int = 32  # admitted requests beyond max_active waiting their turn; beyond: Error{code: "busy"}
    # requests in flight one client process may hold, whatever its connections (-1: max_active + max_queued
    # less an eighth of them, at least one, kept for the other processes; 0: no bound)
    max_per_process: int = -1
    max_step_tokens: int = 256  # tokens per forward pass: every running sequence's next token, then prompt chunks
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    # whose prompts' blocks a request may reuse: "user" (the clients of one Unix user: another user cannot
    # tell what was sent from the first token's time) or "all"
    prefix_sharing: str = "user"
    decode_burst_ms: float = 1000 * DECODE_BURST  # decode steps run in one go for up to this long (EngineCore); 0: one token a step
    warmup: bool = True  # run a short generation before READY (loads the compiled kernels)
    threads: int = 0  # kernel threads of the engine process; 0: one per core
    decode_act: str = "q8_0"  # activations of generated tokens against quantized weights: q8_0 (fast, llama.cpp's) or f32
    prompt_act: str = ""  # and of prompt tokens: q8_0 (fast, as decode's and llama.cpp's) or f32 (exact); "": q8_0 with AVX-512 VNNI or AVX2, else f32 (kernels/convert.py), f32 beside decode_act f32
    # on a cuda device: "numba" (the numba.cuda kernels) or "native" (the CUDA C++ kernels through CuPy, the
    # decode step replayed as a graph; dense models on cuda:0, docs/cuda.md)
    cuda_kernels: str = "numba"
    devices: str = ""  # a layer split across stage processes, e.g. "cpu:0,cpu:1" ("cpu" last: the engine's thread); "": the model runs on `device`
    split: str = ""  # layers per device of `devices`, e.g. "3,2"; "": in proportion to the devices' memory
    act_dtype: str = ""  # the split's staged hidden states: f32, f16, bf16 or auto; "": EMBER_ACT_DTYPE, else auto
    stage_threads: int = 0  # kernel threads per stage process; 0: the CPUs shared out among the stages

    def __post_init__(self) -> None:
        _check(_is_device(self.device), f"device must be cpu or cuda:N, got {self.device!r}")
        if self.devices:
            parse_devices(self.devices)  # SplitSpecError (a ValueError) says what is wrong
        _check(not self.split or bool(self.devices), f"split {self.split!r} needs devices to split across (engine.devices)")
        parse_split(self.split)
        _check(self.act_dtype in ("", "auto", *ACT_DTYPES),
               f"act_dtype must be one of auto, {', '.join(ACT_DTYPES)}, got {self.act_dtype!r}")
        _check(self.stage_threads >= 0, f"stage_threads must be >= 0, got {self.stage_threads}")
        _check(self.prefix_sharing in ("user", "all"), f"prefix_sharing must be user or all, got {self.prefix_sharing!r}")
        _check(self.max_per_process >= -1,
               f"max_per_process must be >= 0 (-1: all places but an eighth), got {self.max_per_process}")
        _check(self.threads >= 0, f"threads must be >= 0, got {self.threads}")
        _check(self.kv_dtype in ("", *KV_DTYPES), f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        _check(self.decode_act in DECODE_ACTIVATIONS,
               f"decode_act must be one of {', '.join(DECODE_ACTIVATIONS)}, got {self.decode_act!r}")
        try:
            prompt_act_for(self.prompt_act, self.decode_act)
        except ValueError as e:  # named first, as every check here names its field
            _check(False, f"prompt_act {self.prompt_act!r} refused: {e}")
        _check(self.cuda_kernels in CUDA_KERNELS,
               f"cuda_kernels must be one of {', '.join(CUDA_KERNELS)}, got {self.cuda_kernels!r}")
        _check(self.ctx >= 0, f"ctx must be >= 0, got {self.ctx}")
        _check(self.max_active >= 1, f"max_active must be >= 1, got {self.max_active}")
        _check(self.max_queued >= 0, f"max_queued must be >= 0, got {self.max_queued}")
        _check(self.max_step_tokens >= 1, f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        _check(0 <= self.decode_burst_ms <= 1000, f"decode_burst_ms must be 0-1000, got {self.decode_burst_ms}")

    @property
    def process_share(self) -> int:
        """max_per_process, its default resolved (0: none)."""
        places = self.max_active + self.max_queued
        return max(1, places - max(1, places // 8)) if self.max_per_process < 0 else self.max_per_process

    def context_for(self, model_context: int) -> int:
        """Tokens per sequence for a model whose own context length is `model_context`."""
        return min(self.ctx or DEFAULT_CTX, model_context)


def _is_device(name: str) -> bool:
    try:
        DeviceName.parse(name)
    except ValueError:
        return False
    return True


class Config(_Section):
    models: tuple[ModelSpec, ...] = ()
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = EngineConfig()
    limits: Limits = Limits()

    def __post_init__(self) -> None:
        names = [m.display_name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        _check(not dupes, f"two models are named {', '.join(dupes)}: give them distinct `name`s")


_SECTIONS: dict[str, type[msgspec.Struct]] = {"server": ServerConfig, "engine": EngineConfig, "limits": Limits}


def load_config(file: str | Path | None = None, env: Mapping[str, str] | None = None,
                flags: Mapping[str, Any] | None = None) -> Config:
    """Defaults, overridden by the TOML file (`file`, else $EMBER_CONFIG, else /etc/ember/ember.toml if
    it exists), by EMBER_* variables, then by `flags` ({"server.socket": ..., "models": [...]})."""
    env = os.environ if env is None else env
    raw: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = file or env.get("EMBER_CONFIG") or (SYSTEM_CONFIG if SYSTEM_CONFIG.exists() else None)
    if path:
        _merge(raw, sources, _read_toml(Path(path)), f"config file {path}")
    _merge(raw, sources, _from_env(env), "the environment")
    _merge(raw, sources, _unflatten(flags or {}), "the command line")
    _apply_model_flags(raw, sources, flags or {})
    try:
        return msgspec.convert(raw, Config, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(str(e), sources)) from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env.get("EMBER_MODELS"):
        out["models"] = [{"path": p} for p in env["EMBER_MODELS"].split(":") if p]
    if env.get("EMBER_SOCKET"):
        out.setdefault("server", {})["socket"] = env["EMBER_SOCKET"]
    if env.get("EMBER_KV_DTYPE"):  # the precision policy's variable (daemon/planning/precision.py), same meaning
        out.setdefault("engine", {})["kv_dtype"] = env["EMBER_KV_DTYPE"]
    if env.get("EMBER_ACT_DTYPE"):  # likewise
        out.setdefault("engine", {})["act_dtype"] = env["EMBER_ACT_DTYPE"]
    for section, cls in _SECTIONS.items():
        for field in cls.__struct_fields__:
            name = f"EMBER_{section}_{field}".upper()
            if name in env:
                out.setdefault(section, {})[field] = env[name]
    return out


def _apply_model_flags(raw: dict[str, Any], sources: dict[str, str], flags: Mapping[str, Any]) -> None:
    """Flags "model.KEY" set KEY on every model (the command line's, else the file's or the environment's)."""
    for key, value in flags.items():
        if key.startswith("model.") and value is not None:
            for m in raw.setdefault("models", []):
                m[key.split(".", 1)[1]] = value
            sources[f"models.{key.split('.', 1)[1]}"] = "the command line"


def _unflatten(flags: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if value is None or key.startswith("model."):
            continue
        if key == "models":
            out["models"] = [dict(p) if isinstance(p, Mapping) else {"path": str(p)} for p in value]
            continue
        section, field = key.split(".")
        out.setdefault(section, {})[field] = value
    return out


def _merge(raw: dict[str, Any], sources: dict[str, str], layer: Mapping[str, Any], source: str) -> None:
    """Later layers replace earlier values key by key (a section's other keys stay); lists replace whole."""
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(raw.get(key), dict):
            for sub, v in value.items():
                raw[key][sub] = v
                sources[f"{key}.{sub}"] = source
        else:
            raw[key] = dict(value) if isinstance(value, Mapping) else value
            sources[key] = source
            for sub in value if isinstance(value, Mapping) else ():
                sources[f"{key}.{sub}"] = source


def _explain(message: str, sources: Mapping[str, str]) -> str:
    """msgspec says `... - at `$.engine.max_active``; name the key as the user wrote it, and its source."""
    match = re.search(r" - at `\$((?:\.\w+|\[\d+\])*)`", message)
    if not match:
        return f"invalid configuration: {message}"
    key = re.sub(r"\[\d+\]", "", match.group(1)).lstrip(".")
    reason = message[: match.start()]
    first = reason.split(" ")[0].split(".")[-1]  # a section's own check names its field first
    if key in _SECTIONS and first in _SECTIONS[key].__struct_fields__:
        key = f"{key}.{first}"
    source = next((sources[k] for k in _prefixes(key) if k in sources), "the defaults")
    return f"invalid configuration: {key or 'top level'}: {reason} (set by {source})"


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
