"""Shared machinery of the GPU benchmark suites (`benchmarks/gpu/<topic>.py`).

Each suite is a script with named sections:

    python3 benchmarks/gpu/<topic>.py [SECTION...] [--out DIR] [options]

`run_suite` parses the common options, runs the chosen sections (all by default), records
an exception in a section's JSON instead of stopping the others, writes
DIR/<topic>_<section>.json with the result and its provenance (git revision, exact
command, package versions, GPU, date), and prints a short table last.

Timing is `time_cuda`: CUDA events around each call, warm-up calls first, the median of the
repeats. Kernel choices are a `harts.config.kernels.KernelConfig` built from the suite's
flags (`add_kernel_args`, `kernel_config`) and handed explicitly to what a section calls;
`run_suite` puts the suite's config on `args.kernels` and records its `to_dict()` in every
result's provenance ("kernels"). Nothing here writes the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harts.bench.timing import time_cuda  # noqa: F401  (the suites time through common; one helper)
from harts.config.kernels import BaselineAttention, ConvKernel, KernelConfig, TreeAttention

ROOT = Path(__file__).resolve().parents[2]
RESULT_SCHEMA = "harts.bench.gpu/v1"

# suite flag (argparse dest) -> (KernelConfig field, choices or None, help)
KERNEL_FLAGS: dict[str, tuple[str, tuple[str, ...] | None, str]] = {
    "tree_attention": ("tree_attention", tuple(e.value for e in TreeAttention),
                       "tree mode's bf16 attention on CUDA (auto: graph where its self-check passes, else "
                       "per-segment cuDNN or varlen flash)"),
    "baseline_attention": ("baseline_attention", tuple(e.value for e in BaselineAttention),
                           "the expanded baseline's attention on CUDA (graph: the tree's cuDNN graph kernel)"),
    "conv": ("conv", tuple(e.value for e in ConvKernel), "the short conv (reference: the gather-form reference)"),
    "fwd_h": ("kda_fwd_h", None, "fla's forward state launch: auto, fla (fla's own) or BV,warps,stages"),
}


def add_kernel_args(ap: argparse.ArgumentParser, *flags: str) -> None:
    """--tree-attention / --baseline-attention / --conv / --fwd-h (keys of KERNEL_FLAGS);
    left out, a choice keeps `kernel_config`'s base."""
    for dest in flags:
        fld, choices, doc = KERNEL_FLAGS[dest]
        ap.add_argument("--" + dest.replace("_", "-"), dest=dest, default=None, choices=choices,
                        help=f"{doc} (KernelConfig.{fld}; default: the HARTS_* environment's, else the library's)")


def kernel_config(base: KernelConfig | None = None, **choices: Any) -> KernelConfig:
    """`base` (default `KernelConfig.from_env()`: the HARTS_* variables, else the library's
    defaults) with `choices` (KernelConfig field names) on top; a None choice keeps the
    base's, "default" takes the library's default. Unknown names and invalid values fail
    loudly (KeyError, ValueError)."""
    fields = {f.name: f for f in dataclasses.fields(KernelConfig)}
    unknown = sorted(set(choices) - set(fields))
    if unknown:
        raise KeyError(f"unknown kernel choice(s) {unknown}; known: {sorted(fields)}")
    base = KernelConfig.from_env() if base is None else base
    changes = {k: (fields[k].default if v == "default" else v) for k, v in choices.items() if v is not None}
    return base.replace(**changes) if changes else base


def args_kernels(args: argparse.Namespace) -> KernelConfig:
    """The suite's config: `kernel_config` with the kernel flags the suite has (KERNEL_FLAGS)."""
    return kernel_config(**{fld: getattr(args, dest) for dest, (fld, _, _) in KERNEL_FLAGS.items()
                            if hasattr(args, dest)})


# ---------------------------------------------------------------------------- timing


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of a against b (in float64); inf if a has a non-finite entry."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("inf")


# ----------------------------------------------------------------- tree layouts


def parents_from_ends(end_np: np.ndarray) -> np.ndarray:
    """Local parents from DFS subtree ends: each row's nearest earlier row whose subtree covers it."""
    parent = np.full(end_np.size, -1, np.int64)
    stack: list[int] = []
    for r in range(end_np.size):
        while stack and end_np[stack[-1]] < r:
            stack.pop()
        parent[r] = stack[-1] if stack else -1
        stack.append(r)
    return parent


def ends_from_parents(par: np.ndarray) -> np.ndarray:
    """The last row of each row's subtree (DFS order), from the parents (inverse of
    `parents_from_ends`)."""
    end = np.arange(par.size, dtype=np.int64)
    for r in range(par.size - 1, 0, -1):
        p = par[r]
        if p >= 0 and end[r] > end[p]:
            end[p] = end[r]
    return end


# ------------------------------------------------------------------- provenance


# provenance is the library's (harts.bench.provenance), shared with `harts bench --out`; the
# suites add the environment variables that change kernel numerics or the device seen
from harts.bench.provenance import PACKAGES, device_info, package_versions  # noqa: E402,F401
from harts.bench.provenance import provenance as _provenance  # noqa: E402


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """`harts.bench.provenance.provenance` plus TRITON_F32_DEFAULT / CUDA_VISIBLE_DEVICES where set."""
    return {**_provenance(argv),
            "env": {k: os.environ[k] for k in ("TRITON_F32_DEFAULT", "CUDA_VISIBLE_DEVICES") if k in os.environ}}


def _jsonable(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def write_result(out_dir: Path, name: str, result: Any, prov: Mapping[str, Any], **extra: Any) -> Path:
    """DIR/<name>.json: {schema, name, provenance, result, ...extra}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    doc = {"schema": RESULT_SCHEMA, "name": name, "provenance": dict(prov), **extra, "result": result}
    path.write_text(json.dumps(doc, indent=1, default=_jsonable))
    return path


# ------------------------------------------------------------------------ suites


@dataclass(frozen=True)
class Section:
    """One named measurement of a suite: fn(args) -> a JSON-able result; `summary` turns the
    result into short table rows ((label, value) pairs) printed at the end."""

    name: str
    fn: Callable[[argparse.Namespace], Any]
    doc: str
    summary: Callable[[Any], list[tuple[str, str]]] | None = None
    default: bool = True


@dataclass
class SuiteContext:
    """What a section may use besides its arguments: the output folder and `save`, which
    writes an extra JSON next to the section's (e.g. a profile for `harts sim fit`)."""

    out: Path
    topic: str
    prov: dict[str, Any] = field(default_factory=dict)

    def save(self, name: str, obj: Any) -> Path:
        return write_result(self.out, f"{self.topic}_{name}", obj, self.prov)

    def save_raw(self, name: str, obj: dict[str, Any]) -> Path:
        """DIR/<name>.json in the object's own schema (e.g. harts.sim.profile/v1, read by
        `harts sim fit`), with the provenance added as one more key."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{name}.json"
        path.write_text(json.dumps({**obj, "provenance": self.prov}, indent=1, default=_jsonable))
        return path


CTX: SuiteContext | None = None


def ctx() -> SuiteContext:
    if CTX is None:
        raise RuntimeError("no suite is running (call run_suite)")
    return CTX


def no_autotune() -> None:
    """Each Triton autotuner takes the first of its configs that compiles and runs, untimed
    (correctness runs and step timings that do not depend on the tuned configs: saves
    minutes of tuning). The first config is tried once (one run, not a timing loop); if it
    does not fit the GPU (`OutOfResources`, which the autotuner turns into an infinite
    time: a float32 call of a kernel whose first config is sized for bf16 tiles), the next,
    and so on; configs after the first that fits are neither compiled nor run. Where the
    first config fits (the bf16 calls of the suites until now) it is the one taken, as before."""
    import math

    import triton.runtime.autotuner as autotuner

    if getattr(autotuner.Autotuner, "_harts_first_fit", False):
        return
    bench = autotuner.Autotuner._bench
    skip = [math.inf] * 3

    def run_once(kernel_call, quantiles=None, **_):
        kernel_call()
        return [0.0, 0.0, 0.0]

    def first_fit(self, *args, config, **meta):
        seen = self.__dict__.setdefault("_harts_seen", set())
        if id(config) in seen:  # a config met again: a new key's round of configs
            seen.clear()
            self._harts_found = False
        seen.add(id(config))
        if self.__dict__.get("_harts_found"):
            return skip
        # the autotuner times through `do_bench` (a cached property over `_do_bench` in
        # the triton versions read): both set on the instance for this one call
        d = self.__dict__
        saved = {k: d[k] for k in ("do_bench", "_do_bench") if k in d}
        d["do_bench"] = d["_do_bench"] = run_once
        try:
            result = bench(self, *args, config=config, **meta)
        finally:
            d.pop("do_bench", None)
            d.pop("_do_bench", None)
            d.update(saved)
        self._harts_found = not math.isinf(result[0])
        return result

    autotuner.Autotuner._bench = first_fit
    autotuner.Autotuner._harts_first_fit = True


def base_parser(topic: str, sections: Mapping[str, Section], description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"benchmarks/gpu/{topic}.py", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="sections:\n" + "\n".join(
                                     f"  {s.name:12s} {s.doc}{'' if s.default else ' (not run by default)'}"
                                     for s in sections.values()))
    ap.add_argument("sections", nargs="*", metavar="SECTION",
                    help=f"sections to run (default: {' '.join(n for n, s in sections.items() if s.default)})")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON results")
    ap.add_argument("--no-autotune", action="store_true",
                    help="take each Triton kernel's first config that fits (saves minutes of tuning)")
    return ap


def run_suite(topic: str, sections: list[Section], description: str,
              add_args: Callable[[argparse.ArgumentParser], None] | None = None,
              argv: list[str] | None = None) -> int:
    """Parse the suite's command line, run its sections, write one JSON per section, print
    a table of the sections' summaries last. Returns 1 if any section failed, else 0."""
    global CTX
    by_name = {s.name: s for s in sections}
    ap = base_parser(topic, by_name, description)
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args(argv)
    chosen = args.sections or [n for n, s in by_name.items() if s.default]
    unknown = [n for n in chosen if n not in by_name]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; {topic} has {sorted(by_name)}")
    try:
        args.kernels = args_kernels(args)
    except (KeyError, ValueError) as err:
        ap.error(str(err))
    if not torch.cuda.is_available():
        ap.error("these benchmarks need a CUDA device")
    if args.no_autotune:
        no_autotune()
    import torch._dynamo as dynamo

    # kernel-option variants and grad modes each compile FlexAttention once; past the
    # default limit (8) dynamo falls back to eager flex, which materialises dense scores
    dynamo.config.recompile_limit = 64
    out = Path(args.out)
    prov = provenance(argv)
    prov["options"] = {k: v for k, v in vars(args).items() if k not in ("sections", "out", "kernels")}
    prov["kernels"] = args.kernels.to_dict()
    CTX = SuiteContext(out=out, topic=topic, prov=prov)
    table: list[tuple[str, str, str]] = []
    failed = False
    for name in chosen:
        sec = by_name[name]
        t0 = time.perf_counter()
        try:
            res = sec.fn(args)
            status = "ok"
        except Exception as err:  # noqa: BLE001 - record and go on to the next section
            res = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
            status = "ERROR " + res["error"][:200]
            failed = True
        secs = time.perf_counter() - t0
        write_result(out, f"{topic}_{name}", res, prov, section=name, seconds=round(secs, 2), status=status)
        print(f"=== {topic} {name}: {status} ({secs:.1f}s)", flush=True)
        if status == "ok" and sec.summary is not None:
            try:
                table += [(name, k, v) for k, v in sec.summary(res)]
            except Exception as err:  # noqa: BLE001 - a summary is never worth losing the result
                table.append((name, "summary", f"{type(err).__name__}: {err}"[:80]))
        elif status != "ok":
            table.append((name, "error", status[6:86]))
    print_table(topic, table)
    return 1 if failed else 0


def print_table(topic: str, rows: list[tuple[str, str, str]]) -> None:
    if not rows:
        return
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n{topic}:")
    for a, b, c in rows:
        print(f"  {a:<{w0}}  {b:<{w1}}  {c}")
    sys.stdout.flush()


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"
