"""Scatter-adds as gathers: sum the rows of a source into target rows in a fixed order.

Legend: T target rows, P source rows, F features per row (trailing dims flattened).

`out[t] = base[t] + sum over p with index[p] = t of src[p]` is `index_add_` — on CUDA an
fp32 atomic add per element, in no fixed order, on a float32 copy of the source when the
result must be accumulated wider than bf16. Here the index is inverted once (`inverse`: for
each target row, the source rows that land on it, in ascending order; built on the device
by a stable sort, without a host sync), and one Triton program per tile of target rows
reads its sources and `base`, sums in fp32 in that order and writes `out` once in its own
dtype. Deterministic, and it reads the bf16 source as it is: on the H200 tree step the
ancestor keys' gradient scatter of the split attention (`attention.split`, 280k source rows
of 16 x 192 onto 82k) was `index_add_` on float32 copies, 11.2 ms with its conversions'
copies 6.3 ms more (benchmarks/results/profile/2026-11-29-edc4f35-opsites-2.json).

`reference_gather_add` is the readable version (float64-capable, any device); CI checks
the kernel against it under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


def inverse(targets: torch.Tensor, T: int, BT: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ptr [T+1], order [P], tile_pairs [ceil(T/BT)]), int32: the positions p with
    targets[p] = t are order[ptr[t]:ptr[t+1]], ascending (a stable sort by target);
    targets < 0 are left out; tile_pairs is the most positions any row of a BT-row tile
    has (a kernel's trip count). On targets' device, no host sync."""
    # int32 keys (T < 2**31): a radix sort makes one pass per key byte, half of int64's
    targets = targets.reshape(-1).to(torch.int32 if T < torch.iinfo(torch.int32).max else torch.int64)
    dev = targets.device
    key = torch.where(targets >= 0, targets, T)  # left-out positions sort after every row
    skey, order = torch.sort(key, stable=True)
    ptr = torch.searchsorted(skey, torch.arange(T + 1, device=dev, dtype=skey.dtype), out_int32=True)
    count = ptr[1:] - ptr[:-1]
    tiles = triton.cdiv(T, BT)
    tile_pairs = torch.nn.functional.pad(count, (0, tiles * BT - T)).view(tiles, BT).amax(dim=1).contiguous()
    return ptr.contiguous(), order.to(torch.int32).contiguous(), tile_pairs


def inverse_host(targets: np.ndarray, T: int, BT: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`inverse` of a host index whose entries all lie in [0, T), built on the host (numpy:
    a layout's index known when the step is prepared), as int32 arrays."""
    targets = np.asarray(targets, dtype=np.int64).reshape(-1)
    order = np.argsort(targets, kind="stable")
    ptr = np.searchsorted(targets[order], np.arange(T + 1), side="left")
    count = np.diff(ptr)
    tiles = -(-T // BT)
    tile_pairs = np.pad(count, (0, tiles * BT - T)).reshape(tiles, BT).max(axis=1) if T else count
    return ptr.astype(np.int32), order.astype(np.int32), tile_pairs.astype(np.int32)


@triton.jit
def _gather_add_kernel(base, src, ptr, order, tile_pairs, out, T, F: tl.constexpr, BT: tl.constexpr,
                       BF: tl.constexpr, HAS_BASE: tl.constexpr):
    i_t = tl.program_id(0)
    i_f = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_f = i_f * BF + tl.arange(0, BF)
    m_t = o_t < T
    m_f = o_f < F
    m = m_t[:, None] & m_f[None, :]
    at = o_t.to(tl.int64)[:, None] * F + o_f[None, :]
    if HAS_BASE:
        acc = tl.load(base + at, mask=m, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BT, BF], dtype=tl.float32)
    start = tl.load(ptr + o_t, mask=m_t, other=0)
    end = tl.load(ptr + o_t + 1, mask=m_t, other=0)
    n = tl.load(tile_pairs + i_t)
    for k in range(0, n):
        idx = start + k
        ok = (idx < end) & m_t
        p = tl.load(order + idx, mask=ok, other=0).to(tl.int64)
        acc += tl.load(src + p[:, None] * F + o_f[None, :], mask=ok[:, None] & m_f[None, :], other=0.0).to(tl.float32)
    tl.store(out + at, acc.to(out.dtype.element_ty), mask=m)


BT = 16  # target rows per program
BF = 256  # features per program


def gather_add(base: torch.Tensor | None, src: torch.Tensor, inv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               *, rows: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """out [T, ...] = base + the src rows summed onto their targets (fp32 sums in ascending
    source order), in base's dtype (or `dtype`); `inv` = `inverse(targets, T, BT)`. Without
    base, `rows` gives T."""
    ptr, order, tile_pairs = inv
    T = base.shape[0] if base is not None else int(rows)
    shape = (T, *src.shape[1:])
    if base is not None and tuple(base.shape) != shape:
        raise ValueError(f"base must be {list(shape)}; got {list(base.shape)}")
    if ptr.numel() != T + 1 or tile_pairs.numel() != triton.cdiv(T, BT):
        raise ValueError("inverse was built for another row count or tile")
    F = src[0].numel() if src.shape[0] else int(torch.Size(src.shape[1:]).numel())
    out = torch.empty(shape, dtype=dtype or (base.dtype if base is not None else src.dtype), device=src.device)
    if T == 0:
        return out
    src = src.contiguous()
    grid = (triton.cdiv(T, BT), triton.cdiv(F, BF))
    _gather_add_kernel[grid](base.contiguous() if base is not None else src, src, ptr, order, tile_pairs, out,
                             T, F=F, BT=BT, BF=BF, HAS_BASE=base is not None)
    return out


def reference_gather_add(base: torch.Tensor | None, src: torch.Tensor, targets: torch.Tensor, *,
                         rows: int | None = None, dtype: torch.dtype | None = None,
                         wide: torch.dtype = torch.float32) -> torch.Tensor:
    """The same with `index_add_` in `wide` (float64 for checks)."""
    T = base.shape[0] if base is not None else int(rows)
    acc = (base.to(wide) if base is not None else torch.zeros((T, *src.shape[1:]), dtype=wide, device=src.device))
    keep = targets >= 0
    acc = acc.index_add(0, targets[keep].to(torch.int64), src[keep].to(wide))
    return acc.to(dtype or (base.dtype if base is not None else src.dtype))
