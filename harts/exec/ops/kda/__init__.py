"""Kimi Delta Attention on packed (batch-free, varlen) tensors."""

from harts.exec.ops.kda.chunk import KDAOutput, chunk_kda
from harts.exec.ops.kda.naive import naive_recurrent_kda

__all__ = ["KDAOutput", "chunk_kda", "naive_recurrent_kda"]
