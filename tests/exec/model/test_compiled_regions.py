"""The compiled regions (`KernelConfig.compile`: the MoE routing and statistics, the KDA
forget gate, the SwiGLU product, the gated norm's gate) against the eager layers:
outputs, aux loss, loads and every gradient, over row counts that change from call to
call (the regions have dynamic shapes), in float64 and float32, and a whole window-plan
step. The backend here is `aot_eager` (traced and run as aten ops, no code generated, so
no compiler is needed); inductor's generated kernels are the GPU's, timed by
benchmarks/gpu/compile_ab.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from harts.config.kernels import Compile, KernelConfig
from harts.config.models import get_model_config
from harts.exec.loss import PolicyLossConfig
from harts.exec.model.model import build_model
from harts.exec.model.moe import MoE
from harts.exec.window import PlanTrainer
from harts.plan.planners import PlanConfig, make_plan
from harts.tree import build_forest
from harts.tree.workload import generate_trajectories

COMPILED = KernelConfig(compile=Compile.AOT_EAGER)


@dataclass
class RowsContext:
    row_weight: torch.Tensor
    kernels: KernelConfig

    @property
    def num_rows(self) -> int:
        return self.row_weight.numel()


def _moe(make_config, dtype, **changes) -> MoE:
    torch.manual_seed(0)
    moe = MoE(make_config(aux_loss_coef=0.01, **changes)).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def _run(moe: MoE, x: torch.Tensor, w: torch.Tensor, kernels: KernelConfig):
    x = x.clone().requires_grad_(True)
    y, aux, load = moe(x, RowsContext(w, kernels))
    loss = (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum() + aux
    grads = torch.autograd.grad(loss, [x, *moe.parameters()])
    return [y.detach(), aux.detach(), load, *grads]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_compiled_routing_is_the_eager_layer(make_config, router, dtype, tol):
    moe = _moe(make_config, dtype, router=router)
    for T in (9, 23, 64, 5):  # row counts change between calls: one dynamic graph serves them
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(T, 32, dtype=dtype, generator=gen)
        w = torch.randint(1, 5, (T,), generator=gen).to(dtype)
        eager = _run(moe, x, w, KernelConfig())
        comp = _run(moe, x, w, COMPILED)
        assert torch.equal(comp[2], eager[2]), "loads"
        for a, b in zip(comp, eager, strict=True):
            assert a.shape == b.shape
            assert float((a - b).norm()) <= tol * max(1.0, float(b.norm())), (T, a, b)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_compiled_forget_gate_is_the_eager_gate(dtype, tol):
    from harts.exec.model.kda import KDAMixer

    cfg = get_model_config("tiny-cpu")
    torch.manual_seed(0)
    mixer = KDAMixer(cfg, 0).to(dtype)
    mixer.reset_special_parameters()
    with torch.no_grad():
        mixer.f_proj[1].weight.normal_(0.0, 0.5)
    params = [mixer.f_proj[1].weight, mixer.dt_bias, mixer.A_log]
    for T in (7, 31, 12):
        f = torch.randn(T, cfg.gate_rank, dtype=dtype, requires_grad=True)
        out = {}
        for name, kernels in (("eager", KernelConfig()), ("compiled", COMPILED)):
            g = mixer._gate(kernels)(f)
            out[name] = [g.detach(), *torch.autograd.grad((g * g.detach().cos()).sum(), [f, *params])]
        for a, b in zip(out["compiled"], out["eager"], strict=True):
            assert float((a - b).norm()) <= tol * max(1.0, float(b.norm())), T


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_compiled_swiglu_and_gated_norm_are_the_eager_layers(dtype, tol):
    from harts.exec.model.layers import GatedRMSNorm, SwiGLU

    torch.manual_seed(0)
    ffn, norm = SwiGLU(16, 24).to(dtype), GatedRMSNorm(8, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    for T in (5, 19, 11):
        x = torch.randn(T, 16, dtype=dtype, requires_grad=True)
        h = torch.randn(T, 3, 8, dtype=dtype, requires_grad=True)
        g = torch.randn(T, 3, 8, dtype=dtype, requires_grad=True)
        out = {}
        for name, kernels in (("eager", KernelConfig()), ("compiled", COMPILED)):
            ctx = RowsContext(torch.ones(T, dtype=dtype), kernels)
            y, z = ffn(x, ctx), norm(h, g, ctx)
            loss = (y * y.detach().sin()).sum() + (z * z.detach().cos()).sum()
            out[name] = [y.detach(), z.detach(), *torch.autograd.grad(loss, [x, h, g, *ffn.parameters(),
                                                                             norm.weight])]
        for a, b in zip(out["compiled"], out["eager"], strict=True):
            assert float((a - b).norm()) <= tol * max(1.0, float(b.norm())), T


def test_routers_the_region_does_not_take_stay_eager(make_config):
    # grouped top-k with a score bias (DeepSeek-V3 / Kimi routing): MoE._select, not compiled
    moe = _moe(make_config, torch.float64, router="sigmoid", router_score_bias=True, router_groups=2,
               router_topk_groups=1, router_renormalize=False, routed_scaling_factor=2.5)
    assert not moe._plain_topk
    x = torch.randn(13, 32, dtype=torch.float64)
    w = torch.ones(13, dtype=torch.float64)
    for a, b in zip(_run(moe, x, w, COMPILED), _run(moe, x, w, KernelConfig()), strict=True):
        assert torch.equal(a, b)


def test_a_window_step_with_compiled_routing_is_the_eager_step(monkeypatch):
    import harts.exec.compiled as compiled_mod

    asked = []
    real = compiled_mod.compiled
    monkeypatch.setattr(compiled_mod, "compiled",
                        lambda fn, backend: asked.append((fn.__name__, backend)) or real(fn, backend))
    trajs = generate_trajectories("tiny-treestep", seed=1)
    forest = build_forest(trajs)
    budget = max(int(forest.traj_length.max()) + 5, forest.compact_tokens // 3)
    plan = make_plan(forest, "l1l2", PlanConfig(microbatch_tokens=budget, chunk_size=8))
    assert plan.consumers(), "the budget must force a sharing window"
    cfg = get_model_config("tiny-cpu").replace(chunk_size=8)
    assert cfg.aux_scope == "microbatch"  # the statistics the compiled region computes
    steps = {}
    for name, kernels in (("eager", KernelConfig()), ("compiled", COMPILED)):
        model = build_model(cfg, seed=3, dtype=torch.float64, recompute=True)
        result = PlanTrainer(model, plan, loss=PolicyLossConfig(kl_coef=0.1), kernels=kernels).forward_backward(
            trajs, 1 << 20)
        steps[name] = (result, [p.grad for p in model.parameters()])
    # every MoE and KDA layer of every microbatch's passes took its compiled region, and
    # only the compiled step did
    assert set(asked) == {(name, "aot_eager") for name in ("route_and_balance", "kda_gate", "swiglu_product",
                                                            "sigmoid_gated")}
    n = len(plan.microbatches)
    assert sum(a[0] == "route_and_balance" for a in asked) >= n * sum(k == "moe" for k in cfg.ffn_kinds)
    assert sum(a[0] == "kda_gate" for a in asked) >= n * cfg.layer_kinds.count("kda")
    (ra, ga), (rb, gb) = steps["compiled"], steps["eager"]
    for k in ("loss", "aux_loss"):
        assert abs(ra.losses[k] - rb.losses[k]) <= 1e-12 * max(1.0, abs(rb.losses[k])), k
    for a, b in zip(ga, gb, strict=True):
        assert float((a - b).norm()) <= 1e-12 * max(1.0, float(b.norm()))


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_compiled_expert_hidden_is_the_eager_product(dtype, tol):
    # the grouped experts' weighted SwiGLU product (`expert_hidden`), through the whole
    # grouped path (float64 products from the reference grouped product)
    from harts.exec.ops.moe import grouped_mm_reference
    from harts.exec.ops.moe.grouped import experts_grouped

    E, k, D, F_ = 5, 2, 16, 8
    for T in (7, 30, 13):
        gen = torch.Generator().manual_seed(T)
        x = torch.randn(T, D, generator=gen, dtype=dtype)
        top_s, top_i = torch.topk(torch.randn(T, E, generator=gen, dtype=dtype).softmax(-1), k, dim=-1)
        top_w = top_s / top_s.sum(-1, keepdim=True)
        ws = [torch.randn(*s, generator=gen, dtype=dtype) * 0.3 for s in ((E, F_, D), (E, F_, D), (E, D, F_))]
        out = {}
        for name, kernels in (("eager", KernelConfig()), ("compiled", COMPILED)):
            leaves = [t.detach().clone().requires_grad_() for t in (x, top_w, *ws)]
            y = experts_grouped(leaves[0], top_i, leaves[1], *leaves[2:], mm=grouped_mm_reference, kernels=kernels)
            out[name] = [y.detach(), *torch.autograd.grad((y * y.detach().sin()).sum(), leaves)]
        for a, b in zip(out["compiled"], out["eager"], strict=True):
            assert float((a - b).norm()) <= tol * max(1.0, float(b.norm())), T
