"""Model runners: one per device, owning weights, KV cache and step buffers; chosen by a device registry."""
