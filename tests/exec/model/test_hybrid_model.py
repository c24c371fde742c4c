"""The model over packed sequences: packed == one at a time, causal, recompute-exact, float64."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from harts.exec.model import PackedContext, build_model
from harts.testing import assert_close, rel_err

LENGTHS = [5, 40, 1, 23]  # crosses the test chunk size (16) and the conv window


def _packed(lengths):
    return PackedContext(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]), chunk_size=16)


def _ids(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (sum(lengths),), generator=g)


@pytest.mark.parametrize(
    "changes",
    [{}, {"use_rope": True, "router": "sigmoid"}, {"q_lora_rank": 12, "tie_embeddings": True}],
    ids=["base", "rope-sigmoid", "qlora-tied"],
)
def test_packed_equals_one_at_a_time(make_config, changes):
    config = make_config(**changes)
    model = build_model(config, dtype=torch.float64)
    ids = _ids(config.vocab_size, LENGTHS)
    packed = model(ids, _packed(LENGTHS))
    assert packed.hidden_TD.dtype == torch.float64
    start = 0
    load = torch.zeros_like(packed.expert_load)
    for n in LENGTHS:
        alone = model(ids[start : start + n], _packed([n]))
        assert_close(f"rows {start}:{start + n}", packed.hidden_TD[start : start + n], alone.hidden_TD, 1e-12)
        load += alone.expert_load
        start += n
    # routing is per row, so loads add up exactly across sequences
    assert torch.equal(load, packed.expert_load)
    assert packed.expert_load.shape == (config.num_moe_layers, config.num_experts)
    assert packed.expert_load.sum().item() == config.num_moe_layers * config.top_k * sum(LENGTHS)


def _embedded(model):
    """Keep the embedding output of each forward in store["x"] (the node the causality
    gradients are taken against); returns (store, hook handle)."""
    store = {}

    def hook(_module, _inputs, output):
        store["x"] = output
        return output

    return store, model.embed.register_forward_hook(hook)


def test_causal_within_sequence(make_config):
    """Causality as an exact zero dependency, plus closeness within a float64 tolerance.

    Gradients through the masks are exact zeros (a masked softmax weight is 0.0, a conv tap
    outside the window and a KDA state reset multiply by 0.0), and 0.0 times any finite
    partial sums to exactly 0.0 in any order; so `d out[j] / d x[i] == 0` bit for bit on any
    CPU for every row i that row j may not see. Values themselves are not compared bit for
    bit: changing a token re-routes its row, which changes the MoE's per-expert GEMM shapes
    and so the BLAS summation order of *other* rows (1e-15 relative on AMD EPYC).
    """
    config = make_config(use_rope=True)
    model = build_model(config, dtype=torch.float64)
    lengths = [30, 12]
    ids = _ids(config.vocab_size, lengths)
    store, handle = _embedded(model)
    try:
        base = model(ids, _packed(lengths)).hidden_TD
        x_TD = store["x"]
        probe = torch.randn(base.shape, generator=torch.Generator().manual_seed(1), dtype=base.dtype)

        def grad_of(rows: slice) -> torch.Tensor:
            (g,) = torch.autograd.grad((base[rows] * probe[rows]).sum(), x_TD, retain_graph=True)
            return g

        # sequence 2 (rows 30:42) does not depend on sequence 1 (rows 0:30), and vice versa
        g_seq2 = grad_of(slice(30, None))
        assert torch.count_nonzero(g_seq2[:30]) == 0
        assert torch.all(g_seq2[30:].abs().sum(-1) > 0), "every row of sequence 2 feeds its outputs"
        g_seq1 = grad_of(slice(0, 30))
        assert torch.count_nonzero(g_seq1[30:]) == 0
        # within sequence 1: rows 0:17 do not see rows 17:, row 29 sees every earlier row
        g_prefix = grad_of(slice(0, 17))
        assert torch.count_nonzero(g_prefix[17:]) == 0
        g_last = grad_of(slice(29, 30))
        assert torch.all(g_last[:30].abs().sum(-1) > 0)
        assert torch.count_nonzero(g_last[30:]) == 0
    finally:
        handle.remove()

    # A token change (which also moves discrete routing, invisible to gradients) leaves
    # rows it may not reach equal up to summation order. Bound: each output is a chain of
    # ~4 layers of float64 dot products over <= 64 terms of O(1) values, so reordering
    # changes it by <= ~ 4 * 64 * eps64 ~ 6e-14 relative; 1e-12 leaves 16x margin and is
    # still 1e12 x below the O(1) change a real dependency makes (rows 17:30 below).
    changed_ids = ids.clone()
    changed_ids[17] = (ids[17] + 1) % config.vocab_size
    with torch.no_grad():
        changed = model(changed_ids, _packed(lengths)).hidden_TD
    assert_close("rows 0:17 (before the change)", changed[:17], base[:17], 1e-12)
    assert_close("rows 30:42 (the other sequence)", changed[30:], base[30:], 1e-12)
    assert rel_err(changed[17:30], base[17:30]) > 1e-3, "the changed token must reach later rows"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["reentrant", "hooks"])
def test_recompute_gives_bit_identical_gradients(make_config, monkeypatch, dtype, kind):
    """Either checkpoint (`checkpoint_kind`) gives the outputs and every gradient of the
    step without recomputation, bit for bit."""
    import harts.exec.model.model as model_module

    used = []

    def forced(ctx, x_TD):
        used.append(kind)
        return kind

    monkeypatch.setattr(model_module, "checkpoint_kind", forced)
    config = make_config(use_rope=True)
    ids = _ids(config.vocab_size, LENGTHS, seed=3)
    grads, outs = [], []
    for recompute in (False, True):
        model = build_model(config, dtype=dtype, recompute=recompute)
        out = model(ids, _packed(LENGTHS))
        loss = (out.hidden_TD @ model.lm_head_weight.T).logsumexp(-1).sum() + out.aux_loss
        loss.backward()
        outs.append(out.hidden_TD.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.equal(outs[0], outs[1])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    assert all(g.abs().sum() > 0 for n, g in grads[0].items() if "w_" not in n), "a parameter got no gradient"
    assert used == [kind]  # one decision per forward, and only with recomputation


def test_checkpoint_kind_is_reentrant_only_where_the_forward_graph_is_not_needed():
    from harts.exec.model.model import checkpoint_kind

    x = torch.zeros(3, 2, requires_grad=True)
    plain, recording = SimpleNamespace(), SimpleNamespace(record=object())
    assert checkpoint_kind(plain, x) == "reentrant"
    assert checkpoint_kind(SimpleNamespace(record=None), x) == "reentrant"
    assert checkpoint_kind(recording, x) == "hooks"  # a window producer's stash needs the graph
    assert checkpoint_kind(plain, x.detach()) == "hooks"  # reentrant needs an input with grad


def test_same_seed_same_weights_and_global_rng_untouched(make_config):
    config = make_config()
    state = torch.random.get_rng_state()
    a, b = build_model(config, seed=5), build_model(config, seed=5)
    assert torch.equal(state, torch.random.get_rng_state())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    c = build_model(config, seed=6)
    assert not torch.equal(a.embed.weight, c.embed.weight)


def test_input_must_match_context(make_config):
    model = build_model(make_config())
    with pytest.raises(ValueError, match=r"input_ids must be \[T=5\]"):
        model(torch.zeros(4, dtype=torch.long), _packed([5]))
