"""The server side of ember: model files, models, runtime, and (later) the daemon process."""
