"""What the gateway tests share: the daemon's configuration, the demo model's name, the test key (a module
of its own: `from conftest import` would find whichever conftest.py pytest loaded last)."""

MODEL = "ember-demo"
API_KEY = "sk-test-ember-0123456789"
# three running and three queued: a test can fill the daemon (busy) with six streams
DAEMON_CONFIG = """
[server]
probe_interval = 0.2
drain_timeout = 5.0
[engine]
max_active = 3
max_queued = 3
max_per_process = 0
[limits]
max_tokens = 4096
"""
