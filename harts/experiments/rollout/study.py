"""Heddle's rollout scheduling against step-centric baselines, with one ablation per
mechanism, over seeds (`harts.sim.rollout.compare`): throughput, makespan, speedup over
the best baseline of each seed, and the bound on any policy's speedup (best-baseline makespan
over the largest of the critical-path, tail-set and work makespan bounds)."""

from __future__ import annotations

from dataclasses import dataclass

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
from harts.experiments.registry import Study, StudyName, register_study


@dataclass(frozen=True)
class RolloutStudyConfig:
    workload: str = "agentic-longtail"
    gpus: int = 32
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    policies: tuple[str, ...] = ()  # () = every registered policy
    baseline_mps: tuple[int, ...] = (4, 8)


TINY = RolloutStudyConfig(workload="tiny", gpus=8, seeds=(0, 1), baseline_mps=(4,))


def run(cfg: RolloutStudyConfig, progress: Progress) -> StudyResult:
    from harts.config.rollout import rollout_preset
    from harts.sim.rollout.compare import compare
    from harts.sim.rollout.policies import get_policy, known_policies

    policies = cfg.policies or tuple(known_policies())
    n_base = sum(get_policy(p).step_centric for p in policies)
    progress.start(len(cfg.seeds) * (n_base * len(cfg.baseline_mps) + len(policies) - n_base))
    wl = rollout_preset(cfg.workload)
    runs, summaries = compare(wl, cfg.gpus, cfg.seeds, policies, cfg.baseline_mps, progress=progress.step)
    progress.finish()
    metrics: dict[str, float] = {}
    variants, rows = [], []
    for r in runs:
        key = f"seed{r.seed}.{r.policy}.mp{r.baseline_mp}"
        vm = {"throughput_tokens_per_s": r.throughput_tokens_per_s, "makespan_s": r.makespan_s,
              "gpu_utilization": r.gpu_utilization, "migrations": float(r.migrations),
              "recomputed_tokens": float(r.recomputed_tokens)}
        variants.append(Variant(key, {"seed": r.seed, "policy": r.policy, "baseline_mp": r.baseline_mp,
                                      "gpus": cfg.gpus, "workload": cfg.workload,
                                      "layout": list(r.worker_degrees)}, vm))
        metrics.update({f"{key}.{k}": v for k, v in vm.items()})
    for s in summaries:
        metrics[f"seed{s.seed}.speedup_cap"] = s.speedup_cap
        for p, v in s.speedup.items():
            metrics[f"seed{s.seed}.{p}.speedup"] = v
    for p in policies:
        vals = [s.speedup[p] for s in summaries if p in s.speedup]
        tput = [r.throughput_tokens_per_s for r in runs if r.policy == p and r.baseline_mp == wl.baseline_mp]
        metrics[f"{p}.speedup_mean"] = mean(vals)
        rows.append({"policy": p, "paper": 2.5 if p == "heddle" else None, "tput": mean(tput), "speedup": mean(vals), "min": min(vals, default=None),
                     "max": max(vals, default=None), "per_seed": " ".join(f"{v:.2f}" for v in vals)})
    metrics["speedup_cap_mean"] = mean([s.speedup_cap for s in summaries])
    table = Table(
        f"Rollout scheduling: {cfg.workload} on {cfg.gpus} GPUs, speedup over the best step-centric baseline",
        (Column("policy", "policy", "key"), Column("paper", "paper (up to)", "paper", "{:.1f}x"),
         Column("tput", "tok/s (mean)", "ours", "{:,.0f}"),
         Column("speedup", "speedup (mean)", "ours", "{:.2f}x"), Column("min", "min", "ours", "{:.2f}x"),
         Column("max", "max", "ours", "{:.2f}x"), Column("per_seed", "per seed", "ours")),
        tuple(rows),
        note=f"seeds {list(cfg.seeds)}; best baseline per seed over policies x MP{list(cfg.baseline_mps)}: "
             + ", ".join(f"{s.seed}: {s.best_baseline}" for s in summaries)
             + f"; bound on any policy's speedup (mean) {metrics['speedup_cap_mean']:.2f}x; "
             "the paper reports up to 2.5x.",
    )
    return StudyResult(metrics=metrics, table=table, variants=tuple(variants),
                       figures={"speedup": _plot(rows)},
                       results={"summaries": [{"seed": s.seed, "best_baseline": s.best_baseline,
                                               "best_baseline_throughput": s.best_baseline_throughput,
                                               "bound_makespan_s": s.bound_makespan_s,
                                               "critical_path_s": s.critical_path_s,
                                               "tail_bound_s": s.tail_bound_s,
                                               "work_bound_s": s.work_bound_s,
                                               "speedup_cap": s.speedup_cap, "speedup": s.speedup}
                                              for s in summaries]})


def _plot(rows: list[dict]) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], color="#3182bd")
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["policy"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("rollout throughput / best baseline")
    ax.set_ylim(bottom=0.0)
    ax.grid(axis="y", linestyle=":", linewidth=0.5)
    return png(fig)


STUDY = register_study(Study(StudyName.ROLLOUT, "Heddle: trajectory-centric rollout scheduling", run,
                             {"tiny": TINY, "default": RolloutStudyConfig(),
                              "loaded": RolloutStudyConfig(workload="agentic-longtail-loaded"),
                              "reasoning": RolloutStudyConfig(workload="agentic-reasoning")}))
