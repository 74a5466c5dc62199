"""Wire messages and codec (msgspec), shared-memory rings and CUDA IPC descriptors."""
