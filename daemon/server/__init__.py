"""The daemon process: ember serve, the ZMQ I/O loop, the engine thread, sockets, systemd notify."""
