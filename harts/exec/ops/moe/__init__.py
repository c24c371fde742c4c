"""MoE's routed experts on the rows routed to them: the per-expert loop reference (`naive`)
and the grouped matrix products (`grouped`)."""

from harts.exec.ops.moe.naive import experts_loop, grouped_mm_reference

__all__ = ["experts_loop", "grouped_mm_reference"]
