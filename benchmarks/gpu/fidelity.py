"""bf16 fidelity of the tree against the expanded baseline on the GPU, and where their bits
part, op by op.

    python3 benchmarks/gpu/fidelity.py [fidelity] [divergence] [--baseline-attention graph] [--out DIR]

`fidelity`: `harts.verify.fidelity` on small-treestep (seed 3, vocab 32768, 64k-token
microbatches, tiny-h200, bf16): tree (replay / no replay), an expanded rerun and an
expanded repacked run, each against expanded (cosine, sym KL, NLL and loss differences).
With `--baseline-attention graph` the baseline runs the tree's cuDNN graph kernel, and the
tree with replay gives the baseline's bits (the test tests/cuda/test_fidelity.py asserts it).
`divergence` (not run by default): `harts.verify.divergence.compare_runs` on the same
workload, per op; `--quick` runs only tree replay against expanded.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from pathlib import Path

_HERE, _ROOT = Path(__file__).resolve().parent, str(Path(__file__).resolve().parents[2])
if sys.path and Path(sys.path[0] or ".").resolve() == _HERE:  # run as a script: this folder would
    sys.path[0] = _ROOT  # the repository root, not this folder, first on the path
elif _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

from benchmarks.gpu.common import Section, add_kernel_args, ctx, run_suite  # noqa: E402
from harts.config.kernels import BaselineAttention, TreeAttention  # noqa: E402
from harts.config.models import get_model_config  # noqa: E402
from harts.exec.model.model import build_model  # noqa: E402
from harts.exec.ops.attention import tree as tree_attention  # noqa: E402
from harts.exec.ops.record import KernelFallbackWarning  # noqa: E402
from harts.plan.partition import tree_partition  # noqa: E402
from harts.tree.workload import generate, preset  # noqa: E402
from harts.verify.divergence import compare_runs, format_table  # noqa: E402
from harts.verify.fidelity import fidelity  # noqa: E402


def workload():
    return generate(preset("small-treestep", vocab_size=32768, seed=3)).trajectories()


def attention_ran(kernels, fallbacks: list[str]) -> dict:
    """Which attention each mode ran (the tree's graph path needs its self-checks to pass;
    the baseline's graph path reports a fallback where it cannot run)."""
    if kernels.tree_attention is not TreeAttention.AUTO:
        tree = kernels.tree_attention.value
    elif any(v is not None for v in tree_attention._GRAPH_STATE.values()):
        tree = "graph"
    else:
        tree = "per-segment (no graph kernels)"
    expanded = {BaselineAttention.GRAPH: "graph", BaselineAttention.CUDNN: "torch cuDNN SDPA per sequence",
                BaselineAttention.FLASH: "torch flash SDPA per sequence"}[kernels.baseline_attention]
    if any(m.startswith("baseline_attention") for m in fallbacks):
        expanded += " (with fallbacks: see fallbacks)"
    return {"tree_attention": tree, "expanded_attention": expanded, "fallbacks": fallbacks}


def sec_fidelity(args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KernelFallbackWarning)
        out = fidelity(workload(), model=args.model, dtype=torch.bfloat16, device="cuda", microbatch_tokens=1 << 16,
                       kernels=args.kernels)
    for w in caught:  # the others go on to the usual handlers
        if not issubclass(w.category, KernelFallbackWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    fallbacks = sorted({str(w.message) for w in caught if issubclass(w.category, KernelFallbackWarning)})
    out.update(attention_ran(args.kernels, fallbacks), kernel_config=args.kernels.to_dict())
    return out


def sum_fidelity(out):
    rows = []
    for pair in ("tree_replay_vs_expanded", "tree_no_replay_vs_expanded", "expanded_rerun_vs_expanded",
                 "expanded_repacked_vs_expanded"):
        r = out[pair]
        rows.append((pair, f"cosine {r['cosine']:.7f} sym KL {r['sym_kl']:.3g} NLL max {r['nll_diff_max']:.3g} "
                           f"loss {r['loss_diff']:.3g}"))
    rows.append(("attention", f"tree {out['tree_attention']}, expanded {out['expanded_attention']}"))
    return rows


def sec_divergence(args):
    trajs = workload()
    out = {}
    # the model's RMSNorms in bf16 / in float32; the two tree-vs-expanded comparisons first,
    # each saved as it lands (a time limit keeps what is done)
    runs = ((False, "expanded", "replay"), (True, "expanded", "replay"), (False, "replay", "node"),
            (False, "expanded", "expanded"))
    for norm32, a, b in runs[:1] if args.quick else runs:
        cfg = dataclasses.replace(get_model_config(args.model), norm_float32=norm32)
        net = build_model(cfg, seed=0, dtype=torch.bfloat16, device="cuda")
        partition = tree_partition(trajs, 1 << 16)
        t0 = time.perf_counter()
        rep = compare_runs(net, trajs, partition, a, b, kernels=args.kernels)
        print(f"[norm_float32={norm32}] ({time.perf_counter() - t0:.1f}s) " + format_table(rep), flush=True)
        out[f"{b}_vs_{a}" + ("_norm32" if norm32 else "")] = rep
        ctx().save("divergence_partial", out)
        del net
    out["kernel_config"] = args.kernels.to_dict()
    return out


SECTIONS = [
    Section("fidelity", sec_fidelity, "bf16 tree/expanded drift against the baseline's own (rerun, repacked)",
            sum_fidelity),
    Section("divergence", sec_divergence, "where tree and expanded bits part, op by op", default=False),
]


def add_args(ap) -> None:
    ap.add_argument("--model", default="tiny-h200")
    add_kernel_args(ap, "tree_attention", "baseline_attention")
    ap.add_argument("--quick", action="store_true", help="divergence: only tree replay vs expanded, bf16 norms")


if __name__ == "__main__":
    sys.exit(run_suite("fidelity", SECTIONS, __doc__, add_args))
