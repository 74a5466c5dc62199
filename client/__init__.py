"""Client SDK and the `ember` command line."""
