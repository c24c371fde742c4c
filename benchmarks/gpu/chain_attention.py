"""A chain of windows' attention against one causal call over the same rows, per attended
pair: where a chained step's attention time goes.

    python3 benchmarks/gpu/chain_attention.py [--rows 65536] [--piece 12096] [--heads 8]
        [--key-split 16384] --out DIR

A trajectory of `--rows` rows cut into pieces of `--piece` rows (the last one shorter), as
the l1l2 plan cuts it: piece k's queries attend the rows of every piece before it without a
mask (part A, a rectangle) and their own rows causally (part B), as
`harts.exec.ops.attention.split` runs them. Each call is cuDNN's SDPA (torch's
`scaled_dot_product_attention` under the cuDNN backend, the kernel the split's "dense"
variant and the causal baseline run), bf16, qk dim 192, value dim 128 (tiny-h200's MLA),
timed forward and forward+backward with CUDA events (median of 5 after 2 warm-ups); the
backward is their difference. Rows:

- `causal`: one causal call over all rows (the unsplit step's attention);
- `chain`: every piece's two calls, summed, and each call's own time;
- `chain, keys split`: part A cut into calls of at most `--key-split` keys (several
  rectangles per piece; the log-sum-exp merge they would need is not timed);
- `flash`: the causal call and part A of the last piece on torch's flash kernel (values
  padded to 192), for the same pairs on another kernel;
- for the last full piece's context: its keys cut into a batch, the call on row-major
  views, and the context as causal triangles (two causal calls per square of it, plus the
  row reversals the second needs), each against the one call.

Seconds per attended pair are given against the causal call's (1.0 = as cheap per pair).
Writes DIR/chain_attention.json with provenance.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from harts.bench.provenance import provenance  # noqa: E402
from harts.bench.timing import time_cuda  # noqa: E402

QK, V = 192, 128


def pieces(rows: int, piece: int) -> list[tuple[int, int]]:
    """(first row, rows) of each piece."""
    return [(a, min(piece, rows - a)) for a in range(0, rows, piece)]


@functools.cache
def call_seconds(sq: int, sk: int, heads: int, causal: bool, backend=SDPBackend.CUDNN_ATTENTION,
                 pad_v: bool = False, batch: int = 1, rows_major: bool = False) -> dict:
    """Forward and forward+backward seconds of one call: sq queries, sk keys (`batch`
    sequences of sq queries and sk / batch keys each: one rectangle's keys cut into
    `batch` pieces, its queries repeated, each piece's dQ its own; `rows_major`: q, k, v
    as [1, H, S, D] views of [S, H, D] rows, as the executor hands them)."""
    dev, dt = "cuda", torch.bfloat16
    sk //= batch

    def make(n, d, grad=True):
        if rows_major:
            x = torch.randn(batch, n, heads, d, device=dev, dtype=dt).transpose(1, 2)
            return x.requires_grad_() if grad else x
        return torch.randn(batch, heads, n, d, device=dev, dtype=dt, requires_grad=grad)

    q, k, v = make(sq, QK), make(sk, QK), make(sk, QK if pad_v else V)
    do = make(sq, QK if pad_v else V, grad=False)

    def fwd():
        with sdpa_kernel(backend), torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def both():
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        o.backward(do)
        q.grad = k.grad = v.grad = None

    f, fb = time_cuda(fwd, repeats=5, warmup=2), time_cuda(both, repeats=5, warmup=2)
    pairs = heads * batch * (sq * (sq + 1) // 2 if causal else sq * sk)
    return {"sq": sq, "sk": sk * batch, "causal": causal, "batch": batch, "rows_major": rows_major,
            "forward_s": f, "forward_backward_s": fb, "backward_s": fb - f, "pairs": pairs}


def flip_seconds(n: int, heads: int) -> float:
    """Seconds of reversing the rows of q, k, v, o and dO of an n-row call (bf16)."""
    xs = [torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16) for d in (QK, QK, V, V, V)]
    return time_cuda(lambda: [x.flip(2) for x in xs], repeats=5, warmup=2)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--piece", type=int, default=12096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--key-split", type=int, default=16384)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    H = args.heads
    result: dict = {"provenance": provenance([sys.argv[0], *argv]), "rows": args.rows, "piece": args.piece,
                    "heads": H, "qk_dim": QK, "v_dim": V, "calls": {}, "summary": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save():
        (out / "chain_attention.json").write_text(json.dumps(result, indent=1))

    causal = call_seconds(args.rows, args.rows, H, True)
    result["calls"]["causal"] = causal
    save()
    per_pair = {k: causal[k] / causal["pairs"] for k in ("forward_s", "backward_s", "forward_backward_s")}

    def total(calls: list[dict], name: str) -> None:
        t = {k: sum(c[k] for c in calls) for k in ("forward_s", "backward_s", "forward_backward_s", "pairs")}
        t["per_pair_over_causal"] = {k: t[k] / t["pairs"] / per_pair[k] for k in per_pair}
        result["summary"][name] = t
        print(f"{name:24s} fwd {t['forward_s'] * 1e3:8.2f} ms bwd {t['backward_s'] * 1e3:8.2f} ms  per pair / causal: "
              f"fwd {t['per_pair_over_causal']['forward_s']:.3f} bwd {t['per_pair_over_causal']['backward_s']:.3f}",
              flush=True)

    total([causal], "causal")
    chain, split = [], []
    for start, n in pieces(args.rows, args.piece):
        own = call_seconds(n, n, H, True)
        chain.append(own)
        split.append(own)
        if start:
            rect = call_seconds(n, start, H, False)
            chain.append(rect)
            split.extend(call_seconds(n, min(args.key_split, start - a), H, False)
                         for a in range(0, start, args.key_split))
        result["calls"][f"piece@{start}"] = {"own": own, **({"context": rect} if start else {})}
        save()
    total(chain, "chain")
    total(split, "chain, keys split")
    # the last full piece's context: its keys cut into a batch (queries repeated, a dQ per
    # piece of keys), and as views of row-major tensors
    start, n = [p for p in pieces(args.rows, args.piece) if p[1] == args.piece][-1]
    if start:
        base = call_seconds(n, start, H, False)
        for name, kw in (("batch", {"batch": start // n}), ("rows-major", {"rows_major": True})):
            c = call_seconds(n, start, H, False, **kw)  # a full piece starts at a multiple of its rows
            result["calls"][f"context {name}"] = c
            result["summary"][f"context {name} / one call"] = {
                k: c[k] / c["pairs"] / (base[k] / base["pairs"]) for k in ("forward_s", "backward_s")}
        # the context as causal triangles: each n x n square of it is the causal call over
        # (queries, keys) plus the strict lower triangle of the two reversed, a second causal
        # call's worth of pairs; timed as two causal n-row calls per square and the row
        # reversals of q, k, v, o and dO the second needs
        sq = call_seconds(n, n, H, True)
        flips = flip_seconds(n, H)
        squares = start // n
        tri = {k: squares * (2 * sq[k] + (flips if k != "forward_s" else 0.0)) for k in ("forward_s", "backward_s")}
        result["calls"]["context as triangles"] = {**tri, "squares": squares, "flip_s": flips}
        result["summary"]["context as triangles / one call"] = {
            k: tri[k] / base[k] for k in ("forward_s", "backward_s")}
        rc = call_seconds(args.rows, args.rows, H, True, rows_major=True)
        result["summary"]["causal rows-major / contiguous"] = {
            k: rc[k] / causal[k] for k in ("forward_s", "backward_s")}
        save()
    last_start, last_n = pieces(args.rows, args.piece)[-1]
    try:
        fl = [call_seconds(args.rows, args.rows, H, True, SDPBackend.FLASH_ATTENTION, pad_v=True)]
        total(fl, "flash causal")
        rect_fl = call_seconds(last_n, last_start, H, False, SDPBackend.FLASH_ATTENTION, pad_v=True)
        rect_cu = next(c for c in chain if c["sq"] == last_n and c["sk"] == last_start and not c["causal"])
        result["calls"]["flash last context"] = rect_fl
        result["summary"]["last context, flash / cudnn"] = {
            k: rect_fl[k] / rect_cu[k] for k in ("forward_s", "backward_s", "forward_backward_s")}
    except RuntimeError as err:  # no flash kernel for this shape
        result["summary"]["flash"] = f"{type(err).__name__}: {err}"
    save()
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
