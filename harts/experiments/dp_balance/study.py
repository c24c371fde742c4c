"""Table 5: DP load-balance distributions.

The same steps (a fixed global batch of `num_groups` prompt groups per step) are planned
for DP = 2, 4, 8 replicas by HARTS L1+L2 and OR-Tools+FFD. Every slot of every step gives
one balance value (mean / max replica load in the slot); the table reports the number of
microbatch slots over all steps, the 5th percentile of the slot balances (P5) and the
minimum over steps of the step-total balance (mean / max of the replicas' step totals).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts.config.plan import DEFAULT_MICROBATCH_TOKENS
from harts.experiments.common import Column, Progress, StudyResult, Table, Variant, png, pyplot
from harts.experiments.paper import TABLE5_DP_BALANCE
from harts.experiments.registry import Study, StudyName, register_study
from harts.experiments.steps import PLANNER_LABEL, make_step_plan, step_forest


@dataclass(frozen=True)
class DPBalanceConfig:
    model: str = "tiny"
    scheme: str = "treestep"
    num_groups: int = 64  # prompt groups per step, the same for every DP
    steps: int = 6
    dps: tuple[int, ...] = (2, 4, 8)
    planners: tuple[str, ...] = ("l1l2", "ortools-ffd")
    microbatch_tokens: int = DEFAULT_MICROBATCH_TOKENS
    time_limit: float = 1.0


TINY = DPBalanceConfig(num_groups=4, steps=2, dps=(2, 4), time_limit=0.3)


def run(cfg: DPBalanceConfig, progress: Progress) -> StudyResult:
    from harts.plan.metrics import per_slot_balance

    progress.start(cfg.steps * len(cfg.dps) * len(cfg.planners))
    rows, variants, metrics = [], [], {}
    dists: dict[tuple[int, str], np.ndarray] = {}
    for dp in cfg.dps:
        row: dict = {"dp": dp}
        for planner in cfg.planners:
            slot_bal, step_bal, slots, comp = [], [], 0, []
            plan_json = ""
            for step in range(cfg.steps):
                progress.step(f"DP{dp} {planner}, step {step}")
                forest = step_forest(cfg.scheme, cfg.num_groups, step, cfg.num_groups)
                plan, m = make_step_plan(forest, planner, model=cfg.model, dp=dp,
                                         microbatch_tokens=cfg.microbatch_tokens, seed=step,
                                         time_limit=cfg.time_limit)
                slot_bal.append(per_slot_balance(plan))
                step_bal.append(m.step_balance)
                slots += m.slots
                comp.append(m.compression)
                if step == 0:
                    plan_json = plan.to_json()
            dist = np.concatenate(slot_bal) if slot_bal else np.zeros(0)
            dists[(dp, planner)] = dist
            vm = {
                "slots": float(slots),
                "balance_p5": float(np.percentile(dist, 5)) if dist.size else 1.0,
                "slot_balance_mean": float(dist.mean()) if dist.size else 1.0,
                "step_total_min": float(min(step_bal)),
                "step_total_mean": float(np.mean(step_bal)),
                "compression": float(np.mean(comp)),
            }
            paper = TABLE5_DP_BALANCE.get(dp, {}).get(planner)
            if paper:
                vm.update(paper_slots=float(paper[0]), paper_balance_p5=paper[1], paper_step_total_min=paper[2])
            row.update({f"{planner}.slots": vm["slots"], f"{planner}.p5": vm["balance_p5"],
                        f"{planner}.min": vm["step_total_min"],
                        f"{planner}.paper_slots": paper[0] if paper else None,
                        f"{planner}.paper_p5": paper[1] if paper else None,
                        f"{planner}.paper_min": paper[2] if paper else None})
            variants.append(Variant(f"dp{dp}/{planner}",
                                    {"dp": dp, "planner": planner, "model": cfg.model, "scheme": cfg.scheme,
                                     "num_groups": cfg.num_groups, "steps": cfg.steps},
                                    vm, {f"plans/dp{dp}-{planner}-step0.json": plan_json,
                                         "slot_balances.json": _json_list(dist)}))
            metrics.update({f"dp{dp}.{planner}.{k}": v for k, v in vm.items()})
        rows.append(row)
    progress.finish()
    pair = " / ".join(PLANNER_LABEL.get(p, p).replace("HARTS ", "") for p in cfg.planners)
    cols = [Column("dp", "DP", "key")]
    for key, label in (("slots", "slots"), ("p5", "balance P5"), ("min", "step-total min")):
        cols.append(Column(f"paper_{key}", f"paper {label}", "paper"))
        cols.append(Column(key, f"ours {label}", "ours"))
    for row in rows:
        for key in ("slots", "p5", "min"):
            def cell(prefix: str, key: str = key, row: dict = row) -> str | None:
                vals = [row.get(f"{p}.{prefix}{key}") for p in cfg.planners]
                if any(v is None for v in vals):
                    return None
                return " / ".join(f"{v:.0f}" if key == "slots" else f"{100 * v:.2f}" for v in vals)

            row[key] = cell("")
            row[f"paper_{key}"] = cell("paper_")
    table = Table(
        "Table 5: DP load-balance distributions",
        tuple(cols),
        tuple(rows),
        note=f"cells: {pair}; balances in %. {cfg.steps} steps of {cfg.num_groups} {cfg.scheme} prompt groups "
             f"({cfg.model} cost model), the same steps for every DP; slots summed over steps.",
    )
    return StudyResult(metrics=metrics, table=table, variants=tuple(variants),
                       figures={"dp_balance": _plot(dists, cfg)})


def _json_list(a: np.ndarray) -> str:
    import json

    return json.dumps([float(x) for x in a])


def _plot(dists: dict[tuple[int, str], np.ndarray], cfg: DPBalanceConfig) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = {"l1l2": "#1f77b4", "ortools-ffd": "#d62728", "l1": "#ff7f0e"}
    n = len(cfg.planners)
    width = 0.8 / n
    for i, planner in enumerate(cfg.planners):
        pos = [j + (i - (n - 1) / 2) * width for j in range(len(cfg.dps))]
        data = [100 * dists[(dp, planner)] for dp in cfg.dps]
        bp = ax.boxplot(data, positions=pos, widths=width * 0.8, whis=(5, 95), patch_artist=True,
                        showfliers=True, flierprops={"markersize": 2})
        color = colors.get(planner, "#7f7f7f")
        for box in bp["boxes"]:
            box.set(facecolor=color, alpha=0.35, edgecolor=color)
        ax.scatter(pos, [float(np.percentile(d, 5)) if d.size else 100 for d in data], marker="v", color=color,
                   zorder=3, label=f"ours {PLANNER_LABEL.get(planner, planner)} P5")
        paper = [TABLE5_DP_BALANCE.get(dp, {}).get(planner) for dp in cfg.dps]
        if any(paper):
            ax.scatter([p for p, v in zip(pos, paper, strict=True) if v], [100 * v[1] for v in paper if v],
                       marker="*", s=90, color=color, edgecolor="black", zorder=4,
                       label=f"paper {PLANNER_LABEL.get(planner, planner)} P5")
    ax.set_xticks(range(len(cfg.dps)))
    ax.set_xticklabels([f"DP{dp}" for dp in cfg.dps])
    ax.set_ylabel("slot balance (mean/max load, %)")
    ax.set_title("Per-slot load balance over all steps (box: quartiles, whiskers: P5-P95)", fontsize=10)
    ax.grid(axis="y", linestyle=":", linewidth=0.5)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    return png(fig)


STUDY = register_study(Study(StudyName.DP_BALANCE, "Table 5: DP load-balance distributions", run,
                             {"tiny": TINY, "default": DPBalanceConfig()}))
