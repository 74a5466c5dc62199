"""Plain numpy references of every kernel: the oracles the backends are tested against."""
