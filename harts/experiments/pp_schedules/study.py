"""Table 6: PP scheduling ablation on Tiny/8 Tree-Step, in the simulator.

One step is planned by HARTS L1+L2 for the simulated pipeline (`PlanConfig.pp`: at least
`min_microbatches_per_stage` x PP microbatches per replica where the trees allow, trees
split into sharing windows) and simulated (harts.sim, roofline cost model on the H200
profile) under each pipeline schedule: non-overlapping sharing windows, overlap +
backward-first, and consumer 1F1B (the producer's backward inside the window's last
consumer backward). The study sweeps the microbatch budget (the memory cap per
microbatch). Throughput counts expanded tokens per simulated step second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
from harts.experiments.paper import TABLE6_PP
from harts.experiments.registry import Study, StudyName, register_study
from harts.experiments.steps import (
    Case,
    make_step_plan,
    parallel_for,
    plan_work,
    simulate_work,
    step_forest,
)

SCHEDULES = ("non-overlap", "overlap-bwd-first", "consumer-1f1b")
SCHEDULE_LABEL = {"non-overlap": "Non-overlapping windows", "overlap-bwd-first": "Overlap + backward-first",
                  "consumer-1f1b": "HARTS (consumer 1F1B)"}


@dataclass(frozen=True)
class PPSchedulesConfig:
    case: Case = Case("tiny", 8, "treestep")
    planner: str = "l1l2"
    schedules: tuple[str, ...] = SCHEDULES
    microbatch_tokens: tuple[int, ...] = (131_072, 98_304)
    steps: int = 2
    num_groups: int | None = 32  # prompt groups per step (None: one per GPU)
    hardware: str = "h200"
    cost_model: str = "roofline"
    recompute: bool = True
    gantt: bool = True  # Gantt charts of step 0 at the first budget that has producers


TINY = PPSchedulesConfig(microbatch_tokens=(98_304,), steps=1, num_groups=8)


def run(cfg: PPSchedulesConfig, progress: Progress) -> StudyResult:
    case = cfg.case
    par = parallel_for(case.model, case.gpus)
    progress.start(len(cfg.microbatch_tokens) * cfg.steps * (1 + len(cfg.schedules)))
    rows, variants, metrics, figures = [], [], {}, {}
    gantt_done = not cfg.gantt
    for budget in cfg.microbatch_tokens:
        acc = {s: {"throughput": [], "step_seconds": [], "bubble": [], "peak_gb": []} for s in cfg.schedules}
        info = {"producers": [], "microbatches": [], "compression": []}
        arts: dict[str, dict[str, bytes | str]] = {s: {} for s in cfg.schedules}
        for step in range(cfg.steps):
            progress.step(f"budget {budget:,}, step {step}: plan")
            forest = step_forest(case.scheme, case.gpus, step, cfg.num_groups)
            plan, m = make_step_plan(forest, cfg.planner, model=case.model, dp=par.dp, pp=par.pp,
                                     microbatch_tokens=budget, seed=step)
            work = plan_work(plan, forest, case.model)
            producers = len(plan.consumers())
            info["producers"].append(producers)
            info["microbatches"].append(m.microbatches)
            info["compression"].append(m.compression)
            draw = not gantt_done and producers > 0 and step == 0
            for schedule in cfg.schedules:
                progress.step(f"budget {budget:,}, step {step}: {schedule}")
                res = simulate_work(work, schedule, model=case.model, parallel=par, hardware=cfg.hardware,
                                    cost_model=cfg.cost_model, recompute=cfg.recompute)
                acc[schedule]["throughput"].append(res.throughput)
                acc[schedule]["step_seconds"].append(res.step_seconds)
                acc[schedule]["bubble"].append(res.bubble_fraction)
                acc[schedule]["peak_gb"].append(res.peak_memory_bytes / 1e9)
                if step == 0:
                    arts[schedule][f"schedules/{budget}-{schedule}.txt"] = res.schedule.to_text()
                    arts[schedule][f"plans/{budget}-{cfg.planner}.json"] = plan.to_json()
                if draw:
                    figures[f"gantt-{schedule}"] = _gantt(res, f"{case.label}, budget {budget:,}, {schedule}: "
                                                               f"{res.throughput / 1e3:,.1f} k tok/s, "
                                                               f"bubble {100 * res.bubble_fraction:.1f}%")
            gantt_done = gantt_done or draw
        base = mean(acc[cfg.schedules[0]]["throughput"])
        paper_base = TABLE6_PP.get(cfg.schedules[0])
        for schedule in cfg.schedules:
            a = acc[schedule]
            vm = {"throughput": mean(a["throughput"]), "step_seconds": mean(a["step_seconds"]),
                  "bubble_fraction": mean(a["bubble"]), "peak_memory_gb": mean(a["peak_gb"]),
                  "producers": mean(info["producers"]), "microbatches": mean(info["microbatches"]),
                  "compression": mean(info["compression"])}
            vm["relative_to_first"] = vm["throughput"] / base if base > 0 else float("nan")
            paper = TABLE6_PP.get(schedule)
            if paper is not None:
                vm["paper_k_tokens_per_s"] = paper
            rows.append({
                "budget": budget, "schedule": SCHEDULE_LABEL.get(schedule, schedule),
                "paper": paper, "ours": vm["throughput"] / 1e3,
                "paper_rel": paper / paper_base if paper and paper_base else None,
                "rel": vm["relative_to_first"], "bubble": vm["bubble_fraction"], "peak": vm["peak_memory_gb"],
                "producers": vm["producers"], "_schedule": schedule,
            })
            variants.append(Variant(f"{budget}/{schedule}",
                                    {"case": case, "planner": cfg.planner, "schedule": schedule,
                                     "microbatch_tokens": budget, "parallel": par.describe(),
                                     "hardware": cfg.hardware, "cost_model": cfg.cost_model,
                                     "recompute": cfg.recompute, "steps": cfg.steps},
                                    vm, arts[schedule]))
            metrics.update({f"mb{budget}.{schedule}.{k}": v for k, v in vm.items()})
    progress.finish()
    figures = {"pp_schedules": _plot(rows, cfg), **figures}
    table = Table(
        f"Table 6: PP scheduling ablation on {case.label} ({par.describe()}, planner {cfg.planner})",
        (
            Column("budget", "mb budget", "key", "{:,}"),
            Column("schedule", "schedule", "key"),
            Column("producers", "producers", "ours", "{:.1f}"),
            Column("paper", "paper k tok/s", "paper", "{:.1f}"),
            Column("ours", "ours k tok/s", "ours", "{:.1f}"),
            Column("paper_rel", "paper vs non-overlap", "paper", "{:.3f}x"),
            Column("rel", "ours vs non-overlap", "ours", "{:.3f}x"),
            Column("bubble", "bubble", "ours", "{:.1%}"),
            Column("peak", "peak GB", "ours", "{:.1f}"),
        ),
        tuple(rows),
        note=f"simulated ({cfg.cost_model} cost model, {cfg.hardware}, recompute={cfg.recompute}, "
             "EP passes in lockstep: the simulator's default); "
             f"mean over {cfg.steps} step(s); expanded tokens per simulated second. Paper numbers are "
             "measured throughput on GPUs; compare the ratios.",
    )
    return StudyResult(metrics=metrics, table=table, variants=tuple(variants), figures=figures)


def _gantt(res: Any, title: str) -> bytes:
    import tempfile
    from pathlib import Path

    from harts.sim.gantt import plot_gantt

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gantt.png"
        plot_gantt(res.trace, path, title=title, max_replicas=2)
        return path.read_bytes()


def _plot(rows: list[dict], cfg: PPSchedulesConfig) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    groups = [("paper", None)] + [(f"ours, budget {b:,}", b) for b in cfg.microbatch_tokens]
    n = len(groups)
    width = 0.8 / n
    colors = ["#9e9e9e", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for i, (label, budget) in enumerate(groups):
        vals = []
        for s in cfg.schedules:
            if budget is None:
                r = next((r for r in rows if r["_schedule"] == s), None)
                v = r["paper_rel"] if r else None
            else:
                r = next((r for r in rows if r["_schedule"] == s and r["budget"] == budget), None)
                v = r["rel"] if r else None
            vals.append(v or 0.0)
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(cfg.schedules))]
        bars = ax.bar(xs, vals, width, label=label, color=colors[i % len(colors)])
        for b, v in zip(bars, vals, strict=True):
            if v:
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(cfg.schedules)))
    ax.set_xticklabels([SCHEDULE_LABEL.get(s, s) for s in cfg.schedules], fontsize=8)
    ax.set_ylabel(f"throughput / {SCHEDULE_LABEL.get(cfg.schedules[0], cfg.schedules[0])}")
    hi = max([r["rel"] for r in rows] + [r["paper_rel"] or 1.0 for r in rows])
    ax.set_ylim(0.0, hi + 0.15)  # bars from 0: a cut axis would exaggerate the gaps
    ax.set_title("Pipeline schedules: throughput relative to non-overlapping windows", fontsize=10)
    ax.grid(axis="y", linestyle=":", linewidth=0.5)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=n, frameon=False)
    return png(fig)


STUDY = register_study(Study(StudyName.PP_SCHEDULES, "Table 6: PP scheduling ablation", run,
                             {"tiny": TINY, "default": PPSchedulesConfig()}))
