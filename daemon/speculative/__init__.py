"""Speculative decoding: a draft model proposes tokens, the target verifies them in one pass."""
