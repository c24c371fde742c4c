"""The varlen attention kernel interface the split and graph paths share, and its reference.

A `VarlenKernel` computes attention over packed sequences (host cumulative lengths
`cu_q`, `cu_k`) and returns the natural-log log-sum-exp its backward needs, so that the
split attention (`split`) can merge two calls per segment and the cuDNN graph kernels
(`cudnn_graph`) can stand in for either part. `REFERENCE` (dense math per sequence,
float64-capable, any device) is what every fast kernel checks itself against on first use;
`_case` builds those checks' bf16 inputs on CUDA.
"""

from __future__ import annotations

import numpy as np
import torch


class VarlenKernel:
    """fwd(q_THD, k_SHD, v_SHE, cu_q, cu_k, max_q, max_k, causal, scale) -> (o_THE, lse_TH, aux);
    bwd(do, q, k, v, o, lse_TH, aux, cu_q, cu_k, max_q, max_k, causal, scale) -> dq, dk, dv.
    cu_* are host int64 arrays; lse is natural-log, float32 or wider, [T, H]."""

    name = "abstract"

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        raise NotImplementedError

    def bwd(self, do, q, k, v, o, lse, aux, cu_q, cu_k, max_q, max_k, causal, scale):
        raise NotImplementedError

    def aux_for(self, cu_q, cu_k, heads: int, device):
        """The `aux` that `bwd` needs when the forward ran elsewhere (o and lse from another
        kernel: `path_split_attention`); None where `bwd` needs none."""
        return None


class _Reference(VarlenKernel):
    """Dense math per sequence. Causal masks are aligned top-left (the split's parts are
    squares, where the alignments coincide) or, with `bottom_right`, to the bottom right (a
    sequence's queries are its last keys: the whole-path layout of `path_attention`)."""

    def __init__(self, bottom_right: bool = False):
        self.bottom_right = bottom_right
        self.name = "reference-br" if bottom_right else "reference"

    def _probs(self, q, k, lse, causal, scale):
        s = torch.einsum("nhd,mhd->hnm", q, k) * scale
        if causal:
            n, m = q.shape[0], k.shape[0]
            shift = m - n if self.bottom_right else 0
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1 + shift), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1).transpose(0, 1)  # [n, H]
        return torch.exp(s - lse.transpose(0, 1)[..., None]), lse

    def fwd(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        wide = torch.promote_types(q.dtype, torch.float32)
        o = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.empty(q.shape[0], q.shape[1], dtype=wide, device=q.device)
        for s in range(cu_q.size - 1):
            qs, ks, vs = (x.to(wide) for x in (q[cu_q[s]:cu_q[s + 1]], k[cu_k[s]:cu_k[s + 1]], v[cu_k[s]:cu_k[s + 1]]))
            p, lse_s = self._probs(qs, ks, None, causal, scale)
            o[cu_q[s]:cu_q[s + 1]] = torch.einsum("hnm,mhe->nhe", p, vs).to(o.dtype)
            lse[cu_q[s]:cu_q[s + 1]] = lse_s
        return o, lse, None

    def bwd(self, do, q, k, v, o, lse, aux, cu_q, cu_k, max_q, max_k, causal, scale):
        wide = torch.promote_types(q.dtype, torch.float32)
        dq, dk, dv = (torch.zeros_like(x, dtype=wide) for x in (q, k, v))
        for s in range(cu_q.size - 1):
            a, b, c, d = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
            qs, ks, vs, dos, os_ = (x.to(wide) for x in (q[a:b], k[c:d], v[c:d], do[a:b], o[a:b]))
            p, _ = self._probs(qs, ks, lse[a:b].to(wide), causal, scale)
            dv[c:d] += torch.einsum("hnm,nhe->mhe", p, dos)
            dp = torch.einsum("nhe,mhe->hnm", dos, vs)
            row = (dos * os_).sum(-1).transpose(0, 1)[..., None]  # [H, n, 1]
            ds = p * (dp - row) * scale
            dq[a:b] += torch.einsum("hnm,mhd->nhd", ds, ks)
            dk[c:d] += torch.einsum("hnm,nhd->mhd", ds, qs)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE = _Reference()
REFERENCE_BOTTOM_RIGHT = _Reference(bottom_right=True)


def _case(qk_dim, v_dim, n, m, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    H = 3
    q = torch.randn(sum(n), H, qk_dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(m), H, qk_dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(m), H, v_dim, device="cuda", generator=g).bfloat16()
    do = torch.randn(sum(n), H, v_dim, device="cuda", generator=g).bfloat16()
    return q, k, v, do, np.r_[0, np.cumsum(n)].astype(np.int64), np.r_[0, np.cumsum(m)].astype(np.int64)
