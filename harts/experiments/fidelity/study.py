"""Table 7 and Figure 5: how close tree training is to trajectory-expanded training.

Runs on CPU with the `tiny-cpu` model (random weights, seeded) on a tree-step workload
whose trees are deep enough for 0-5 KDA handoffs. Every variant computes the full
vocabulary logits of every target (trajectory, position p >= 1: the logit row of p - 1):

- Baseline: expanded (trajectory-by-trajectory) in the dtype under test; its self-rerun is
  a second, freshly built model (on CPU it is deterministic, so the rerun is exact);
- HARTS: the tree step with replay (minimum-call KDA plan), with and without activation
  recomputation (the recompute path runs its forward under autograd, where the blocks
  are checkpointed);
- No-replay: the tree step with every node its own KDA sequence from its parent's final
  state (mid-chunk starts: the chunk grid of the trajectory is not reproduced).

Table 7 analogue: the equally weighted mean of token-wise full-vocabulary logit cosines
against the matched baseline (same dtype), and the absolute loss difference (HARTS
without recomputation, from `harts.verify.equivalence.verify_step`, which also reports
gradient errors and the KDA-layer bit check).

Figure 5 analogue, per handoff depth: Baseline A is the expanded step in the dtype under
test (the run HARTS is matched to), E_H and E_N the mean symmetric KL of the full
distributions and the mean absolute target-NLL difference of HARTS and No-replay against
it. CPU runs are deterministic, so a baseline rerun is no measure of noise; Baseline B is
therefore the expanded step in float64, and E_B (A against B) is the size of the
baseline's own rounding error, the scale a deviation is compared with:
(E_N / E_B - 1) x 100 % is No-replay's excess over it (and E_H / E_B HARTS's share). We
also count the targets whose logits are bit-identical to Baseline A. The handoff depth of
a target is the number of forks above its logit row (its node level): the number of
state handoffs on its path without replay; with replay, handoffs at chunk boundaries are
bit-exact (the KDA-layer check), so HARTS's deviation comes only from the other layers
(full attention over the tree's ancestor mask reduces in another order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harts.experiments.common import Column, Progress, StudyResult, Table, Variant, png, pyplot
from harts.experiments.paper import TABLE7_FIDELITY
from harts.experiments.registry import Study, StudyName, register_study

DEEP_TREES = {"rollouts_per_group": 32, "num_groups": 1, "turns_median": 8.0, "turns_range": (6, 12),
              "max_context": 1500}


@dataclass(frozen=True)
class FidelityConfig:
    workload: str = "tiny-treestep"
    workload_overrides: dict[str, Any] = field(default_factory=lambda: dict(DEEP_TREES))
    model: str = "tiny-cpu"
    seed: int = 0
    dtypes: tuple[str, ...] = ("float32", "float64")
    max_depth: int = 5  # deeper targets are pooled into the last bucket
    gradients: bool = True  # verify_step: gradients, loss terms, KDA-layer bit check
    recompute: bool = True  # the "HARTS w/ recomputation" column
    # torch intra-op threads while the study runs (None: leave torch's setting). One thread
    # is the fast choice for these small matrices, and immune to oversubscription when
    # other jobs share the cores.
    threads: int | None = 1


TINY = FidelityConfig(workload_overrides={"num_groups": 1}, max_depth=3)

VARIANTS = ("rerun", "harts", "harts_recompute", "noreplay")
VARIANT_LABEL = {"baseline": "Baseline", "rerun": "Baseline self-rerun", "harts": "HARTS",
                 "harts_recompute": "HARTS w/ recomputation", "noreplay": "No-replay", "B": "Baseline B"}


def _targets(trajectories: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(trajectory, position, label) of every target, in trajectory order."""
    traj = np.concatenate([np.full(len(t) - 1, j, dtype=np.int64) for j, t in enumerate(trajectories)])
    pos = np.concatenate([np.arange(1, len(t), dtype=np.int64) for t in trajectories])
    label = np.concatenate([t.tokens[1:] for t in trajectories])
    return traj, pos, label


def _logits(model: Any, trajectories: list, forest: Any, mode: str, grad: bool = False) -> Any:
    """Full-vocabulary logits of every target [N, V]: `mode` "expanded" (packed
    trajectories), "replay" or "node" (the tree)."""
    import torch

    from harts.exec.model.context import PackedContext
    from harts.exec.tree import TreeContext

    B = model.config.chunk_size
    lengths = np.asarray([len(t) for t in trajectories], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    # logit row of (trajectory j, position p) in the expanded layout: offsets[j] + p - 1
    exp_rows = np.concatenate([offsets[j] + np.arange(0, n - 1) for j, n in enumerate(lengths)])
    with torch.set_grad_enabled(grad):
        if mode == "expanded":
            ids = torch.from_numpy(np.concatenate([t.tokens for t in trajectories]))
            ctx = PackedContext(torch.from_numpy(offsets), chunk_size=B)
            rows = exp_rows
        else:
            ids = torch.from_numpy(forest.token_ids)
            ctx = TreeContext(forest, chunk_size=B, kda_mode=mode)
            rows = forest.traj_rows[exp_rows]
        hidden = model(ids, ctx).hidden_TD
        logits = hidden[torch.from_numpy(rows)] @ model.lm_head_weight.T
    return logits.detach()


def _compare(x: Any, ref: Any, label: np.ndarray) -> dict[str, np.ndarray]:
    """Per-target errors of logits `x` against `ref` (both promoted to float64)."""
    import torch

    x64, r64 = x.to(torch.float64), ref.to(torch.float64)
    lx, lr = torch.log_softmax(x64, -1), torch.log_softmax(r64, -1)
    sym_kl = ((lr.exp() - lx.exp()) * (lr - lx)).sum(-1)
    idx = torch.from_numpy(label).unsqueeze(1)
    nll = (lx.gather(1, idx) - lr.gather(1, idx)).abs().squeeze(1)
    cos = torch.nn.functional.cosine_similarity(x64, r64, dim=-1)
    return {"sym_kl": sym_kl.numpy(), "abs_nll": nll.numpy(), "cosine": cos.numpy()}


def run(cfg: FidelityConfig, progress: Progress) -> StudyResult:
    import torch

    saved = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress)
    finally:
        torch.set_num_threads(saved)


def _run(cfg: FidelityConfig, progress: Progress) -> StudyResult:
    import torch

    from harts.config.models import get_model_config
    from harts.exec.model.model import build_model
    from harts.tree import build_forest
    from harts.tree.workload import generate, preset

    dtypes = {"float32": torch.float32, "float64": torch.float64}
    for d in cfg.dtypes:
        if d not in dtypes:
            raise ValueError(f"fidelity: dtype {d!r} not in {list(dtypes)}")
    trajectories = generate(preset(cfg.workload, **cfg.workload_overrides)).trajectories()
    vocab = get_model_config(cfg.model).vocab_size
    if max(int(t.tokens.max()) for t in trajectories) >= vocab:
        raise ValueError(f"fidelity: workload token ids exceed the vocabulary of {cfg.model} ({vocab})")
    forest = build_forest(trajectories)
    traj, pos, label = _targets(trajectories)
    row = forest.traj_rows[forest.traj_offsets[traj] + pos - 1]
    depth = np.minimum(forest.node_level[forest.row_node[row]], cfg.max_depth)
    depths = list(range(cfg.max_depth + 1))
    counts = [int((depth == k).sum()) for k in depths]
    need_ref = any(d != "float64" for d in cfg.dtypes)
    per_dtype = 1 + len(VARIANTS) + (1 if cfg.gradients else 0)
    progress.start(len(cfg.dtypes) * per_dtype + (1 if need_ref else 0))

    def build(dtype: Any, recompute: bool = False) -> Any:
        return build_model(cfg.model, seed=cfg.seed, dtype=dtype, recompute=recompute)

    ref64 = None
    if need_ref:
        progress.step("Baseline A: expanded float64")
        ref64 = _logits(build(torch.float64), trajectories, forest, "expanded")
    t7_rows, depth_rows, variants, metrics, curves = [], [], [], {}, {}
    verify: dict[str, Any] = {}
    for dname in cfg.dtypes:
        dt = dtypes[dname]
        progress.step(f"{dname}: baseline (expanded)")
        base = ref64 if (dname == "float64" and ref64 is not None) else _logits(build(dt), trajectories, forest,
                                                                                 "expanded")
        outs: dict[str, Any] = {}
        for v in VARIANTS:
            progress.step(f"{dname}: {VARIANT_LABEL[v]}")
            if v == "rerun":
                outs[v] = _logits(build(dt), trajectories, forest, "expanded")
            elif v == "harts":
                outs[v] = _logits(build(dt), trajectories, forest, "replay")
            elif v == "harts_recompute":
                if not cfg.recompute:
                    continue
                outs[v] = _logits(build(dt, recompute=True), trajectories, forest, "replay", grad=True)
            else:
                outs[v] = _logits(build(dt), trajectories, forest, "node")
        vs_base = {v: _compare(x, base, label) for v, x in outs.items()}
        rep = None
        if cfg.gradients:
            from harts.verify.equivalence import verify_step

            progress.step(f"{dname}: verify_step (losses, gradients, KDA layer)")
            rep = verify_step(trajectories, model=cfg.model, dtype=dt, seed=cfg.seed)
            verify[dname] = rep
        row7 = {"dtype": dname, "targets": int(label.size)}
        vm: dict[str, float] = {}
        for v, e in vs_base.items():
            vm[f"{v}.bit_identical_frac"] = float((outs[v] == base).all(-1).float().mean())
            row7[v] = float(e["cosine"].mean())
            # clipped: a mean cosine can round to a hair above 1
            row7[f"{v}_gap"] = max(0.0, float(1.0 - e["cosine"].mean()))
            vm[f"{v}.cosine_mean"] = float(e["cosine"].mean())
            vm[f"{v}.one_minus_cosine"] = max(0.0, float(1.0 - e["cosine"].mean()))
            vm[f"{v}.sym_kl_mean"] = float(e["sym_kl"].mean())
            vm[f"{v}.abs_nll_mean"] = float(e["abs_nll"].mean())
            vm[f"{v}.abs_nll_max"] = float(e["abs_nll"].max())
        if rep is not None:
            row7["loss_diff"] = float(rep["loss_abs_err"]["loss"])
            vm.update(_verify_metrics(rep))
        t7_rows.append(row7)
        # Figure 5: deviations from Baseline A by depth, with Baseline B's rounding as the scale
        e_b = _compare(base, ref64, label) if (dname != "float64" and ref64 is not None) else None
        bits = {v: (outs[v] == base).all(-1).numpy() for v in ("harts", "noreplay")}
        curve: dict[str, dict[str, list[float]]] = {}
        for k in depths:
            sel = depth == k
            drow: dict[str, Any] = {"dtype": dname, "depth": f"{k}+" if k == cfg.max_depth else str(k),
                                    "targets": int(sel.sum())}
            for metric in ("sym_kl", "abs_nll"):
                errs = {"harts": vs_base["harts"][metric], "noreplay": vs_base["noreplay"][metric]}
                if e_b is not None:
                    errs["B"] = e_b[metric]
                for v, e in errs.items():
                    val = float(e[sel].mean()) if sel.any() else float("nan")
                    drow[f"{v}.{metric}"] = val
                    curve.setdefault(metric, {}).setdefault(v, []).append(val)
                    if np.isfinite(val):
                        vm[f"depth{k}.{v}.{metric}"] = val
                eb = drow.get(f"B.{metric}", float("nan"))
                # no handoff above these rows: no-replay is exact too, there is nothing to compare
                if eb > 0 and drow[f"noreplay.{metric}"] > 0:
                    drow[f"noreplay.{metric}.excess"] = (drow[f"noreplay.{metric}"] / eb - 1.0) * 100.0
                    drow[f"harts.{metric}.share"] = drow[f"harts.{metric}"] / eb
                    vm[f"depth{k}.noreplay.{metric}.excess_pct"] = drow[f"noreplay.{metric}.excess"]
                    vm[f"depth{k}.harts.{metric}.share_of_B"] = drow[f"harts.{metric}.share"]
            for v in ("harts", "noreplay"):
                frac = float(bits[v][sel].mean()) if sel.any() else float("nan")
                drow[f"{v}.bit"] = frac
                curve.setdefault("bit", {}).setdefault(v, []).append(frac)
                if np.isfinite(frac):
                    vm[f"depth{k}.{v}.bit_identical_frac"] = frac
            vm[f"depth{k}.targets"] = float(drow["targets"])
            depth_rows.append(drow)
        curves[dname] = curve
        variants.append(Variant(dname, {"dtype": dname, "model": cfg.model, "workload": cfg.workload,
                                        "workload_overrides": cfg.workload_overrides, "seed": cfg.seed},
                                vm))
        metrics.update({f"{dname}.{k}": v for k, v in vm.items()})
    progress.finish()
    paper = TABLE7_FIDELITY
    t7_rows.append({"_kind": "paper", "dtype": "paper (Tiny, bf16, DP8/TP1/PP1/EP8)", "rerun": paper["self_rerun_cosine"],
                    "harts": paper["harts_cosine"], "harts_recompute": paper["harts_recompute_cosine"],
                    "loss_diff": paper["abs_loss_diff"], "rerun_gap": 1 - paper["self_rerun_cosine"],
                    "harts_gap": 1 - paper["harts_cosine"]})
    table = Table(
        "Table 7: full-model fidelity (mean token-wise full-vocabulary logit cosine vs the matched baseline)",
        (
            Column("dtype", "run", "key"),
            Column("rerun", "Baseline self-rerun", "ours", "{:.10f}"),
            Column("harts", "HARTS w/o recomp.", "ours", "{:.10f}"),
            Column("harts_recompute", "HARTS w/ recomp.", "ours", "{:.10f}"),
            Column("noreplay", "No-replay", "ours", "{:.10f}"),
            Column("harts_gap", "1-cos HARTS", "ours", "{:.2e}"),
            Column("noreplay_gap", "1-cos No-replay", "ours", "{:.2e}"),
            Column("loss_diff", "abs loss diff", "ours", "{:.2e}"),
        ),
        tuple(t7_rows),
        note=f"{label.size:,} targets, {forest.num_trajectories} trajectories, {forest.compact_tokens:,} compact / "
             f"{forest.expanded_tokens:,} expanded tokens, model {cfg.model} (CPU). The last row is the paper's "
             "(bf16 on GPUs), for scale.",
    )
    extra = (Table(
        "Figure 5: deviation from Baseline A (expanded, same dtype) by handoff depth (forks above the logit row)",
        (
            Column("dtype", "dtype", "key"),
            Column("depth", "depth", "key"),
            Column("targets", "targets", "ours", "{:,}"),
            Column("B.abs_nll", "|dNLL| B (fp64)", "ours", "{:.2e}"),
            Column("harts.abs_nll", "|dNLL| HARTS", "ours", "{:.2e}"),
            Column("noreplay.abs_nll", "|dNLL| no-replay", "ours", "{:.2e}"),
            Column("B.sym_kl", "symKL B", "ours", "{:.2e}"),
            Column("harts.sym_kl", "symKL HARTS", "ours", "{:.2e}"),
            Column("noreplay.sym_kl", "symKL no-replay", "ours", "{:.2e}"),
            Column("noreplay.abs_nll.excess", "no-replay excess", "ours", "{:+.1f}%"),
            Column("harts.bit", "HARTS bit-exact", "ours", "{:.0%}"),
            Column("noreplay.bit", "no-replay bit-exact", "ours", "{:.0%}"),
        ),
        tuple(depth_rows),
        note="B = the expanded step in float64 against Baseline A: the baseline's own rounding error (none for "
             "float64). excess = (E_N / E_B - 1) x 100 % on |dNLL|; bit-exact = targets whose logits equal A's.",
    ),)
    lower = [d for d in cfg.dtypes if d != "float64"]
    figures = {"fidelity": _plot(curves[lower[0] if lower else cfg.dtypes[0]], counts, cfg,
                                 lower[0] if lower else cfg.dtypes[0])}
    results = {"depth_counts": counts, "verify": verify,
               "kda": {"rounds": verify.get(cfg.dtypes[0], {}).get("rounds"),
                       "replay_tokens": verify.get(cfg.dtypes[0], {}).get("replay_tokens")}}
    return StudyResult(metrics=metrics, table=table, extra_tables=extra, variants=tuple(variants),
                       figures=figures, results=results)


def _verify_metrics(rep: dict[str, Any]) -> dict[str, float]:
    out = {
        "verify.max_rel_logprob_err": rep["max_rel_logprob_err"],
        "verify.rms_rel_logprob_err": rep["rms_rel_logprob_err"],
        "verify.max_rel_grad_err": rep["max_rel_grad_err"],
        "verify.rms_rel_grad_err": rep["rms_rel_grad_err"],
        "verify.loss_abs_err": rep["loss_abs_err"]["loss"],
        "verify.rounds": rep["rounds"],
        "verify.replay_tokens": rep["replay_tokens"],
    }
    nr = rep.get("no_replay")
    if nr:
        out.update({"verify.no_replay.max_rel_logprob_err": nr["max_rel_logprob_err"],
                    "verify.no_replay.max_rel_grad_err": nr["max_rel_grad_err"],
                    "verify.no_replay.loss_abs_err": nr["loss_abs_err"]["loss"],
                    "verify.no_replay.rounds": nr["rounds"]})
    kda = rep.get("kda_layer")
    if kda:
        for mode, r in kda.items():
            out[f"verify.kda_layer.{mode}.bit_identical"] = float(r["bit_identical"])
            out[f"verify.kda_layer.{mode}.rms_rel_err"] = r["rms_rel_err"]
    return {k: float(v) for k, v in out.items()}


def _plot(curve: dict, counts: list[int], cfg: FidelityConfig, dname: str) -> bytes:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    xs = list(range(cfg.max_depth + 1))
    ticks = [f"{x}{'+' if x == cfg.max_depth else ''}\n{n:,} tok" for x, n in zip(xs, counts, strict=True)]
    styles = {"B": ("Baseline B: fp64 vs A (rounding scale)", "#2ca02c", "s"),
              "harts": ("HARTS (replay) vs A", "#1f77b4", "o"), "noreplay": ("No-replay vs A", "#d62728", "^")}
    for ax, metric, title in zip(axes[:2], ("sym_kl", "abs_nll"),
                                 ("(a) symmetric KL", "(b) mean |target NLL difference|"), strict=True):
        floor = None
        for v, (label, color, marker) in styles.items():
            ys = curve.get(metric, {}).get(v)
            if ys is None:
                continue
            pos = [y for y in ys if np.isfinite(y) and y > 0]
            floor = min(pos + ([floor] if floor else [])) if pos else floor
            ax.plot(xs, [y if np.isfinite(y) and y > 0 else np.nan for y in ys], marker=marker, color=color,
                    label=label)
        if floor:
            # exact zeros (bit-identical) cannot sit on a log axis: mark them at the bottom
            for v, (_, color, marker) in styles.items():
                ys = curve.get(metric, {}).get(v) or []
                zx = [x for x, y in zip(xs, ys, strict=True) if y == 0]
                ax.scatter(zx, [floor / 10] * len(zx), marker=marker, facecolors="none", edgecolors=color)
        ax.set_yscale("log")
        ax.set_title(f"{title} vs Baseline A ({dname})", fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels(ticks, fontsize=7)
        ax.set_xlabel("handoff depth (hollow marker at the bottom: exactly 0)", fontsize=8)
        ax.grid(linestyle=":", linewidth=0.5)
        ex = curve.get(f"{metric}.excess")
        if metric == "abs_nll" and "B" in curve.get(metric, {}):
            ax2 = ax.twinx()
            b = curve[metric]["B"]
            # where no-replay is exact too (no handoff above the row) there is nothing to compare
            ax2.plot(xs, [(n / e - 1) * 100 if e and e > 0 and n > 0 else np.nan
                          for n, e in zip(curve[metric]["noreplay"], b, strict=True)],
                     linestyle="--", color="#ff7f0e", label="No-replay excess (E_N/E_B - 1), right axis")
            ax2.set_ylabel("excess over Baseline B (%)", color="#ff7f0e", fontsize=8)
            ax2.axhline(0.0, color="#ff7f0e", linewidth=0.4)
            del ex
    ax = axes[2]
    for v in ("harts", "noreplay"):
        label, color, marker = styles[v]
        ax.plot(xs, [100 * y for y in curve["bit"][v]], marker=marker, color=color, label=label)
    ax.set_ylim(-5, 105)
    ax.set_title(f"(c) targets with logits bit-identical to A ({dname}), %", fontsize=9)
    ax.set_xticks(xs)
    ax.set_xticklabels(ticks, fontsize=7)
    ax.set_xlabel("handoff depth", fontsize=8)
    ax.grid(linestyle=":", linewidth=0.5)
    handles, labels = [], []
    for a in fig.axes:
        h, lab = a.get_legend_handles_labels()
        for hh, ll in zip(h, lab, strict=True):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False, bbox_to_anchor=(0.5, -0.04))
    fig.suptitle("Replay keeps the tree step on the baseline's chunkwise numerical path (CPU, "
                 f"{cfg.model})", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return png(fig)


STUDY = register_study(Study(StudyName.FIDELITY, "Table 7 / Figure 5: numerical fidelity", run,
                             {"tiny": TINY, "default": FidelityConfig()}))
