"""The server side of ember, one concept per subpackage (docs/ARCHITECTURE.md has the map):
loader/ (model files), models/ (architectures), text/ (tokenizer, templates, stop strings),
engine/ (scheduler, KV blocks, the step loop), runner/ (a model on a device), planning/ (memory plan,
precision), server/ (the daemon process); runtime.py is the in-process API, `ember.load`."""
