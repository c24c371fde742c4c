"""Table 4: two-level scheduling. OR-Tools+FFD (the prior art's tree partitioning) vs HARTS
L1 vs L1+L2 on the same steps: compression (expanded / executed tokens), balance (mean
over slots of mean/max replica load, `harts.plan.metrics`) and planning seconds per step,
averaged over `steps` steps. The expanded baseline is planned too, for reference.
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
from harts.experiments.paper import TABLE4_PLANNERS
from harts.experiments.registry import Study, StudyName, register_study
from harts.experiments.steps import PLANNER_LABEL, Case, make_step_plan, parallel_for, step_forest


@dataclass(frozen=True)
class PlannersConfig:
    cases: tuple[Case, ...] = (Case("flash", 32, "treestep"), Case("flash", 32, "stepwise"))
    planners: tuple[str, ...] = ("expanded-ffd", "ortools-ffd", "l1", "l1l2")
    steps: int = 3
    microbatch_tokens: int = DEFAULT_MICROBATCH_TOKENS
    time_limit: float = 2.0  # CP-SAT limit of ortools-ffd (deterministic time units)
    num_groups: int | None = None
    save_plans: bool = True


TINY = PlannersConfig(cases=(Case("tiny", 8, "treestep"),), steps=1, num_groups=4, time_limit=0.5)

FIELDS = ("compression", "slot_balance", "balance_p5", "step_balance", "plan_seconds", "microbatches", "slots",
          "max_memory_tokens")


def run(cfg: PlannersConfig, progress: Progress) -> StudyResult:
    progress.start(len(cfg.cases) * cfg.steps * len(cfg.planners))
    rows, variants, metrics = [], [], {}
    for case in cfg.cases:
        par = parallel_for(case.model, case.gpus)
        acc = {p: {f: [] for f in FIELDS} for p in cfg.planners}
        plans: dict[str, dict[str, bytes | str]] = {p: {} for p in cfg.planners}
        for step in range(cfg.steps):
            forest = step_forest(case.scheme, case.gpus, step, cfg.num_groups)
            for planner in cfg.planners:
                progress.step(f"{case.label}, step {step}: {planner}")
                plan, m = make_step_plan(forest, planner, model=case.model, dp=par.dp,
                                         microbatch_tokens=cfg.microbatch_tokens, seed=step,
                                         time_limit=cfg.time_limit)
                for f in FIELDS:
                    acc[planner][f].append(float(getattr(m, f)))
                if step == 0 and cfg.save_plans:
                    plans[planner][f"plans/{planner}.json"] = plan.to_json()
        for planner in cfg.planners:
            vm = {f: mean(acc[planner][f]) for f in FIELDS}
            paper = TABLE4_PLANNERS.get(planner)
            if paper:
                vm.update(paper_compression=paper[0], paper_balance=paper[1], paper_plan_seconds=paper[2])
            rows.append({"case": case.label, "planner": PLANNER_LABEL.get(planner, planner),
                         "paper_c": paper[0] if paper else None, "c": vm["compression"],
                         "paper_b": paper[1] if paper else None, "b": vm["slot_balance"],
                         "p5": vm["balance_p5"], "paper_t": paper[2] if paper else None, "t": vm["plan_seconds"],
                         "mbs": vm["microbatches"], "_key": planner, "_case": case.key})
            variants.append(Variant(f"{case.key}/{planner}",
                                    {"case": case, "planner": planner, "dp": par.dp, "steps": cfg.steps,
                                     "microbatch_tokens": cfg.microbatch_tokens, "time_limit": cfg.time_limit},
                                    vm, plans[planner]))
            metrics.update({f"{case.key}.{planner}.{k}": v for k, v in vm.items()})
    progress.finish()
    table = Table(
        "Table 4: two-level scheduling (compression, balance, planning time per step)",
        (
            Column("case", "case", "key"),
            Column("planner", "planner", "key"),
            Column("paper_c", "paper compr.", "paper", "{:.3f}x"),
            Column("c", "ours compr.", "ours", "{:.3f}x"),
            Column("paper_b", "paper balance", "paper", "{:.2%}"),
            Column("b", "ours balance", "ours", "{:.2%}"),
            Column("p5", "ours P5", "ours", "{:.2%}"),
            Column("paper_t", "paper s/step", "paper", "{:.3f}"),
            Column("t", "ours s/step", "ours", "{:.3f}"),
            Column("mbs", "mbs", "ours", "{:.0f}"),
        ),
        tuple(rows),
        note=f"mean over {cfg.steps} step(s); balance = mean over slots of mean/max replica load; "
             f"OR-Tools limit {cfg.time_limit:g}; planning times on this CPU.",
    )
    return StudyResult(metrics=metrics, table=table, variants=tuple(variants), figures={"planners": _plot(rows, cfg)})


def _plot(rows: list[dict], cfg: PlannersConfig) -> bytes:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    planners = [p for p in cfg.planners if p != "expanded-ffd"] or list(cfg.planners)
    cases = list(dict.fromkeys(r["_case"] for r in rows))
    by = {(r["_case"], r["_key"]): r for r in rows}
    series = [("paper", None)] + [(c, c) for c in cases]
    width = 0.8 / len(series)
    colors = ["#9e9e9e", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for ax, (ours, paper, title, scale) in zip(
        axes,
        [("c", "paper_c", "compression (x)", 1.0), ("b", "paper_b", "balance (%)", 100.0),
         ("t", "paper_t", "planning time (s/step)", 1.0)],
        strict=True,
    ):
        for i, (_name, case) in enumerate(series):
            vals = []
            for p in planners:
                r = by.get((case or cases[0], p))
                v = (r[paper] if case is None else r[ours]) if r else None
                vals.append((v or 0.0) * scale)
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(planners))]
            label = "paper" if case is None else next(r["case"] for r in rows if r["_case"] == case)
            ax.bar(xs, vals, width, label=label, color=colors[i % len(colors)])
        ax.set_xticks(range(len(planners)))
        ax.set_xticklabels([PLANNER_LABEL.get(p, p).replace("HARTS ", "") for p in planners], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", linestyle=":", linewidth=0.5)
        if ours == "b":
            ax.set_ylim(0.0, 100.5)  # bars from 0: a cut axis would exaggerate the gaps
        else:
            ax.set_ylim(bottom=0.0)
    axes[0].legend(fontsize=8, loc="upper center", bbox_to_anchor=(1.7, -0.1), ncol=len(series), frameon=False)
    fig.suptitle("Planners: paper (Table 4) vs ours", fontsize=11)
    return png(fig)


STUDY = register_study(Study(StudyName.PLANNERS, "Table 4: two-level scheduling", run,
                             {"tiny": TINY, "default": PlannersConfig()}))
