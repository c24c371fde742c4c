"""Where two runs' bits part: each op's inputs and outputs compared row by row.

Legend: X expanded positions (trajectory, position) of a microbatch, D model dim.

`fidelity` says how far tree execution drifts from the expanded baseline; this says *where
the drift starts*. Two runs of the same weights over the same microbatches (tree replay,
tree no-replay or expanded, in any pair) are recorded with forward hooks on every op of
the model in execution order (the embedding; per block: attn_norm, mixer, ffn_norm, ffn;
the final norm). A tree row stands for every position that shares it, so each op's input
and output rows are mapped to positions (a tree's `traj_rows`) and compared bitwise.

For each op, over positions: the share whose input differs, whose output differs, and whose
output differs although its input does not: *introduced* there. For a token-wise op
(norms, FFN, MoE) "input" is the position's own row; for a mixer (attention, KDA) it is
every row of the position's trajectory up to it (what the position can see), so an
introduced difference in a mixer is the mixer's own rounding, not inherited. Shares are
also given by handoff depth (forks above the row: 0 = the root's rows, which see no fork).

With deterministic kernels a rerun introduces nothing; a batch-invariant baseline (one whose
per-row bits do not depend on the batch around them) introduces nothing when repacked
either; whatever a tree run introduces at depth 0, where tree and trajectory compute the
same prefix, comes from an op whose bits depend on the call's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from harts.config.kernels import KernelConfig
from harts.exec.model.context import PackedContext
from harts.exec.model.model import HybridModel
from harts.exec.tree import TreeContext
from harts.tree import Trajectory, build_forest

MODES = ("expanded", "replay", "node")


def op_modules(model: HybridModel) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, mixes rows) for every recorded op, in execution order."""
    ops: list[tuple[str, nn.Module, bool]] = [("embed", model.embed, False)]
    for i, block in enumerate(model.layers):
        ops += [(f"layers.{i}.attn_norm", block.attn_norm, False),
                (f"layers.{i}.mixer.{block.mixer_kind.value}", block.mixer, True),
                (f"layers.{i}.ffn_norm", block.ffn_norm, False),
                (f"layers.{i}.ffn.{block.ffn_kind.value}", block.ffn, False)]
    ops.append(("norm", model.norm, False))
    return ops


def _run(model: HybridModel, trajectories: Sequence[Trajectory], members: list[int], mode: str,
         perturb: Callable[[str, torch.Tensor], torch.Tensor] | None,
         kernels: KernelConfig | None = None) -> tuple[dict[str, tuple], np.ndarray]:
    """One microbatch in one mode: per op, (input rows, output rows) in position order
    ([X, ...] each, positions trajectory after trajectory), and each position's depth."""
    device = model.lm_head_weight.device
    if mode == "expanded":
        sizes = [len(trajectories[j]) for j in members]
        offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        ids = np.concatenate([trajectories[j].tokens for j in members])
        ctx = PackedContext(torch.from_numpy(offs), chunk_size=model.config.chunk_size, kernels=kernels).to(device)
        to_positions = None
        depth = np.zeros(int(offs[-1]), np.int64)
    else:
        forest = build_forest([trajectories[j] for j in members])
        ids = forest.token_ids
        ctx = TreeContext(forest, chunk_size=model.config.chunk_size, kda_mode=mode, device=device,
                          kernels=kernels)
        to_positions = torch.from_numpy(forest.traj_rows).to(device)
        depth = forest.node_level[forest.row_node][forest.traj_rows]
    seen: dict[str, tuple] = {}
    hooks = []

    def record(name):
        def hook(module, args, output):
            x = args[0]
            y = output[0] if isinstance(output, tuple) else output
            if perturb is not None:
                y2 = perturb(name, y)
                if y2 is not y:
                    y = y2
                    output = (y2, *output[1:]) if isinstance(output, tuple) else y2
            pick = (lambda t: t) if to_positions is None else (lambda t: t[to_positions])
            xi = None if x.dtype in (torch.int32, torch.int64) else pick(x.detach())
            seen[name] = (xi, pick(y.detach()))
            return output
        return hook

    for name, module, _ in op_modules(model):
        hooks.append(module.register_forward_hook(record(name)))
    try:
        with torch.no_grad():
            model(torch.from_numpy(ids).to(device), ctx)
    finally:
        for h in hooks:
            h.remove()
    return seen, depth


def _rows_differ(a: torch.Tensor | None, b: torch.Tensor | None) -> np.ndarray:
    if a is None or b is None:
        return np.zeros(0 if a is None and b is None else max(x.shape[0] for x in (a, b) if x is not None), bool)
    return (a != b).reshape(a.shape[0], -1).any(dim=1).cpu().numpy()


def _prefix_any(differs: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per position: does any position of its trajectory up to it differ."""
    out = np.empty_like(differs)
    for s, e in zip(starts[:-1], starts[1:], strict=True):
        out[s:e] = np.maximum.accumulate(differs[s:e]) if e > s else differs[s:e]
    return out


def compare_runs(model: HybridModel, trajectories: Sequence[Trajectory], partition: Sequence[Sequence[int]],
                 mode_a: str = "expanded", mode_b: str = "replay", *,
                 perturb_b: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                 kernels: KernelConfig | None = None) -> dict[str, Any]:
    """Run `mode_a` and `mode_b` over the same microbatches; each op's shares (see the
    module doc). `perturb_b(op name, output) -> output` may alter run b's outputs (tests).
    `kernels`: both runs' KernelConfig (default: `KernelConfig.from_env()`)."""
    kernels = kernels if kernels is not None else KernelConfig.from_env()
    for m in (mode_a, mode_b):
        if m not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {m!r}")
    trajectories = list(trajectories)
    names = [(n, mixes) for n, _, mixes in op_modules(model)]
    acc = {n: {"in": 0, "out": 0, "introduced": 0, "introduced_depth0": 0, "max_abs": 0.0} for n, _ in names}
    positions = positions0 = 0
    for members in partition:
        members = list(members)
        a, depth = _run(model, trajectories, members, mode_a, None, kernels)
        b, depth_b = _run(model, trajectories, members, mode_b, perturb_b, kernels)
        depth = np.maximum(depth, depth_b)  # the tree run's depths (expanded: zeros)
        sizes = np.array([len(trajectories[j]) for j in members])
        starts = np.concatenate([[0], np.cumsum(sizes)])
        positions += int(starts[-1])
        positions0 += int((depth == 0).sum())
        for name, mixes in names:
            (xa, ya), (xb, yb) = a[name], b[name]
            din = _rows_differ(xa, xb)
            if din.size == 0:
                din = np.zeros(int(starts[-1]), bool)
            dout = _rows_differ(ya, yb)
            seen = _prefix_any(din, starts) if mixes else din
            intro = dout & ~seen
            r = acc[name]
            r["in"] += int(din.sum())
            r["out"] += int(dout.sum())
            r["introduced"] += int(intro.sum())
            r["introduced_depth0"] += int((intro & (depth == 0)).sum())
            if dout.any():
                r["max_abs"] = max(r["max_abs"], float((ya.float() - yb.float()).abs().max()))
    ops = []
    for name, mixes in names:
        r = acc[name]
        ops.append({"op": name, "mixes_rows": mixes,
                    "input_differs": r["in"] / max(positions, 1), "output_differs": r["out"] / max(positions, 1),
                    "introduced": r["introduced"] / max(positions, 1),
                    "introduced_depth0": r["introduced_depth0"] / max(positions0, 1),
                    "max_abs_diff": r["max_abs"]})
    first = next((o["op"] for o in ops if o["introduced"] > 0), None)
    return {"mode_a": mode_a, "mode_b": mode_b, "positions": positions, "positions_depth0": positions0,
            "first_introduced": first, "ops": ops}


def format_table(report: dict[str, Any]) -> str:
    """The ops where anything differs, as a readable table."""
    lines = [f"{report['mode_b']} vs {report['mode_a']}: {report['positions']} positions "
             f"({report['positions_depth0']} at depth 0); first op introducing a difference: "
             f"{report['first_introduced']}",
             f"{'op':34s} {'in differs':>11s} {'out differs':>12s} {'introduced':>11s} {'intro d0':>9s} {'max |d|':>9s}"]
    for o in report["ops"]:
        if o["output_differs"] or o["input_differs"]:
            lines.append(f"{o['op']:34s} {o['input_differs']:11.4f} {o['output_differs']:12.4f} "
                         f"{o['introduced']:11.4f} {o['introduced_depth0']:9.4f} {o['max_abs_diff']:9.2e}")
    return "\n".join(lines)
