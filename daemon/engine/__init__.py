"""The engine core: sequences, KV block accounting, the continuous-batching scheduler and the step loop."""
