"""The `ember` command line: `main` parses the arguments and runs one subcommand."""
from ember.client.cli.main import main

__all__ = ["main"]
