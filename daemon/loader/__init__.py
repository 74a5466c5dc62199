"""Model files on disk: GGUF and Hugging Face directories, their config, tensors and errors."""
