"""RMSNorm and the head-wise L2 norm: the readable references (`naive`) and torch's fused
RMSNorm kernel (`fused`), selected per call by `paths`."""

from harts.exec.ops.norm.naive import l2_norm, offset_rms_norm, rms_norm

__all__ = ["l2_norm", "offset_rms_norm", "rms_norm"]
