"""`python -m ember.client.cli`: the `ember` command."""
import sys

from ember.client.cli.main import main

sys.exit(main())
