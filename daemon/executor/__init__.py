"""Executors: what carries out the engine's steps — a step's plain data (step/step_work.py) in, its
sampled tokens and logits out. LocalExecutor runs them one at a time on one runner (with a draft's
proposals and their verification, and decode bursts); PipelineExecutor keeps one in flight per
stage of a layer split."""
