"""bf16 fidelity: how far tree execution drifts from the expanded baseline in low precision,
measured against how far the baseline drifts from a rerun of itself (the analogues of the
HARTS paper's Table 7 and Figure 5).

Legend: X expanded positions with a next-token target, V vocabulary, D model dim.

One set of weights; every run is a forward pass over the same trajectories in the same
microbatches (whole trees, `harts.plan.partition.tree_partition`). For each trajectory
position p < L-1 the next-token logit row z (V) of run a is compared with run b's:

    cosine    z_a . z_b / (|z_a| |z_b|), averaged over positions (token-wise, equal weights)
    sym KL    KL(p_a || p_b) + KL(p_b || p_a) of the softmaxes, averaged over positions
    NLL diff  |(-log p_a[t_{p+1}]) - (-log p_b[t_{p+1}])| over trained targets (mean and max)
    loss diff |loss_a - loss_b| of the step's policy loss (`evaluate`, same denominators)

Pairs: tree (replay) vs expanded, tree (node = no replay) vs expanded, expanded vs a
rerun of expanded, and expanded vs expanded repacked one trajectory per microbatch (the
baseline's own drift under another batch composition, what dynamic packing changes from
run to run; on one GPU with deterministic kernels the plain rerun is bit-identical). Tree rows are also binned by handoff depth (the level of the row's
node: how many forks, hence KDA state handoffs, lie above it). Logits are formed in the
model's dtype exactly as the loss forms them and compared in float32, chunk by chunk, so
no [X, V] tensor is ever held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from harts.config.kernels import KernelConfig
from harts.config.models import ModelConfig
from harts.exec.factory import make_trainer
from harts.exec.model.context import PackedContext
from harts.exec.model.model import HybridModel, build_model
from harts.exec.tree import TreeContext
from harts.plan.partition import tree_partition
from harts.tree import Trajectory, build_forest


def _hidden_rows(model: HybridModel, trajectories: Sequence[Trajectory], partition, mode: str,
                 kernels: KernelConfig | None = None):
    """Per trajectory: (hidden rows of positions 0..L-1 [L, D], handoff depth of each row)."""
    device = model.lm_head_weight.device
    out: dict[int, tuple[torch.Tensor, np.ndarray]] = {}
    with torch.no_grad():
        for members in partition:
            members = list(members)
            if mode == "expanded":
                sizes = [len(trajectories[j]) for j in members]
                offs = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
                ids = torch.from_numpy(np.concatenate([trajectories[j].tokens for j in members])).to(device)
                ctx = PackedContext(torch.from_numpy(offs), chunk_size=model.config.chunk_size,
                                    kernels=kernels).to(device)
                h = model(ids, ctx).hidden_TD
                for i, j in enumerate(members):
                    out[j] = (h[offs[i]:offs[i + 1]], np.zeros(sizes[i], np.int64))
            else:
                forest = build_forest([trajectories[j] for j in members])
                ctx = TreeContext(forest, chunk_size=model.config.chunk_size, kda_mode=mode, device=device,
                                  kernels=kernels)
                h = model(torch.from_numpy(forest.token_ids).to(device), ctx).hidden_TD
                depth = forest.node_level[forest.row_node]
                rows, offs = forest.traj_rows, forest.traj_offsets
                for i, j in enumerate(members):
                    r = rows[offs[i]:offs[i + 1]]
                    out[j] = (h[torch.from_numpy(r).to(device)], depth[r])
    return out


def _compare(a, b, trajectories, lm_head_VD: torch.Tensor, chunk_rows: int) -> dict[str, Any]:
    cos, skl, dnll, depth_all = [], [], [], []
    for j, t in enumerate(trajectories):
        ha, depth = a[j]
        hb, _ = b[j]
        n = len(t) - 1
        labels = torch.from_numpy(t.tokens[1:]).to(ha.device)
        trained = torch.from_numpy(t.loss_mask[1:]).to(ha.device)
        for s in range(0, n, chunk_rows):
            e = min(n, s + chunk_rows)
            za = (ha[s:e] @ lm_head_VD.T).float()
            zb = (hb[s:e] @ lm_head_VD.T).float()
            cos.append(torch.nn.functional.cosine_similarity(za, zb, dim=-1).double().cpu())
            la, lb = za.log_softmax(-1), zb.log_softmax(-1)
            kl = ((la.exp() * (la - lb)).sum(-1) + (lb.exp() * (lb - la)).sum(-1))
            skl.append(kl.double().cpu())
            lab = labels[s:e, None]
            d = (la.gather(1, lab) - lb.gather(1, lab))[:, 0].abs()
            dnll.append(d[trained[s:e]].double().cpu())
        depth_all.append(depth[:n])
    cos_X, skl_X, dnll_T = torch.cat(cos).numpy(), torch.cat(skl).numpy(), torch.cat(dnll).numpy()
    depth_X = np.concatenate(depth_all)
    by_depth = {}
    for d in np.unique(depth_X).tolist():
        sel = depth_X == d
        by_depth[int(d)] = {"positions": int(sel.sum()), "cosine": float(cos_X[sel].mean()),
                            "sym_kl": float(skl_X[sel].mean())}
    return {
        "positions": int(cos_X.size),
        "cosine": float(cos_X.mean()),
        "cosine_min": float(cos_X.min()),
        "sym_kl": float(skl_X.mean()),
        "sym_kl_max": float(skl_X.max()),
        "nll_diff_mean": float(dnll_T.mean()) if dnll_T.size else 0.0,
        "nll_diff_max": float(dnll_T.max()) if dnll_T.size else 0.0,
        "by_handoff_depth": by_depth,
    }


def fidelity(
    trajectories: Sequence[Trajectory],
    *,
    model: str | ModelConfig = "tiny-cpu",
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int = 0,
    microbatch_tokens: int = 1 << 17,
    chunk_rows: int = 2048,
    kernels: KernelConfig | None = None,
) -> dict[str, Any]:
    """The fidelity report: tree (replay, no replay), an expanded rerun and an expanded
    repacked run, each vs expanded; every run on `kernels` (default: `KernelConfig.from_env()`)."""
    kernels = kernels if kernels is not None else KernelConfig.from_env()
    if isinstance(model, str):
        from harts.config.models import get_model_config

        model = get_model_config(model)
    trajectories = list(trajectories)
    net = build_model(model, seed=seed, dtype=dtype, device=device)
    partition = tree_partition(trajectories, microbatch_tokens)
    W = net.lm_head_weight.detach()
    # the baseline with another, equally valid batch composition: one trajectory per
    # microbatch (in training, dynamic packing changes it from run to run)
    repacked = [[j] for j in range(len(trajectories))]
    runs = {
        "expanded": _hidden_rows(net, trajectories, partition, "expanded", kernels),
        "expanded_rerun": _hidden_rows(net, trajectories, partition, "expanded", kernels),
        "expanded_repacked": _hidden_rows(net, trajectories, repacked, "expanded", kernels),
        "tree_replay": _hidden_rows(net, trajectories, partition, "replay", kernels),
        "tree_no_replay": _hidden_rows(net, trajectories, partition, "node", kernels),
    }
    def loss(kind: str, bins: list[list[int]], kda_mode: str | None = None) -> float:
        trainer = make_trainer(kind, net, kernels=kernels, kda_mode=kda_mode)
        return trainer.evaluate(trajectories, microbatch_tokens, bins).losses["loss"]

    losses = {
        "expanded": loss("expanded", partition),
        "expanded_rerun": loss("expanded", partition),
        "expanded_repacked": loss("expanded", repacked),
        "tree_replay": loss("tree", partition),
        "tree_no_replay": loss("tree", partition, "node"),
    }
    report: dict[str, Any] = {"model": model.name, "dtype": str(dtype).removeprefix("torch."),
                              "trajectories": len(trajectories), "losses": losses}
    for name in ("expanded_rerun", "expanded_repacked", "tree_replay", "tree_no_replay"):
        r = _compare(runs[name], runs["expanded"], trajectories, W, chunk_rows)
        r["loss_diff"] = abs(losses[name] - losses["expanded"])
        report[f"{name}_vs_expanded"] = r
    return report
