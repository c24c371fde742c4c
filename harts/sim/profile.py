"""Measured per-op profiles and the least-squares fit behind the calibrated cost model.

The GPU backend times kernels on a named device and writes a profile, JSON or CSV:

JSON (``schema: harts.sim.profile/v1``)::

    {"schema": "harts.sim.profile/v1", "device": "NVIDIA H200", "source": "...",
     "measurements": [
       {"op": "gemm", "phase": "fwd", "seconds": 1.1e-3, "m": 32768, "k": 1536, "n": 4864},
       {"op": "kda_chunk", "phase": "bwd", "seconds": 4.0e-3, "tokens": 32768, "heads": 16,
        "head_k_dim": 128, "head_v_dim": 128, "max_chunks": 512},
       {"op": "attention_tree", "phase": "fwd", "seconds": 2e-2, "pairs": 2.9e8, "heads": 16,
        "qk_dim": 192, "v_dim": 128},
       {"op": "all_to_all", "phase": "fwd", "seconds": 3e-4, "comm_bytes": 5e7, "spans_nodes": false},
       ...]}

CSV: one measurement a row, a header naming the same fields (empty cells = absent).

Each row is either in raw shape fields (tokens, heads, pairs, m/k/n: what a benchmark knows)
or directly in the model's features (flops, bytes, token_heads_kv, ...: what `OpCall`
carries); `measurement_features` maps raw fields to features. `op` is an `OpKind` value,
`phase` one of fwd / bwd / step, `calls` (default 1) the kernel launches the timing covers.
An optimizer row that states `params` is counted in the model's own bytes per parameter
(`ops.ADAM_BYTES_PER_PARAM`), whatever `bytes` the benchmark wrote, so that the row and the
simulated optimizer op are in the same units.

The fit: per (op, phase[, inter-node]) a linear model seconds = sum_j c_j * feature_j with
c_j >= 0 (per-call overhead, per FLOP, per byte, per chunk step, ...), found by
non-negative least squares on relative residuals, so a 10 us kernel and a 10 ms kernel
count alike. A key with fewer rows than features cannot separate a per-call term from the
size terms (one row fits either exactly): it is fitted on its size features only, the
per-call coefficient held at 0.

`fit_kda_from_kernels` is the one fit made from a measured step rather than from kernel
rows: the chunkwise KDA calls of a step run 1-3 sequences each, so the chunk-state
recurrence (one CTA per sequence, head and value block, walking its chunks in order) is
bound by its sequential chunk steps, a regime the isolated, many-sequence calib rows never
reach (there chunk steps and tokens grow together and cannot be told apart).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harts.sim.hardware import attention_fwd_flops_per_pair_head
from harts.sim.ops import ADAM_BYTES_PER_PARAM, OpCall, OpKind, Phase

__all__ = [
    "CALIBRATION_SCHEMA",
    "FEATURES",
    "PROFILE_SCHEMA",
    "Calibration",
    "FitResult",
    "Measurement",
    "fit_kda_from_kernels",
    "fit_profile",
    "kda_kernel_role",
    "load_calibration",
    "load_profile",
    "measurement_features",
    "op_features",
    "op_key",
    "save_profile",
]

PROFILE_SCHEMA = "harts.sim.profile/v1"
CALIBRATION_SCHEMA = "harts.sim.calibration/v1"

FEATURES: dict[OpKind, tuple[str, ...]] = {
    OpKind.GEMM: ("calls", "flops", "bytes"),
    OpKind.ELEMENTWISE: ("calls", "bytes"),
    OpKind.ATTENTION_CAUSAL: ("calls", "attn_flops"),
    OpKind.ATTENTION_TREE: ("calls", "attn_flops"),
    OpKind.KDA_CHUNK: ("calls", "token_heads_kv", "chunk_steps"),
    OpKind.ALL_TO_ALL: ("calls", "comm_bytes"),
    OpKind.P2P: ("calls", "comm_bytes"),
    OpKind.REDUCE_SCATTER: ("calls", "comm_bytes"),
    OpKind.ALL_GATHER: ("calls", "comm_bytes"),
    OpKind.OPTIMIZER: ("calls", "bytes"),
}
_COMM = {OpKind.ALL_TO_ALL, OpKind.P2P, OpKind.REDUCE_SCATTER, OpKind.ALL_GATHER}


def op_key(kind: OpKind | str, phase: Phase | str, spans_nodes: bool = False) -> str:
    kind = OpKind(kind)
    suffix = ":inter" if kind in _COMM and spans_nodes else ""
    return f"{kind.value}:{Phase(phase).value}{suffix}"


def op_features(op: OpCall) -> dict[str, float]:
    return {
        "calls": float(op.calls),
        "flops": op.flops,
        "bytes": op.bytes,
        "attn_flops": op.pair_heads * 2.0 * op.qk_v_dim,
        "token_heads_kv": op.token_heads_kv,
        "chunk_steps": op.chunk_steps,
        "comm_bytes": op.comm_bytes,
    }


@dataclass(frozen=True)
class Measurement:
    op: OpKind
    phase: Phase
    seconds: float
    features: dict[str, float]
    spans_nodes: bool = False

    @property
    def key(self) -> str:
        return op_key(self.op, self.phase, self.spans_nodes)


def _num(row: Mapping[str, Any], name: str) -> float | None:
    v = row.get(name)
    if v is None or v == "":
        return None
    return float(v)


def measurement_features(row: Mapping[str, Any]) -> Measurement:
    """One profile row (raw shape fields or features) -> features; raises ValueError."""
    try:
        kind = OpKind(row["op"])
        phase = Phase(row["phase"])
    except (KeyError, ValueError) as err:
        raise ValueError(f"profile row {dict(row)!r}: needs a known 'op' and 'phase'") from err
    seconds = _num(row, "seconds")
    if seconds is None or not seconds > 0:
        raise ValueError(f"profile row {dict(row)!r}: 'seconds' must be > 0")
    f: dict[str, float] = {"calls": _num(row, "calls") or 1.0}
    for name in ("flops", "bytes", "attn_flops", "token_heads_kv", "chunk_steps", "comm_bytes"):
        v = _num(row, name)
        if v is not None:
            f[name] = v
    m, k, n = _num(row, "m"), _num(row, "k"), _num(row, "n")
    if kind == OpKind.GEMM and None not in (m, k, n):
        f.setdefault("flops", 2.0 * m * k * n)
        f.setdefault("bytes", 2.0 * (m * k + k * n + m * n))
    tokens, heads = _num(row, "tokens"), _num(row, "heads")
    if kind == OpKind.KDA_CHUNK and tokens is not None and heads is not None:
        kd, vd = _num(row, "head_k_dim") or 128.0, _num(row, "head_v_dim") or 128.0
        f.setdefault("token_heads_kv", tokens * heads * kd * vd)
        if _num(row, "max_chunks") is not None:
            f.setdefault("chunk_steps", _num(row, "max_chunks"))
    if kind == OpKind.OPTIMIZER and _num(row, "params") is not None:
        f["bytes"] = _num(row, "params") * ADAM_BYTES_PER_PARAM
    pairs = _num(row, "pairs")
    if kind in (OpKind.ATTENTION_CAUSAL, OpKind.ATTENTION_TREE) and pairs is not None and heads:
        qk, vd = _num(row, "qk_dim") or 192.0, _num(row, "v_dim") or 128.0
        f.setdefault("attn_flops", pairs * heads * attention_fwd_flops_per_pair_head(qk, vd))
    missing = [name for name in FEATURES[kind] if name not in f]
    if missing:
        raise ValueError(f"profile row {dict(row)!r}: {kind.value} needs {', '.join(missing)}")
    spans = row.get("spans_nodes", False)
    spans = spans.lower() in ("1", "true", "yes") if isinstance(spans, str) else bool(spans)
    return Measurement(kind, phase, seconds, f, spans)


def load_profile(path: str | Path) -> tuple[dict[str, Any], list[Measurement]]:
    """(header: device/source/..., measurements) of a JSON or CSV profile."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        with path.open(newline="") as fh:
            rows = list(csv.DictReader(fh))
        header: dict[str, Any] = {"schema": PROFILE_SCHEMA, "device": rows[0].get("device", "") if rows else ""}
    else:
        data = json.loads(path.read_text())
        if data.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"{path}: schema must be {PROFILE_SCHEMA!r}, got {data.get('schema')!r}")
        rows = data.get("measurements", [])
        header = {k: v for k, v in data.items() if k != "measurements"}
    if not rows:
        raise ValueError(f"{path}: no measurements")
    return header, [measurement_features(r) for r in rows]


def save_profile(path: str | Path, device: str, rows: Iterable[Mapping[str, Any]], **header: Any) -> None:
    rows = [dict(r) for r in rows]
    path = Path(path)
    if path.suffix.lower() == ".csv":
        fields = sorted({k for r in rows for k in r} | {"device"})
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=fields)
            w.writeheader()
            for r in rows:
                w.writerow({"device": device, **r})
        return
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "device": device, **header, "measurements": rows}, indent=1))


@dataclass(frozen=True)
class FitResult:
    features: tuple[str, ...]
    coefficients: tuple[float, ...]
    rows: int
    rel_rms: float  # relative RMS residual of the fit on its own rows

    def predict(self, features: Mapping[str, float]) -> float:
        return float(sum(c * features.get(name, 0.0) for name, c in zip(self.features, self.coefficients, strict=True)))


@dataclass(frozen=True)
class Calibration:
    device: str
    fits: dict[str, FitResult]  # op_key -> fit
    # Elementwise ops are modelled as ideally fused passes over their tensors; an eager
    # framework runs several kernels per pass. This factor (1 = ideal) scales every
    # elementwise op's time; it is fitted to one measured step's elementwise share
    # (benchmarks/sim_vs_h200.py --fit-elementwise), never to kernel microbenchmarks.
    elementwise_scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        d = {
            "schema": CALIBRATION_SCHEMA,
            "device": self.device,
            "fits": {
                k: {"features": list(f.features), "coefficients": list(f.coefficients), "rows": f.rows,
                    "rel_rms": f.rel_rms}
                for k, f in sorted(self.fits.items())
            },
        }
        if self.elementwise_scale != 1.0:
            d["elementwise_scale"] = self.elementwise_scale
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))


def load_calibration(path: str | Path) -> Calibration:
    data = json.loads(Path(path).read_text())
    if data.get("schema") != CALIBRATION_SCHEMA:
        raise ValueError(f"{path}: schema must be {CALIBRATION_SCHEMA!r}")
    fits = {
        k: FitResult(tuple(v["features"]), tuple(float(c) for c in v["coefficients"]), int(v["rows"]),
                     float(v["rel_rms"]))
        for k, v in data["fits"].items()
    }
    scale = float(data.get("elementwise_scale", 1.0))
    if not scale > 0:
        raise ValueError(f"{path}: elementwise_scale must be > 0, got {scale}")
    return Calibration(str(data.get("device", "")), fits, scale)


def fit_profile(measurements: Iterable[Measurement], device: str = "") -> Calibration:
    """Non-negative least squares per op key on relative residuals."""
    by_key: dict[str, list[Measurement]] = {}
    for m in measurements:
        by_key.setdefault(m.key, []).append(m)
    fits: dict[str, FitResult] = {}
    for key, ms in sorted(by_key.items()):
        names = FEATURES[ms[0].op]
        X = np.array([[m.features.get(n, 0.0) for n in names] for m in ms], dtype=np.float64)
        y = np.array([m.seconds for m in ms], dtype=np.float64)
        # under-determined (fewer rows than features): the size features only
        cols = [j for j, n in enumerate(names) if len(ms) >= len(names) or n != "calls"]
        # columns scaled to unit max so NNLS is well conditioned across 1e0..1e15 features
        scale = np.abs(X[:, cols]).max(axis=0)
        scale[scale == 0] = 1.0
        A = (X[:, cols] / scale) / y[:, None]
        # imported here, not at the top: scipy.optimize takes ~0.7 s to import, which every
        # `harts` command (its parser imports harts.sim) would pay without fitting anything
        from scipy.optimize import nnls

        sub, _ = nnls(A, np.ones_like(y))
        coef = np.zeros(len(names))
        coef[cols] = sub / scale
        pred = X @ coef
        rel = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
        fits[key] = FitResult(names, tuple(float(c) for c in coef), len(ms), rel)
    return Calibration(device, fits)


_RECURRENCE = re.compile(r"kernel_h(_|$)|dhu")


def kda_kernel_role(name: str) -> tuple[Phase, bool]:
    """(phase, recurrence) of one chunkwise-KDA kernel by its name: kernels named `bwd` run in
    the backward, the others are forward kernels (which the backward may rerun: fla's
    backward recomputes w/u and the chunk states); `recurrence` marks the chunk-state
    kernels that walk a sequence's chunks in order (fla's `..._fwd_kernel_h*` and
    `..._bwd_kernel_dhu*`, harts's `_bwd_dhu_inject_kernel`), every other kernel being
    parallel over chunks."""
    k = name.lower()
    return (Phase.BWD if "bwd" in k else Phase.FWD), bool(_RECURRENCE.search(k))


def fit_kda_from_kernels(kernels: Iterable[tuple[str, float, int]], calls_per_pass: int,
                         token_heads_kv_per_pass: float, chunk_steps_per_pass: float,
                         forward_passes: int = 2) -> dict[str, FitResult]:
    """KDA coefficients from one measured step's KDA kernels: `kernels` are (name, seconds,
    launches) summed over the step, and the step ran `calls_per_pass` KDA calls per pass
    (layers x rounds x microbatches) carrying `token_heads_kv_per_pass` and
    `chunk_steps_per_pass` (the simulator's features of those calls), `forward_passes`
    forwards per backward (2 with recomputation). A forward kernel's launches beyond
    `forward_passes * calls_per_pass` ran inside the backward and are charged to it.

    Per phase: per token-head-K-V = the parallel kernels' seconds / token_heads_kv, per chunk
    step = the recurrence kernels' seconds / chunk steps, no per-call term (the step's
    kernels run back to back; kernel time has no host latency). Returns fits for
    `kda_chunk:fwd` and `kda_chunk:bwd` (features calls, token_heads_kv, chunk_steps)."""
    if calls_per_pass <= 0 or token_heads_kv_per_pass <= 0 or chunk_steps_per_pass <= 0 or forward_passes < 1:
        raise ValueError("fit_kda_from_kernels: the step's KDA calls, tokens and chunk steps must be > 0")
    secs = {(ph, rec): 0.0 for ph in (Phase.FWD, Phase.BWD) for rec in (False, True)}
    used = 0
    fwd_launches = forward_passes * calls_per_pass
    for name, seconds, launches in kernels:
        phase, rec = kda_kernel_role(name)
        used += 1
        if phase == Phase.BWD or launches <= fwd_launches:
            secs[(phase, rec)] += seconds
            continue
        secs[(Phase.FWD, rec)] += seconds * fwd_launches / launches
        secs[(Phase.BWD, rec)] += seconds * (launches - fwd_launches) / launches
    names = FEATURES[OpKind.KDA_CHUNK]
    out = {}
    for phase, passes in ((Phase.FWD, forward_passes), (Phase.BWD, 1)):
        coef = {"calls": 0.0, "token_heads_kv": secs[(phase, False)] / (passes * token_heads_kv_per_pass),
                "chunk_steps": secs[(phase, True)] / (passes * chunk_steps_per_pass)}
        out[op_key(OpKind.KDA_CHUNK, phase)] = FitResult(names, tuple(coef[n] for n in names), used, 0.0)
    return out
