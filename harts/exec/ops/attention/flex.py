"""Ancestor attention over a tree's compact layout with FlexAttention, the block mask built
from the DFS intervals (never a dense [R, R] mask).

Legend: R compact rows, H heads, D qk dim, E value dim, NB blocks of BS rows.

Row q may attend row k iff k <= q <= row_end[k]. For a q block [q0, q1) and a kv block
strictly below it (every k < every q), the block is
  - empty   iff max(row_end over the kv block) < q0     (no key's subtree reaches it),
  - full    iff min(row_end over the kv block) >= q1-1  (every key's subtree covers it),
  - partial otherwise;
diagonal blocks are partial (causal inside) and blocks above are empty. So the block mask
costs O(NB^2) from per-block minima and maxima of row_end, and only partial blocks evaluate
the elementwise rule, by one gather of row_end per key. Rows past R (padding of the last
block) get row_end = -1, so no query ever sees them. With a sharing window's context rows
the queries are a subset of the local rows (`q_local_C`) and the same bounds hold per block
from the smallest and largest query row.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tree_block_tables(end_L: Tensor, q_local_C: Tensor | None = None, block_size: int = 128) -> dict[str, Tensor]:
    """Block classification [NQ, NK] (bool 'full', 'partial') and the padded index tables.

    end_L: last local row of each key's subtree; q_local_C: the local row of each query
    (ascending; None = every row is a query). Partial is a superset of the true non-full
    blocks (a key block is kept when k0 <= max q and max end >= min q), full is exact.
    """
    L = int(end_L.numel())
    dev = end_L.device
    q_local = torch.arange(L, device=dev) if q_local_C is None else q_local_C.to(torch.int64)
    C = int(q_local.numel())
    BS = block_size
    NK = max(1, (L + BS - 1) // BS)
    NQ = max(1, (C + BS - 1) // BS)
    big = torch.iinfo(torch.int64).max
    end = torch.full((NK * BS,), -1, dtype=torch.int64, device=dev)
    end[:L] = end_L.to(torch.int64)
    valid = torch.arange(NK * BS, device=dev) < L
    max_end = end.view(NK, BS).max(1).values
    min_end = torch.where(valid, end, big).view(NK, BS).min(1).values
    k_first = torch.arange(NK, device=dev) * BS
    k_last = torch.clamp(k_first + BS, max=L) - 1
    qpad = torch.full((NQ * BS,), -1, dtype=torch.int64, device=dev)
    qpad[:C] = q_local
    qvalid = torch.arange(NQ * BS, device=dev) < C
    q_min = torch.where(qvalid, qpad, big).view(NQ, BS).min(1).values
    q_max = qpad.view(NQ, BS).max(1).values
    some = (k_first[None, :] <= q_max[:, None]) & (max_end[None, :] >= q_min[:, None])
    full = (k_last[None, :] <= q_min[:, None]) & (min_end[None, :] >= q_max[:, None])
    return {"full": full, "partial": some & ~full, "end_pad": end, "q_pad": qpad}


def _kv_blocks(sel_QK: Tensor) -> tuple[Tensor, Tensor]:
    num = sel_QK.sum(1).to(torch.int32)
    idx = torch.argsort((~sel_QK).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return num[None, None].contiguous(), idx[None, None].contiguous()


def tree_block_mask(end_L: Tensor, q_local_C: Tensor | None = None, block_size: int = 128):
    """FlexAttention BlockMask of the ancestor-or-self rule: queries q_local_C, keys all L rows."""
    from torch.nn.attention.flex_attention import BlockMask

    tables = tree_block_tables(end_L, q_local_C, block_size)
    end, qpos = tables["end_pad"], tables["q_pad"]

    def ancestor_mask(b, h, q_idx, kv_idx):
        q = qpos[q_idx]
        return (kv_idx <= q) & (end[kv_idx] >= q)

    L = int(end_L.numel())
    C = L if q_local_C is None else int(q_local_C.numel())
    kv_num, kv_idx = _kv_blocks(tables["partial"])
    full_num, full_idx = _kv_blocks(tables["full"])
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=ancestor_mask,
        seq_lengths=(C, L),
    )


def attended_pairs(row_end_R: Tensor) -> int:
    """Number of (query, key) pairs the ancestor rule allows: sum over k of subtree size."""
    idx = torch.arange(row_end_R.numel(), device=row_end_R.device)
    return int((row_end_R.to(torch.int64) - idx + 1).sum())


_COMPILED = {}
FP32_KERNEL_OPTIONS = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32,
                       "BLOCK_N2": 16, "num_stages": 1, "num_warps": 4}


def _flex(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
    return _COMPILED["flex"]


def tree_attention(q_THD: Tensor, k_THD: Tensor, v_THE: Tensor, scale: float, block_mask,
                   *, compiled: bool | None = None, kernel_options: dict | None = None) -> Tensor:
    """o_THE: each row attends its ancestors and itself (FlexAttention; compiled on CUDA)."""
    if compiled is None:
        compiled = q_THD.is_cuda
    q, k, v = (x.transpose(0, 1)[None] for x in (q_THD, k_THD, v_THE))
    fn = _flex(compiled)
    if kernel_options is None and compiled and q_THD.dtype == torch.float32:
        # fp32 tiles at qk 192 overflow shared memory with the default configs (280 KB > 227 KB)
        kernel_options = dict(FP32_KERNEL_OPTIONS)
    o = fn(q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options)
    return o[0].transpose(0, 1)
