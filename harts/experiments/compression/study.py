"""Table 3: within-microbatch prefix compression on SWE-shaped steps.

For each (model, GPUs, scheme) case, the step's forest is planned by HARTS L1 (the
compression-oriented microbatches: sharing only inside a microbatch, which is what Table 3
measures) and by L1+L2 (adds cross-microbatch sharing through producers). Compression =
expanded tokens / executed tokens of the plan; the forest's own expanded / compact ratio
is the bound any planner can reach. Averaged over `steps` steps of the workload.
"""

from __future__ import annotations

from dataclasses import dataclass

from harts.config.plan import DEFAULT_MICROBATCH_TOKENS
from harts.experiments.common import (
    Column,
    Progress,
    StudyResult,
    Table,
    Variant,
    mean,
    png,
    pyplot,
)
from harts.experiments.paper import TABLE3_COMPRESSION
from harts.experiments.registry import Study, StudyName, register_study
from harts.experiments.steps import Case, make_step_plan, parallel_for, step_forest

PAPER_CASES = (
    Case("tiny", 8, "treestep"),
    Case("flash", 32, "stepwise"),
    Case("flash", 32, "treestep"),
    Case("flash", 64, "stepwise"),
    Case("flash", 64, "treestep"),
)


@dataclass(frozen=True)
class CompressionConfig:
    cases: tuple[Case, ...] = PAPER_CASES
    steps: int = 2
    microbatch_tokens: int = DEFAULT_MICROBATCH_TOKENS
    num_groups: int | None = None  # prompt groups per step; None = one per GPU (the presets)
    save_plans: bool = True


TINY = CompressionConfig(cases=(Case("tiny", 8, "treestep"), Case("flash", 32, "stepwise")), steps=1,
                         num_groups=2)


def run(cfg: CompressionConfig, progress: Progress) -> StudyResult:
    progress.start(len(cfg.cases) * cfg.steps)
    rows, variants, metrics = [], [], {}
    for case in cfg.cases:
        par = parallel_for(case.model, case.gpus)
        per = {"forest": [], "l1": [], "l1l2": [], "l1_mbs": [], "l1l2_mbs": [], "expanded": [], "compact": []}
        artifacts: dict[str, bytes | str] = {}
        for step in range(cfg.steps):
            progress.step(f"{case.label}, step {step}")
            forest = step_forest(case.scheme, case.gpus, step, cfg.num_groups)
            per["forest"].append(forest.compression)
            per["expanded"].append(forest.expanded_tokens)
            per["compact"].append(forest.compact_tokens)
            for planner in ("l1", "l1l2"):
                plan, m = make_step_plan(forest, planner, model=case.model, dp=par.dp,
                                         microbatch_tokens=cfg.microbatch_tokens, seed=step)
                per[planner].append(m.compression)
                per[f"{planner}_mbs"].append(m.microbatches)
                if step == 0 and cfg.save_plans:
                    artifacts[f"plans/{planner}.json"] = plan.to_json()
        paper = TABLE3_COMPRESSION.get((case.model, case.gpus, case.scheme))
        row = {
            "case": case.label,
            "parallel": par.describe(),
            "paper": paper,
            "l1": mean(per["l1"]),
            "l1l2": mean(per["l1l2"]),
            "forest": mean(per["forest"]),
            "l1_mbs": mean(per["l1_mbs"]),
            "expanded_m": mean(per["expanded"]) / 1e6,
        }
        rows.append(row)
        vm = {
            "l1_compression": row["l1"], "l1l2_compression": row["l1l2"], "forest_compression": row["forest"],
            "l1_microbatches": row["l1_mbs"], "l1l2_microbatches": mean(per["l1l2_mbs"]),
            "expanded_tokens": mean(per["expanded"]), "compact_tokens": mean(per["compact"]),
        }
        if paper is not None:
            vm["paper_compression"] = paper
            vm["l1_over_paper"] = row["l1"] / paper
        variants.append(Variant(case.key, {"case": case, "dp": par.dp, "pp": par.pp, "ep": par.ep,
                                           "steps": cfg.steps, "microbatch_tokens": cfg.microbatch_tokens},
                                vm, artifacts))
        metrics.update({f"{case.key}.{k}": v for k, v in vm.items()})
    progress.finish()
    table = Table(
        "Table 3: within-microbatch prefix compression (expanded / executed tokens)",
        (
            Column("case", "model/GPUs sampling", "key"),
            Column("parallel", "layout", "key"),
            Column("paper", "paper", "paper", "{:.2f}x"),
            Column("l1", "ours L1 (in-mb)", "ours", "{:.2f}x"),
            Column("l1l2", "ours L1+L2", "ours", "{:.2f}x"),
            Column("forest", "tree bound", "ours", "{:.2f}x"),
            Column("l1_mbs", "L1 mbs", "ours", "{:.0f}"),
            Column("expanded_m", "expanded Mtok", "ours", "{:.1f}"),
        ),
        tuple(rows),
        note=f"{cfg.steps} step(s) per case, microbatch budget {cfg.microbatch_tokens:,} tokens; "
             "'tree bound' is the step's expanded/compact ratio (no planner can exceed it).",
    )
    return StudyResult(metrics=metrics, table=table, variants=tuple(variants),
                       figures={"compression": _plot(rows)},
                       notes=("SWE-shaped synthetic steps (harts.tree.workload): our step-wise rollouts share "
                              "every earlier turn, so their tree bound is far above the paper's 7.6x.",))


def _plot(rows: list[dict]) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 3.8))
    n = len(rows)
    width = 0.2
    xs = range(n)
    series = [("paper", "paper", "#9e9e9e"), ("l1", "ours L1 (in-microbatch)", "#1f77b4"),
              ("l1l2", "ours L1+L2", "#ff7f0e"), ("forest", "tree bound", "#2ca02c")]
    for i, (key, label, color) in enumerate(series):
        vals = [r[key] if r[key] is not None else 0.0 for r in rows]
        bars = ax.bar([x + (i - 1.5) * width for x in xs], [v - 1.0 for v in vals], width, bottom=1.0,
                      label=label, color=color)
        for b, v, r in zip(bars, vals, rows, strict=True):
            if r[key] is not None:
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom", fontsize=6.5)
    from matplotlib.ticker import FuncFormatter

    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["case"] for r in rows], fontsize=8)
    ax.set_ylabel("compression (x, log scale)")
    ax.set_yscale("log")
    top = max(max(r[k] or 1.0 for k in ("paper", "l1", "l1l2", "forest")) for r in rows)
    ax.set_ylim(1.0, top * 1.5)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_title("In-microbatch compression: paper vs ours")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)
    ax.grid(axis="y", linestyle=":", linewidth=0.5)
    return png(fig)


STUDY = register_study(Study(StudyName.COMPRESSION, "Table 3: within-microbatch prefix compression", run,
                             {"tiny": TINY, "default": CompressionConfig()}))
