"""RoutingStats: how often each expert of each layer is routed to, as exponentially decayed counts
(half-life in tokens), kept across runs in ember's cache directory so the first placement of a
model already follows its routing."""
from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

log = logging.getLogger("ember.experts")

HALF_LIFE_TOKENS = 16384  # a layer's counts halve every this many tokens routed through it


def cache_root(env: Mapping[str, str]) -> Path:
    """ember's cache directory under the environment `env` (the caller's, read once at the top):
    EMBER_CACHE_DIR, else $XDG_CACHE_HOME/ember, else ~/.cache/ember."""
    if env.get("EMBER_CACHE_DIR"):
        return Path(env["EMBER_CACHE_DIR"])
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ember"


def stats_path(model: Path, root: Path) -> Path:
    """Where a model's routing statistics live under the cache directory `root`: keyed by its
    resolved path and size."""
    p = Path(model).resolve()
    size = sum(f.stat().st_size for f in sorted(p.glob("*.safetensors"))) if p.is_dir() else p.stat().st_size
    key = hashlib.sha256(f"{p}\0{size}".encode()).hexdigest()[:16]
    return root / "routing" / f"{p.name}-{key}.npy"


class RoutingStats:
    def __init__(self, n_layers: int, n_experts: int, half_life: float = HALF_LIFE_TOKENS) -> None:
        self.counts = np.zeros((n_layers, n_experts), np.float64)
        self.half_life = half_life

    def record(self, layer: int, expert: np.ndarray, n_tokens: int) -> None:
        """One layer's routing of n_tokens tokens: `expert` holds their chosen expert ids."""
        row = self.counts[layer]
        row *= 0.5 ** (n_tokens / self.half_life)
        row += np.bincount(expert, minlength=row.size)

    def as_int64(self) -> np.ndarray:
        return np.rint(self.counts).astype(np.int64)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, self.counts, allow_pickle=False)
        os.replace(tmp, path)

    def load(self, path: Path) -> bool:
        """Take the counts saved at `path` if there are any of this shape; False otherwise."""
        try:
            counts = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            if path.exists():
                log.warning("ignoring routing statistics %s: %s", path, e)
            return False
        if counts.shape != self.counts.shape or not np.isfinite(counts).all():
            log.warning("ignoring routing statistics %s: shape %s, expected %s", path, counts.shape, self.counts.shape)
            return False
        self.counts[:] = counts
        return True
