"""Gated DeltaNet (the gated delta rule with one decay per head) on packed varlen tensors."""

from harts.exec.ops.gdn.chunk import GDNOutput, chunk_gdn
from harts.exec.ops.gdn.naive import naive_recurrent_gdn

__all__ = ["GDNOutput", "chunk_gdn", "naive_recurrent_gdn"]
