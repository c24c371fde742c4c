"""Step-global MoE statistics at the module level: split rows sum to the full-batch aux loss
and its router gradient, MoE-layer ordinals, the context hand-off and the config field."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from harts.config.models import ConfigError
from harts.config.param_counts import parameter_counts
from harts.exec.model import build_model
from harts.exec.model.moe import MoE, MoEGlobalStats, set_moe_global
from harts.testing import assert_close


@dataclass
class RowsContext:
    """Token-wise rows with occurrence weights (what a tree context gives the MoE)."""

    row_weight: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.row_weight.numel()


def _moe(make_config, moe_index=0) -> MoE:
    torch.manual_seed(0)
    moe = MoE(make_config(aux_loss_coef=0.01), moe_index=moe_index).to(torch.float64)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def _router_grad(moe: MoE, pieces) -> tuple[float, torch.Tensor]:
    moe.zero_grad(set_to_none=True)
    total = 0.0
    for x, ctx in pieces:
        _, aux, _ = moe(x, ctx)
        aux.backward()
        total += float(aux.detach())
    return total, moe.router.weight.grad.clone()


def test_split_rows_sum_to_the_full_batch_aux_and_its_gradient(make_config):
    moe = _moe(make_config, moe_index=1)
    T, k = 23, moe.top_k
    x = torch.randn(T, 32, dtype=torch.float64)
    w = torch.randint(1, 5, (T,)).to(torch.float64)
    full_aux, full_grad = _router_grad(moe, [(x, RowsContext(w))])
    with torch.no_grad():
        _, _, load = moe(x, RowsContext(w))
    # layer 0 is a decoy: this module is MoE layer 1 and must read row 1
    stats = MoEGlobalStats.from_loads(torch.stack([torch.full_like(load, 7.0), load]), float(w.sum()), k)
    assert_close("f sums to 1", stats.f_LE.sum(-1)[1], torch.tensor(1.0, dtype=torch.float64), 1e-15)
    for cuts in ([0, 23], [0, 5, 23], [0, 1, 2, 11, 12, 20, 23]):
        pieces = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            ctx = RowsContext(w[a:b])
            set_moe_global(ctx, stats)
            pieces.append((x[a:b], ctx))
        aux, grad = _router_grad(moe, pieces)
        assert aux == pytest.approx(full_aux, rel=1e-13)
        assert_close(f"router grad {cuts}", grad, full_grad, 1e-13)
    # the per-microbatch scope does depend on the split
    aux, grad = _router_grad(moe, [(x[:5], RowsContext(w[:5])), (x[5:], RowsContext(w[5:]))])
    assert abs(aux / full_aux - 1) > 1e-3
    # set_moe_global(ctx, None) hands the context back its own statistics
    ctx = RowsContext(w)
    set_moe_global(ctx, stats)
    set_moe_global(ctx, None)
    assert ctx.moe_global_f is None
    assert _router_grad(moe, [(x, ctx)])[0] == full_aux


def test_a_short_statistics_list_fails_loudly(make_config):
    moe = _moe(make_config, moe_index=2)
    x = torch.randn(4, 32, dtype=torch.float64)
    ctx = RowsContext(torch.ones(4, dtype=torch.float64))
    with torch.no_grad():
        load = moe(x, ctx)[2]
    set_moe_global(ctx, MoEGlobalStats.from_loads(torch.stack([load, load]), 4.0, moe.top_k))
    with pytest.raises(ValueError, match="holds 2 MoE layers; this is MoE layer 2"):
        moe(x, ctx)
    with pytest.raises(ValueError, match="total row weight must be > 0"):
        MoEGlobalStats.from_loads(load[None], 0.0, moe.top_k)


@pytest.mark.parametrize("num_dense_layers", [0, 1, 3])
def test_moe_modules_know_their_ordinal(make_config, num_dense_layers):
    config = make_config(num_dense_layers=num_dense_layers)
    model = build_model(config)
    ordinals = [m.moe_index for m in model.modules() if isinstance(m, MoE)]
    assert ordinals == list(range(config.num_moe_layers))
    assert [b.ffn.moe_index for b in model.layers[num_dense_layers:]] == ordinals


def test_aux_scope_is_validated_and_adds_no_parameters(make_config):
    config = make_config()
    assert config.aux_scope == "microbatch"
    with pytest.raises(ConfigError, match="aux_scope: must be 'microbatch' or 'global', got 'step'"):
        config.replace(aux_scope="step")
    glob = config.replace(aux_scope="global")
    assert parameter_counts(glob) == parameter_counts(config)
    assert build_model(glob).num_parameters() == build_model(config).num_parameters()
