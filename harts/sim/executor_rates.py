"""The executor cost model's rates (`harts.sim.executor`), as a hardware profile records
them: the `executor` section, every rate an entry {value, source, what} whose source says
whether it was measured (and in which result file), fitted (to which files) or assumed."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

__all__ = ["BASE_EXECUTOR", "CATEGORY_SCALES", "RATE_NAMES", "SOURCES", "ExecutorRates", "executor_rates_from_dict", "executor_rates_to_dict"]

SOURCES = ("measured", "fitted", "assumption")


@dataclass(frozen=True)
class ExecutorRates:
    host_s_per_launch: float
    launches_per_microbatch: float
    launches_per_extra_kda_round: float
    launches_per_consumer: float
    launches_per_sequence: float
    launches_per_step: float
    forward_host_share: float
    device_scale: float
    half_efficiency_rows: float
    consumer_device_s_per_producer_row: float
    offload_bytes_per_producer_row: float
    offload_bytes_per_s: float
    step_fixed_s: float
    reference_layers: float  # layers of the model the launch counts were counted on
    # device time of an op category over its roofline price x device_scale (the token-wise
    # ops' scale is device_scale itself): the roofline's relative prices of tree attention,
    # causal attention and KDA against the GEMMs are assumptions a kernel profile corrects
    attention_tree_scale: float = 1.0
    attention_causal_scale: float = 1.0
    kda_scale: float = 1.0

    def with_values(self, **values: float) -> ExecutorRates:
        return replace(self, **values)


RATE_NAMES = tuple(f.name for f in fields(ExecutorRates))
# rates a profile fitted before they existed lacks, with the value that reproduces its fit:
# no launches per sequence (its launch counts were fitted without the term), and the
# category scales at 1 (every op priced at device_scale x its roofline time)
_ADDED_LATER = {"launches_per_sequence": 0.0, "attention_tree_scale": 1.0, "attention_causal_scale": 1.0,
                "kda_scale": 1.0}
CATEGORY_SCALES = ("attention_tree_scale", "attention_causal_scale", "kda_scale")


def executor_rates_from_dict(section: dict[str, Any], sources: dict[str, str]) -> ExecutorRates:
    """The profile's `executor` section: every rate an entry {value, source, what}."""
    values = {}
    for name in RATE_NAMES:
        entry = section.get(name)
        if entry is None and name in _ADDED_LATER:
            # a profile fitted before the term existed: its launch counts were fitted without it
            entry = {"value": _ADDED_LATER[name], "source": "assumption"}
        if not isinstance(entry, dict) or "value" not in entry or "source" not in entry:
            raise ValueError(f"hardware profile: executor.{name} must be {{value, source, what}}")
        if entry["source"] not in SOURCES:
            raise ValueError(f"hardware profile: executor.{name}: source must be one of {', '.join(SOURCES)}")
        values[name] = float(entry["value"])
        sources[f"executor.{name}"] = str(entry["source"])
    return ExecutorRates(**values)




def executor_rates_to_dict(rates: ExecutorRates, sources: dict[str, str], what: dict[str, str]) -> dict[str, Any]:
    return {n: {"value": getattr(rates, n), "source": sources[n], "what": what.get(n, "")} for n in RATE_NAMES}


def _entry(value: float, source: str, what: str) -> dict[str, Any]:
    return {"value": value, "source": source, "what": what}


# The starting point of a fit (`harts sim calibrate`, benchmarks/sim_heldout.py) for a
# profile without an executor section: the structural rates with their sources, the
# fitted ones at typical values (each replaced by the fit that measures it).
BASE_EXECUTOR: dict[str, dict[str, Any]] = {
    "host_s_per_launch": _entry(4.2e-5, "assumption", "host seconds per kernel launch, ~40-50 us on the H100/H200 hosts"),
    "launches_per_microbatch": _entry(3965.0, "assumption", "kernel launches of a microbatch (its forward, recomputation and backward)"),
    "launches_per_extra_kda_round": _entry(382.0, "assumption", "launches of a KDA round past a microbatch's first"),
    "launches_per_consumer": _entry(522.0, "assumption", "a consumer's stash assembly and state handoff launches"),
    "launches_per_sequence": _entry(57.0, "assumption", "launches per sequence of a microbatch's KDA rounds (a "
                                    "tree's segments, a packed microbatch's trajectories): attention runs per "
                                    "sequence or per query segment"),
    "launches_per_step": _entry(952.0, "assumption", "optimizer, gradient norm and step bookkeeping launches"),
    "forward_host_share": _entry(0.4, "assumption", "share of a microbatch's launches in its forward action (the "
                                 "checkpointed forward, and the statistics forward with the global aux scope); "
                                 "the backward action runs the recomputation and the backward"),
    "device_scale": _entry(1.0, "assumption", "kernel time over roofline time on large microbatches"),
    "half_efficiency_rows": _entry(2500.0, "assumption", "rows at which a microbatch's kernels run at half efficiency"),
    "consumer_device_s_per_producer_row": _entry(4e-7, "assumption", "device seconds a consumer spends per producer "
                                                 "row gathering and accumulating the producer's stash"),
    "offload_bytes_per_producer_row": _entry(33800.0, "measured", "offloaded bytes / producer rows of grpo/0@8192's "
                                             "window (119,894,016 B / 3,548 rows), benchmarks/results/windows/"
                                             "2026-12-05-ae26d54-window-suite-h100-a.json"),
    "offload_bytes_per_s": _entry(2.0e10, "assumption", "PCIe Gen5 x16 copies between pinned host memory and the "
                                  "device, ~20 GB/s each way"),
    "step_fixed_s": _entry(0.0, "assumption", "fixed seconds per step beyond the launches"),
    "attention_tree_scale": _entry(1.0, "assumption", "tree attention's kernel time over its roofline price x "
                                   "device_scale (the roofline prices it at the profile's attention.tree rate)"),
    "attention_causal_scale": _entry(1.0, "assumption", "causal attention's kernel time over its roofline price x "
                                     "device_scale"),
    "kda_scale": _entry(1.0, "assumption", "the KDA kernels' time over their roofline price x device_scale"),
    "reference_layers": _entry(8.0, "measured", "layers of tiny-h200, the model whose launches were counted "
                               "(harts/config/models.py); a stage of another model scales the per-microbatch, "
                               "per-round and per-consumer launches by its layers over these"),
}
