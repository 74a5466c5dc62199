"""Model architectures written once against the kernels ops API."""
