"""The engine's geometry defaults, in one place for the runtime, the daemon and the memory planner
(which imports this and not the kernels, to stay metadata-only and quick)."""

KV_BLOCK = 16  # tokens per KV cache block
PREFILL_CHUNK = 256  # tokens per forward pass while reading a prompt: bounds activation memory
