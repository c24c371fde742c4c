"""Distributed execution on torch.distributed: mesh, data, expert, tensor and pipeline
parallelism (`pipeline`), checkpoints (`checkpoint`)."""
