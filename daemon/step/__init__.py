"""Step data: what one forward pass reads (StepBatch), built by the engine and read by the runner and the
models alike; a leaf below both."""
