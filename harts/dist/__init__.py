"""Distributed execution on torch.distributed: checkpointing (`checkpoint`)."""
