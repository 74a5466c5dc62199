"""The built-in demo model: where it lives, so every entry point uses the same default."""
from __future__ import annotations

from pathlib import Path

DEMO_MODEL = Path(__file__).parents[1] / "assets" / "ember-demo-dense-q8_0.gguf"
DEMO_DRAFT = Path(__file__).parents[1] / "assets" / "ember-demo-draft-q8_0.gguf"  # its speculative draft
DEMO_DFLASH = Path(__file__).parents[1] / "assets" / "ember-demo-dflash-q8_0.gguf"  # its feature-conditioned draft
