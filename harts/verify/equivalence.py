"""Tree vs expanded: the proof that a tree step is the training the user meant.

Both trainers start from identical weights, see the same trajectories in the same
microbatches (whole trees), and run one forward/backward. We compare every per-target
log-prob and entropy, each loss term, the expert loads and every parameter gradient, and
report max and RMS relative errors:

    max_rel(a, b) = max|a - b| / max|b|        rms_rel(a, b) = ||a - b|| / ||b||

(normwise, so a tolerance means the same for any size; gradients per parameter tensor,
the worst tensor reported). The no-replay ablation reruns the tree side with every node
as its own linear-attention sequence (mid-chunk starts, no replay) to show what replay
buys; and the layer check feeds the first linear-attention layer's real inputs (KDA, or
Gated DeltaNet, which runs the same chunkwise recurrence) through the tree path and the
per-trajectory chunkwise path to see whether they agree bit for bit. The report names
the kinds (`linear_attention`: "KDA", "GDN"; `kda_layer_kind`: the checked layer's).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from harts.config.kernels import KernelConfig
from harts.config.models import (
    LAYER_KIND_LABEL,
    LINEAR_ATTENTION_KINDS,
    ModelConfig,
    get_model_config,
    linear_attention_label,
)
from harts.exec.factory import make_trainer
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import HybridModel, build_model
from harts.exec.trainer import ExpandedTrainer, StepResult
from harts.tree import Trajectory, build_forest


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    scale = np.abs(b).max() if b.size else 0.0
    diff = np.abs(a - b).max() if a.size else 0.0
    return float(diff / scale) if scale > 0 else (0.0 if diff == 0 else float("inf"))


def rms_rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    nb = np.linalg.norm(b)
    nd = np.linalg.norm(a - b)
    return float(nd / nb) if nb > 0 else (0.0 if nd == 0 else float("inf"))


def _flat(result: StepResult, field: str) -> np.ndarray:
    # position 0 has no target (NaN): drop it
    return np.concatenate([x[1:] for x in getattr(result, field)]) if getattr(result, field) else np.zeros(0)


def _max_rel_t(a: torch.Tensor, b: torch.Tensor) -> float:
    """`max_rel` on finite tensors, where they are (float64)."""
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _grad_errors(ref_model: HybridModel, got_model: HybridModel) -> tuple[dict[str, float], float]:
    """Per-parameter max relative error of got's gradients against ref's (`max_rel`), and
    the relative error of all of them as one vector (`rms_rel`), one parameter at a time in
    float64 on the models' device: no host copy of a model's gradients (a 1.3B-parameter
    model's were 10 GB of float64 per copy, minutes of numpy per comparison)."""
    got = dict(got_model.named_parameters())
    per_param: dict[str, float] = {}
    num = den = 0.0
    finite = True
    for name, p in ref_model.named_parameters():
        q = got[name]
        b = p.grad.detach().double() if p.grad is not None else torch.zeros(p.shape, dtype=torch.float64,
                                                                            device=p.device)
        a = q.grad.detach().double() if q.grad is not None else torch.zeros(q.shape, dtype=torch.float64,
                                                                            device=q.device)
        ok = bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())
        finite = finite and ok
        per_param[name] = _max_rel_t(a, b) if ok else float("inf")
        if ok:
            num += float(((a - b) ** 2).sum())
            den += float((b ** 2).sum())
    nd, nb = math.sqrt(num), math.sqrt(den)
    rms = float("inf") if not finite else (nd / nb if nb > 0 else (0.0 if nd == 0 else float("inf")))
    return per_param, rms


def compare_steps(ref: StepResult, ref_model: HybridModel, got: StepResult, got_model: HybridModel) -> dict[str, Any]:
    lp_ref, lp_got = _flat(ref, "logprobs"), _flat(got, "logprobs")
    ent_ref, ent_got = _flat(ref, "entropy"), _flat(got, "entropy")
    per_param, rms_grad = _grad_errors(ref_model, got_model)
    worst = sorted(per_param.items(), key=lambda kv: -kv[1])[:5]
    return {
        "max_rel_logprob_err": max_rel(lp_got, lp_ref),
        "rms_rel_logprob_err": rms_rel(lp_got, lp_ref),
        "max_abs_logprob_err": float(np.abs(lp_got - lp_ref).max()) if lp_ref.size else 0.0,
        "max_rel_entropy_err": max_rel(ent_got, ent_ref),
        "max_rel_grad_err": max(per_param.values()) if per_param else 0.0,
        "rms_rel_grad_err": rms_grad,
        "worst_grad_params": [{"param": n, "max_rel_err": e} for n, e in worst],
        "loss_abs_err": {k: abs(got.losses[k] - ref.losses[k]) for k in ref.losses},
        "max_rel_expert_load_err": max_rel(got.expert_load, ref.expert_load) if ref.expert_load is not None else 0.0,
    }


class _CaptureKDA:
    """Wraps a MixingContext and keeps the inputs of the first KDA call."""

    kda_mixing = None  # the plain path (short convs, then `kda`), so that `kda` sees the inputs

    def __init__(self, inner: Any):
        self.inner = inner
        self.captured: tuple | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def kda(self, layer, q, k, v, g, beta, scale):
        if self.captured is None:
            self.captured = tuple(x.detach().clone() for x in (q, k, v, g, beta)) + (scale,)
        return self.inner.kda(layer, q, k, v, g, beta, scale)


def kda_layer_check(model: HybridModel, trajectories: Sequence[Trajectory],
                    kernels: KernelConfig | None = None) -> dict[str, Any] | None:
    """First linear-attention layer (KDA or GDN: both run `ctx.kda`) on its real inputs:
    tree (replay / no replay) vs per-trajectory."""
    kernels = kernels if kernels is not None else KernelConfig.from_env()
    from harts.exec.backend import chunk_kda
    from harts.exec.tree import TreeContext

    forest = build_forest(trajectories)
    device = model.lm_head_weight.device
    B = model.config.chunk_size
    cap = _CaptureKDA(TreeContext(forest, chunk_size=B, device=device, kernels=kernels))
    with torch.no_grad():
        model(torch.from_numpy(forest.token_ids).to(device), cap)
        if cap.captured is None:
            return None
        q, k, v, g, beta, scale = cap.captured
        rows = torch.from_numpy(forest.traj_rows).to(device)
        cu = torch.from_numpy(forest.traj_offsets).to(device)
        o_exp = chunk_kda(q[rows], k[rows], v[rows], g[rows], beta[rows], scale=scale, cu_seqlens=cu,
                          chunk_size=B, output_final_state=False, kernels=kernels).o
        out: dict[str, Any] = {}
        for mode in ("replay", "node"):
            ctx = TreeContext(forest, chunk_size=B, kda_mode=mode, device=device, kernels=kernels)
            o_tree = ctx.kda(0, q, k, v, g, beta, scale)[rows]
            d = (o_tree - o_exp).abs()
            out[mode] = {
                "bit_identical": bool(torch.equal(o_tree, o_exp)),
                "max_abs_err": float(d.max()),
                "rms_rel_err": rms_rel(o_tree.double().cpu().numpy(), o_exp.double().cpu().numpy()),
                "rows_differing": float((d.flatten(1).amax(1) > 0).double().mean()),
            }
        return out


def verify_step(
    trajectories: Sequence[Trajectory],
    *,
    model: str | ModelConfig | HybridModel = "tiny-cpu",
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    microbatch_tokens: int = 1 << 20,
    planner: str | None = None,
    loss: PolicyLossConfig | None = None,
    device: str = "cpu",
    recompute_old_logprobs: bool = True,
    no_replay: bool = True,
    baseline_variation: bool = False,
    kernels: KernelConfig | None = None,
) -> dict[str, Any]:
    """One forward/backward in both modes from identical weights; the comparison report.

    `model`: a registered name or a ModelConfig (weights initialised from `seed`), or a
    HybridModel whose weights every run copies (a loaded checkpoint, `harts.models.load`).

    `baseline_variation` (for bf16, where no run is exact): also the expanded baseline
    against a rerun of itself and against itself repacked one trajectory per microbatch
    (another equally valid batch composition; reported only where the MoE aux loss does
    not depend on the packing: a planner's global scope, or no aux term), the variation
    the tree's differences are read against.

    Without a planner the tree side holds whole trees per microbatch (packed under the
    budget) and the expanded reference uses the same partition. With a planner the tree
    side executes that planner's Plan (trees split across microbatches, sharing windows),
    and the MoE aux loss switches to the step-global scope on both sides, the one scope
    under which the aux term does not depend on the split.

    Every run uses `kernels` (default: `KernelConfig.from_env()`, built once here).
    """
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan

    if loss is None:
        has_ref = all(t.ref_logprobs is not None for t in trajectories)
        loss = PolicyLossConfig(kl_coef=0.1 if has_ref else 0.0)
    source = model if isinstance(model, HybridModel) else None
    if source is not None:
        config = source.config
    else:
        config = get_model_config(model) if isinstance(model, str) else model
    kernels = kernels if kernels is not None else KernelConfig.from_env()
    if planner is not None:
        config = config.replace(aux_scope="global")
    # every run starts from a copy of one initialised model: the same weights as building
    # each from the seed, without initialising a large model on the host once per run
    if source is None:
        template = build_model(config, seed=seed, dtype=dtype, device=device)
    else:  # given weights (a loaded checkpoint): copied, the caller's model is left as it is
        template = copy.deepcopy(source).to(dtype=dtype, device=device)
        template.config = config

    def fresh() -> HybridModel:
        return copy.deepcopy(template)

    ref_model = fresh()
    expanded = make_trainer("expanded", ref_model, loss=loss, kernels=kernels)
    tree_model = fresh()
    trajectories = list(trajectories)
    if recompute_old_logprobs:
        # on-policy ratios of 1: no target is clipped, so every gradient path is exercised
        trajectories = expanded.recompute_old_logprobs(trajectories, microbatch_tokens)
    plan = None
    if planner is None:
        tree: ExpandedTrainer = make_trainer("tree", tree_model, loss=loss, kernels=kernels)
        partition = tree.partition(trajectories, microbatch_tokens)
        ref_partition = partition
    else:
        forest = build_forest(trajectories)
        plan = make_plan(forest, planner, PlanConfig(microbatch_tokens=microbatch_tokens,
                                                     chunk_size=config.chunk_size))
        tree = make_trainer("plan", tree_model, plan, loss=loss, kernels=kernels)
        partition = tree.partition(trajectories, microbatch_tokens)
        ref_partition = None
    ref = expanded.forward_backward(trajectories, microbatch_tokens, ref_partition)
    got = tree.forward_backward(trajectories, microbatch_tokens, partition)
    report: dict[str, Any] = {
        "model": config.name,
        "linear_attention": linear_attention_label(config),  # what `rounds` and `kda_layer` are of
        "dtype": str(dtype).removeprefix("torch."),
        "planner": planner,
        "aux_scope": config.aux_scope,
        "num_trajectories": len(trajectories),
        "num_targets": int(sum(len(t) - 1 for t in trajectories)),
        "microbatches": len(partition),
        "sharing_windows": len(plan.consumers()) if plan is not None else 0,
        "expanded_tokens": got.tokens,
        "compact_tokens": sum(m["rows"] for m in got.layout),
        "rounds": max(m.get("kda_rounds", 0) for m in got.layout),
        "replay_tokens": sum(m.get("replay_tokens", 0) for m in got.layout),
        **compare_steps(ref, ref_model, got, tree_model),
    }
    if plan is not None:
        # the same step as one microbatch of whole trees: what splitting costs or changes
        one_model = fresh()
        one = make_trainer("tree", one_model, loss=loss, kernels=kernels).forward_backward(trajectories, 1 << 62)
        report["vs_single_microbatch"] = compare_steps(one, one_model, got, tree_model)
        report["window_retained_bytes"] = [w.retained_bytes for w in tree.windows]
    if no_replay:
        nr_model = fresh()
        nr_trainer = make_trainer("tree", nr_model, loss=loss, kda_mode="node", kernels=kernels)
        nr_partition = nr_trainer.partition(trajectories, microbatch_tokens if plan is None else 1 << 62)
        nr = nr_trainer.forward_backward(trajectories, microbatch_tokens, nr_partition)
        report["no_replay"] = {
            "rounds": max(m["kda_rounds"] for m in nr.layout),
            "replay_tokens": 0,
            **compare_steps(ref, ref_model, nr, nr_model),
        }
    if baseline_variation:
        rerun_model = fresh()
        rerun = make_trainer("expanded", rerun_model, loss=loss, kernels=kernels).forward_backward(
            trajectories, microbatch_tokens, ref_partition)
        report["expanded_rerun"] = compare_steps(ref, ref_model, rerun, rerun_model)
        del rerun_model, rerun
        if config.aux_scope == "global" or config.aux_loss_coef == 0:
            rp_model = fresh()
            rp = make_trainer("expanded", rp_model, loss=loss, kernels=kernels).forward_backward(
                trajectories, microbatch_tokens, [[j] for j in range(len(trajectories))])
            report["expanded_repacked"] = compare_steps(ref, ref_model, rp, rp_model)
        else:
            report["expanded_repacked"] = None  # the per-microbatch aux loss would change with the packing
    report["kda_layer"] = kda_layer_check(tree_model, trajectories, kernels)
    first = next((k for k in config.layer_kinds if k in LINEAR_ATTENTION_KINDS), None)
    report["kda_layer_kind"] = LAYER_KIND_LABEL[first] if first is not None else None
    report["kernels_ran"] = {"expanded": expanded.kernel_record.to_dict(), "tree": tree.kernel_record.to_dict()}
    return report
