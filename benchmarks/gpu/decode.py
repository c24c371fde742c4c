"""Dense GQA decode on one GPU against the rollout simulator's roofline
(`harts.sim.rollout.cost.RolloutCost.decode_step`, which prices every decode iteration of
a served model from the hardware file).

    python3 benchmarks/gpu/decode.py [decode] [--model qwen3-8b] [--layers 4] [--out DIR]

`decode`: one decode iteration (every sequence of the batch emits one token) through
`--layers` transformer blocks of the served model's shape (`DENSE_SERVED_MODELS`:
RMSNorm, fused QKV projection, attention of one query per sequence over its KV cache, output
projection, SwiGLU MLP), bf16, random weights, for batches x contexts. Attention is GQA
decode as two batched products per KV head group (the query heads of a group against
their shared K, softmax, against V), so each cached K and V is read once, as a decode
kernel does. The iteration is captured in a CUDA graph (serving engines replay decode
graphs) and replayed; eager time is recorded too. Each point's roofline is the
simulator's price of those layers alone: max(bytes / HBM, FLOPs / matmul) with the weights
and the KV read once (no launches: a graph has none; no all-reduce: one GPU). Measured /
roofline is what the simulator's prices understate decode by on this GPU.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:  # run as a script: this folder would
    sys.path[0] = _ROOT  # the repository root, not this folder, first on the path
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gpu.common import Section, run_suite, time_cuda  # noqa: E402
from harts.config.rollout import RolloutWorkload  # noqa: E402
from harts.sim.hardware import load_hardware  # noqa: E402
from harts.sim.rollout.cost import DENSE_SERVED_MODELS  # noqa: E402

BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (1024, 8192, 32768)
KV_BUDGET_BYTES = 64e9  # KV of all the measured layers at one point, at most


def _blocks(m, layers: int, g: torch.Generator) -> list[dict[str, torch.Tensor]]:
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim

    def w(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) * 0.02).bfloat16()

    return [{"n1": torch.ones(m.d_model, device="cuda", dtype=torch.bfloat16), "qkv": w(m.d_model, q + 2 * kv),
             "o": w(q, m.d_model), "n2": torch.ones(m.d_model, device="cuda", dtype=torch.bfloat16),
             "gu": w(m.d_model, 2 * m.ffn_dim), "down": w(m.ffn_dim, m.d_model)} for _ in range(layers)]


def _iteration(m, blocks, caches, x_BD: torch.Tensor) -> torch.Tensor:
    """One decode iteration of the blocks: x_BD is the batch's hidden rows."""
    B = x_BD.shape[0]
    H, G, Dh = m.num_heads, m.num_kv_heads, m.head_dim
    for blk, (k_BGCD, v_BGCD) in zip(blocks, caches, strict=True):
        h = F.rms_norm(x_BD, (m.d_model,), blk["n1"])
        q_BGhD = (h @ blk["qkv"])[:, : H * Dh].view(B, G, H // G, Dh)
        s_BGhC = torch.matmul(q_BGhD, k_BGCD.transpose(-1, -2)) * Dh ** -0.5
        o_BGhD = torch.matmul(torch.softmax(s_BGhC.float(), dim=-1).bfloat16(), v_BGCD)
        x_BD = x_BD + o_BGhD.reshape(B, H * Dh) @ blk["o"]
        h = F.rms_norm(x_BD, (m.d_model,), blk["n2"])
        gate, up = (h @ blk["gu"]).chunk(2, dim=-1)
        x_BD = x_BD + (F.silu(gate) * up) @ blk["down"]
    return x_BD


def _roofline(m, layers: int, batch: int, context: int, hbm: float, matmul: float) -> tuple[float, float, float]:
    """(seconds, bytes, FLOPs) the simulator's decode price gives these layers alone."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    layer_params = m.d_model * (q + 2 * kv) + q * m.d_model + 3 * m.d_model * m.ffn_dim
    kv_bytes = batch * context * 2 * kv * 2
    nbytes = layers * (layer_params * 2 + kv_bytes)
    flops = layers * (2.0 * batch * layer_params + 4.0 * batch * context * m.num_heads * m.head_dim)
    return max(nbytes / hbm, flops / matmul), nbytes, flops


def sec_decode(args):
    """Measured decode iterations against the roofline over batches x contexts."""
    m = DENSE_SERVED_MODELS[args.model]
    hw = load_hardware(RolloutWorkload().hardware)
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = _blocks(m, args.layers, g)
    per_token_kv = 2 * m.num_kv_heads * m.head_dim * 2 * args.layers
    points = []
    for context in CONTEXTS:
        for batch in BATCHES:
            if batch * context * per_token_kv > KV_BUDGET_BYTES:
                continue
            caches = [tuple(torch.randn(batch, m.num_kv_heads, context, m.head_dim, device="cuda",
                                        generator=g).bfloat16() for _ in range(2)) for _ in range(args.layers)]
            x = torch.randn(batch, m.d_model, device="cuda", generator=g).bfloat16()
            with torch.no_grad():
                eager = time_cuda(lambda c=caches, x=x: _iteration(m, blocks, c, x), repeats=args.repeats)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        _iteration(m, blocks, caches, x)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    _iteration(m, blocks, caches, x)
                replays = [time_cuda(graph.replay, repeats=args.repeats) for _ in range(3)]
            roof, nbytes, flops = _roofline(m, args.layers, batch, context, hw.hbm_bytes_per_s, hw.matmul_flops_per_s)
            graphed = statistics.median(replays)
            points.append({"batch": batch, "context": context, "graph_s": graphed, "eager_s": eager,
                           "roofline_s": roof, "bytes": nbytes, "flops": flops,
                           "measured_over_roofline": graphed / roof, "achieved_bytes_per_s": nbytes / graphed})
            print(f"  b={batch:4d} c={context:6d}: graph {graphed * 1e3:7.3f} ms  eager {eager * 1e3:7.3f} ms  "
                  f"roofline {roof * 1e3:7.3f} ms  ({graphed / roof:.2f}x, {nbytes / graphed / 1e12:.2f} TB/s)",
                  flush=True)
            del caches, graph
            torch.cuda.empty_cache()
    ratios = [p["measured_over_roofline"] for p in points]
    return {"model": args.model, "layers": args.layers, "hbm_bytes_per_s": hw.hbm_bytes_per_s,
            "matmul_flops_per_s": hw.matmul_flops_per_s, "points": points,
            "median_measured_over_roofline": statistics.median(ratios),
            "max_measured_over_roofline": max(ratios), "min_measured_over_roofline": min(ratios)}


def _summary(res):
    return [("measured / roofline", f"median {res['median_measured_over_roofline']:.2f}, "
             f"{res['min_measured_over_roofline']:.2f}-{res['max_measured_over_roofline']:.2f} "
             f"over {len(res['points'])} points")]


def _args(ap):
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(DENSE_SERVED_MODELS))
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks timed (the price is per block)")
    ap.add_argument("--repeats", type=int, default=20)


if __name__ == "__main__":
    sys.exit(run_suite("decode", [Section("decode", sec_decode, "dense GQA decode vs the simulator's roofline",
                                          _summary)],
                       __doc__.split("\n\n")[0], add_args=_args))
