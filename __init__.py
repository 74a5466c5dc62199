"""ember: a local LLM inference daemon.

The in-process API is `ember.load(path, device="cpu") -> Model`; the daemon, client SDK, kernels and
wire protocol live in the subpackages ember.daemon, ember.client, ember.kernels and ember.protocol.
Imports are lazy so that `import ember.protocol` (what a client needs) never pulls in numba.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["load", "Model", "ModelFileError", "__version__"]

if TYPE_CHECKING:
    from ember.daemon.loader.model_file_error import ModelFileError
    from ember.daemon.runtime import Model, load


def __getattr__(name: str) -> Any:
    if name in ("load", "Model", "ModelFileError"):
        from ember.daemon import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'ember' has no attribute {name!r}")
