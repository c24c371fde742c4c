"""Hardware profiles: per-GPU rates and interconnect bandwidths, loaded from JSON data files.

A profile file (``harts/sim/hardware/<name>.json``) records raw figures with their source
("measured" on the project's H200, or "assumption"); this module derives the rates the
cost models use (attention FLOP/s per mask kind, KDA seconds per token-head) from those raw
measurements, so the data file keeps what was measured rather than what was inferred.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harts.sim.executor_rates import ExecutorRates, executor_rates_from_dict

HARDWARE_DIR = Path(__file__).parent / "hardware"
SCHEMA = "harts.sim.hardware/v1"


@dataclass(frozen=True)
class LinkRates:
    """Bandwidths (bytes/s) and per-operation latency (s) of one level of the network."""

    bus_bytes_per_s: float  # ring all-reduce / reduce-scatter / all-gather bus bandwidth
    p2p_bytes_per_s: float
    all_to_all_bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device: str
    matmul_flops_per_s: float
    hbm_bytes_per_s: float
    hbm_capacity_bytes: int
    kernel_launch_s: float
    # attention: effective FLOP/s of forward+backward per mask kind, counting only allowed
    # (query, key) pairs with fwd FLOPs 2*(qk_dim + v_dim) per pair and head
    attention_flops_per_s: dict[str, float]
    attention_bwd_over_fwd: float
    attention_kernels_fwd: int
    attention_kernels_bwd: int
    # KDA: seconds per (token x head) of forward+backward at the measured head dims
    kda_s_per_token_head: float
    kda_ref_head_dims: tuple[int, int]  # (K, V) of the measurement
    kda_fwd_fraction: float
    kda_chunk_step_s: float
    kda_kernels_fwd: int
    kda_kernels_bwd: int
    gpus_per_node: int
    intra_node: LinkRates
    inter_node: LinkRates
    sources: dict[str, str]  # field -> "measured" | "fitted" | "assumption"
    # how the executor runs a step on this GPU (harts.sim.executor); None: roofline only
    executor: ExecutorRates | None = None
    # the host seconds per launch fitted on each machine of this GPU kind measured so far
    # (the profile's `host_machines`): host speed is the machine's, and `harts sim`
    # reports the step over this range beside the prediction at `executor`'s own rate
    host_machines: tuple[float, ...] = ()

    def link(self, spans_nodes: bool) -> LinkRates:
        return self.inter_node if spans_nodes else self.intra_node


def attention_fwd_flops_per_pair_head(qk_dim: int, v_dim: int) -> float:
    return 2.0 * (qk_dim + v_dim)


def _val(section: dict[str, Any], key: str, sources: dict[str, str], prefix: str) -> Any:
    try:
        entry = section[key]
    except KeyError as err:
        raise ValueError(f"hardware profile: missing {prefix}.{key}") from err
    if isinstance(entry, dict):
        sources[f"{prefix}.{key}"] = str(entry.get("source", "unknown"))
        return entry["value"]
    return entry


def _attention_rate(m: dict[str, Any], bwd_over_fwd: float) -> float:
    """Effective fwd+bwd FLOP/s from one measured attention run."""
    t, heads = int(m["tokens"]), int(m["heads"])
    pairs = t * (t + 1) / 2 if m["density"] == "causal" else float(m["density"]) * t * t
    flops = pairs * heads * attention_fwd_flops_per_pair_head(m["qk_dim"], m["v_dim"])
    return flops * (1.0 + bwd_over_fwd) / float(m["seconds"])


def profile_from_dict(data: dict[str, Any]) -> HardwareProfile:
    if data.get("schema") != SCHEMA:
        raise ValueError(f"hardware profile: schema must be {SCHEMA!r}, got {data.get('schema')!r}")
    src: dict[str, str] = {}
    gpu, att, kda, net = data["gpu"], data["attention"], data["kda"], data["interconnect"]
    bwd = float(_val(att, "backward_over_forward_flops", src, "attention"))
    rates = {}
    for kind in ("causal", "tree"):
        rates[kind] = _attention_rate(att[kind], bwd)
        src[f"attention.{kind}"] = str(att[kind].get("source", "unknown"))
    m = kda["fwd_bwd"]
    src["kda.fwd_bwd"] = str(m.get("source", "unknown"))
    s_per_token_head = 1.0 / (float(m["tokens_per_s"]) * int(m["heads"]))

    def link(prefix: str) -> LinkRates:
        return LinkRates(
            bus_bytes_per_s=float(_val(net, f"{prefix}_bus_bytes_per_s", src, "interconnect")),
            p2p_bytes_per_s=float(_val(net, f"{prefix}_p2p_bytes_per_s", src, "interconnect")),
            all_to_all_bytes_per_s=float(
                _val(net, f"{prefix}_all_to_all_bytes_per_s", src, "interconnect")
            ),
            latency_s=float(_val(net, f"{prefix}_latency_s", src, "interconnect")),
        )

    return HardwareProfile(
        name=str(data["name"]),
        device=str(data.get("device", data["name"])),
        matmul_flops_per_s=float(_val(gpu, "matmul_flops_per_s", src, "gpu")),
        hbm_bytes_per_s=float(_val(gpu, "hbm_bytes_per_s", src, "gpu")),
        hbm_capacity_bytes=int(_val(gpu, "hbm_capacity_bytes", src, "gpu")),
        kernel_launch_s=float(_val(gpu, "kernel_launch_s", src, "gpu")),
        attention_flops_per_s=rates,
        attention_bwd_over_fwd=bwd,
        attention_kernels_fwd=int(_val(att, "kernels_fwd", src, "attention")),
        attention_kernels_bwd=int(_val(att, "kernels_bwd", src, "attention")),
        kda_s_per_token_head=s_per_token_head,
        kda_ref_head_dims=(int(m["head_k_dim"]), int(m["head_v_dim"])),
        kda_fwd_fraction=float(_val(kda, "fwd_fraction", src, "kda")),
        kda_chunk_step_s=float(_val(kda, "chunk_step_s", src, "kda")),
        kda_kernels_fwd=int(_val(kda, "kernels_fwd", src, "kda")),
        kda_kernels_bwd=int(_val(kda, "kernels_bwd", src, "kda")),
        gpus_per_node=int(_val(net, "gpus_per_node", src, "interconnect")),
        intra_node=link("nvlink"),
        inter_node=link("ib"),
        sources=src,
        executor=executor_rates_from_dict(data["executor"], src) if "executor" in data else None,
        host_machines=_host_machines(data.get("host_machines", [])),
    )


def _host_machines(entries: list[Any]) -> tuple[float, ...]:
    """`host_machines`: [{host_s_per_launch, fitted_to}, ...], one per measured machine."""
    out = []
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("host_s_per_launch"), (int, float)) \
                or not e["host_s_per_launch"] > 0 or not e.get("fitted_to"):
            raise ValueError("hardware profile: every host_machines entry must be "
                             "{host_s_per_launch > 0, fitted_to}")
        out.append(float(e["host_s_per_launch"]))
    return tuple(out)


def known_hardware() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


def load_hardware(name_or_path: str | Path = "h200") -> HardwareProfile:
    """A profile by registered name (a file in harts/sim/hardware/) or by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = HARDWARE_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise KeyError(
                f"unknown hardware profile {name_or_path!r}; known: {', '.join(known_hardware())}"
            )
    with path.open() as f:
        return profile_from_dict(json.load(f))


# the shipped profiles measured on a GPU, by a substring of the device's name
_DEVICE_PROFILES = (("H200", "h200"), ("H100", "h100"))


def profile_for_device(name: str) -> str | None:
    """The shipped profile measured on the GPU named `name` (torch.cuda.get_device_name):
    "h100" for an H100, "h200" for an H200, None for any other device."""
    return next((profile for part, profile in _DEVICE_PROFILES if part in name), None)
