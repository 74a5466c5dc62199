"""The CPU backend: numba kernels (nogil, parallel) behind the ops API."""
