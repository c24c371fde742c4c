"""Qwen3-Next in HARTS against transformers' own implementation (the independent reference),
run in float64 on CPU: a tiny random model built with transformers' classes (GDN and gated
attention layers, MoE and a dense mlp_only layer, GQA, partial rotary, value heads > key
heads), converted by the adapter.

- per-trajectory log-probs equal transformers' forward within 1e-9 absolute at every position;
- tree == expanded within 1e-10 relative for log-probs and every parameter gradient, on
  trees with forks inside the first chunk, on a chunk boundary, one past it and deep;
- to_hf(to_harts(sd)) == sd exactly, and the per-expert checkpoint layout loads the same;
- unsupported config values are refused with the field named.

transformers' Qwen3-Next casts to float32 inside (norms, router softmax, the GDN kernel,
RoPE frequencies); `float64_module` keeps those in float64 without touching its algorithm,
and the model comes from `torch_only_modeling`'s copy of its modeling module, whose GDN and
convolution are transformers' pure-torch functions (fla's kernels compute in float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.config.models import ConfigError, FFNKind, LayerKind
from harts.config.param_counts import parameter_counts
from harts.exec.model import PackedContext
from harts.exec.model.model import HybridModel
from harts.exec.trainer import ExpandedTrainer
from harts.exec.tree_trainer import TreeTrainer
from harts.models.hf.qwen3_next import ADAPTER
from harts.tree.trajectory import Trajectory
from harts.verify.equivalence import compare_steps
from tests.models.float64_reference import float64_module, torch_only_modeling

transformers = pytest.importorskip("transformers")
from transformers import Qwen3NextConfig  # noqa: E402

M = torch_only_modeling("transformers.models.qwen3_next.modeling_qwen3_next")

CHUNK = 8  # HARTS chunk size for the tree tests (forks placed around it)

HF_CONFIG = dict(
    vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    linear_conv_kernel_dim=4, linear_key_head_dim=6, linear_value_head_dim=5,
    linear_num_key_heads=2, linear_num_value_heads=4,
    moe_intermediate_size=10, shared_expert_intermediate_size=14, num_experts_per_tok=2, num_experts=4,
    mlp_only_layers=[1], norm_topk_prob=True, rms_norm_eps=1e-6, initializer_range=0.3,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)


@pytest.fixture(scope="module", autouse=True)
def _few_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model():
    """transformers' model, float64 throughout, its GDN on the pure-torch fallback."""
    cfg = Qwen3NextConfig(**HF_CONFIG)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the per-expert loop (grouped_mm takes no float64)
    with float64_module(M):
        torch.manual_seed(0)
        model = M.Qwen3NextForCausalLM(cfg).to(torch.float64).eval()
        with torch.no_grad():  # non-trivial norm offsets, A_log, dt_bias
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(("dt_bias", "A_log")):
                    p.add_(0.1 * torch.randn_like(p))
            # the MoE router is zero-initialised; spread its scores
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.5)
        yield model


def _hf_logprobs(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(torch.as_tensor(tokens)[None]).logits[0]
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.as_tensor(tokens[1:])[:, None])[:, 0].numpy()


def _harts_model(hf_model) -> HybridModel:
    config = ADAPTER.to_config(hf_model.config.to_dict())
    model = HybridModel(config).to(torch.float64)
    model.load_state_dict(ADAPTER.to_harts(dict(hf_model.state_dict()), config), strict=True)
    return model


def _harts_logprobs(model: HybridModel, tokens: np.ndarray) -> np.ndarray:
    ctx = PackedContext(torch.tensor([0, len(tokens)]), chunk_size=CHUNK)
    with torch.no_grad():
        h = model(torch.as_tensor(tokens), ctx).hidden_TD
        lp = torch.log_softmax(h @ model.lm_head_weight.T, dim=-1)
    return lp[:-1].gather(1, torch.as_tensor(tokens[1:])[:, None])[:, 0].numpy()


def test_config_maps_every_layer_and_ffn(hf_model):
    c = ADAPTER.to_config(hf_model.config.to_dict())
    assert c.layer_kinds == (LayerKind.GDN, LayerKind.GATED_ATTENTION, LayerKind.GDN, LayerKind.GATED_ATTENTION)
    assert c.ffn_kinds == (FFNKind.MOE, FFNKind.DENSE, FFNKind.MOE, FFNKind.MOE)
    assert c.attn_rotary_dim == 4 and c.attn_num_kv_heads == 2 and c.gdn_num_v_heads == 4
    model = _harts_model(hf_model)
    hf_count = sum(p.numel() for p in hf_model.parameters())
    assert parameter_counts(c).total == model.num_parameters() == hf_count


def test_per_trajectory_logprobs_equal_transformers(hf_model):
    model = _harts_model(hf_model)
    rng = np.random.default_rng(0)
    for length in (2, 7, 19):
        tokens = rng.integers(0, HF_CONFIG["vocab_size"], length)
        ours, ref = _harts_logprobs(model, tokens), _hf_logprobs(hf_model, tokens)
        assert ours.shape == ref.shape
        assert np.abs(ours - ref).max() <= 1e-9, np.abs(ours - ref).max()


def test_rows_rotate_by_their_depth_in_trees_and_packs(hf_model):
    """RoPE at a row's depth, not its row index: two groups, each a prefix shared by two
    branches, run as one forest, where a branch's rows sit at row indices other than their
    depths while they attend to their prefix's rows (rotary scores depend on the difference
    of positions, so only an offset that varies along a path shows: a constant one per
    packed sequence cancels); and packed back to back. Every trajectory's log-probs equal
    transformers' forward on it alone."""
    model = _harts_model(hf_model)
    rng = np.random.default_rng(5)
    trajs = []
    for group in ("a", "b"):
        prefix = rng.integers(0, HF_CONFIG["vocab_size"], 6)
        for n in (5, 9):
            tokens = np.concatenate([prefix, rng.integers(0, HF_CONFIG["vocab_size"], n)])
            trajs.append(Trajectory.make(f"{group}{n}", group, tokens))
    # the constant offset would cancel in the scores, but not in the angles' rounding
    assert PackedContext(torch.tensor([0, 3, 5])).position_ids.tolist() == [0, 1, 2, 0, 1]
    tree = TreeTrainer(model).evaluate(trajs, 1 << 16)
    packed = ExpandedTrainer(model).evaluate(trajs, 1 << 16)
    assert len(tree.layout) == len(packed.layout) == 1  # one forest, one pack
    assert tree.executed_rows == sum(map(len, trajs)) - 2 * 6  # the prefixes computed once
    for t, lp_tree, lp_packed in zip(trajs, tree.logprobs, packed.logprobs, strict=True):
        ref = _hf_logprobs(hf_model, t.tokens)
        assert np.abs(lp_tree[1:] - ref).max() <= 1e-9, (t.id, np.abs(lp_tree[1:] - ref).max())
        assert np.abs(lp_packed[1:] - ref).max() <= 1e-9, (t.id, np.abs(lp_packed[1:] - ref).max())


def test_round_trip_is_exact_and_per_expert_layout_loads(hf_model):
    sd = dict(hf_model.state_dict())
    config = ADAPTER.to_config(hf_model.config.to_dict())
    back = ADAPTER.to_hf(ADAPTER.to_harts(sd, config), config, hf_model.config.to_dict())
    assert sorted(back) == sorted(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
    # the published checkpoints store one tensor per expert
    per_expert = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k.removesuffix("gate_up_proj")
            F_ = v.shape[1] // 2
            for e in range(v.shape[0]):
                per_expert[f"{base}{e}.gate_proj.weight"] = v[e, :F_]
                per_expert[f"{base}{e}.up_proj.weight"] = v[e, F_:]
        elif k.endswith("mlp.experts.down_proj"):
            base = k.removesuffix("down_proj")
            for e in range(v.shape[0]):
                per_expert[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            per_expert[k] = v
    per_expert["mtp.fc.weight"] = torch.zeros(2, 2)  # ignored, as transformers ignores it
    a, b = ADAPTER.to_harts(sd, config), ADAPTER.to_harts(per_expert, config)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_state_dict_errors_name_the_tensor(hf_model):
    from harts.exec.model.weights import WeightLoadError

    sd = dict(hf_model.state_dict())
    config = ADAPTER.to_config(hf_model.config.to_dict())
    missing = {k: v for k, v in sd.items() if k != "model.layers.2.linear_attn.A_log"}
    with pytest.raises(WeightLoadError, match=r"model\.layers\.2\.linear_attn\.A_log"):
        ADAPTER.to_harts(missing, config)
    with pytest.raises(WeightLoadError, match="model.layers.9.extra"):
        ADAPTER.to_harts({**sd, "model.layers.9.extra": torch.zeros(1)}, config)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("hidden_act", "gelu", "hidden_act"),
    ("attention_bias", True, "attention_bias"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_type"),
    ("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"], "layer_types"),
    ("linear_num_value_heads", 3, "gdn_num_v_heads"),
    ("model_type", "qwen3_moe", "model_type"),
])
def test_unsupported_values_are_refused_naming_the_field(hf_model, field, value, match):
    cfg = {**hf_model.config.to_dict(), field: value}
    with pytest.raises(ConfigError, match=match):
        ADAPTER.to_config(cfg)


def _forked_trajectories(seed: int) -> list[Trajectory]:
    """One group per fork position: inside the first chunk (3), on the boundary (CHUNK),
    one past it (CHUNK + 1), and deep (a fork at 2 CHUNK + 3 under a fork at 5)."""
    rng = np.random.default_rng(seed)
    V = HF_CONFIG["vocab_size"]
    trajs = []

    def tok(n):
        return rng.integers(0, V, n).tolist()

    for g, fork in enumerate((3, CHUNK, CHUNK + 1)):
        prefix = tok(fork)
        for tail in (5, 11, 2):
            trajs.append((f"g{g}", prefix + tok(tail)))
    root = tok(5)
    mid = root + tok(2 * CHUNK - 2)
    for seq in (root + tok(6), mid + tok(4), mid + tok(9), mid + tok(1)):
        trajs.append(("deep", seq))
    return [
        Trajectory.make(f"t{i}", group, tokens, advantage=float(rng.normal()), ref_logprobs=-rng.random(len(tokens)))
        for i, (group, tokens) in enumerate(trajs)
    ]


def test_tree_equals_expanded_in_float64(hf_model):
    trajs = _forked_trajectories(1)
    base = _harts_model(hf_model)
    config = base.config.replace(chunk_size=CHUNK, aux_loss_coef=1e-2)
    ref_model, tree_model = HybridModel(config).to(torch.float64), HybridModel(config).to(torch.float64)
    ref_model.load_state_dict(base.state_dict())
    tree_model.load_state_dict(base.state_dict())
    expanded = ExpandedTrainer(ref_model)
    trajs = expanded.recompute_old_logprobs(trajs, 1 << 20)
    ref = expanded.forward_backward(trajs, 1 << 20)
    tree = TreeTrainer(tree_model)
    got = tree.forward_backward(trajs, 1 << 20)
    assert sum(m["rows"] for m in got.layout) < got.tokens  # rows are shared
    assert max(m["kda_rounds"] for m in got.layout) >= 2  # GDN ran the KDA replay rounds
    report = compare_steps(ref, ref_model, got, tree_model)
    assert report["max_rel_logprob_err"] <= 1e-10, report
    assert report["max_rel_grad_err"] <= 1e-10, report["worst_grad_params"]
    for k, err in report["loss_abs_err"].items():
        assert err <= 1e-10 * max(1.0, abs(ref.losses[k])), (k, err)
    # every parameter received a gradient (routers, shared gates, norms, A_log, dt_bias ...)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in tree_model.parameters())


# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (the fields that shape the model)
PUBLISHED_80B = {
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "rope_theta": 10000000, "partial_rotary_factor": 0.25, "rope_scaling": None,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10, "num_experts": 512,
    "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "output_router_logits": False,
    "initializer_range": 0.02, "max_position_embeddings": 262144,
}


def test_registered_80b_is_the_published_config_and_its_size():
    from harts.config.models import get_model_config

    registered = get_model_config("qwen3-next-80b-a3b")
    assert ADAPTER.to_config(PUBLISHED_80B).replace(name=registered.name) == registered
    counts = parameter_counts(registered)
    # published: 80B total, 3B activated ("A3B", which leaves out the embedding and LM head)
    assert abs(counts.total / 80e9 - 1) <= 0.02, counts.total
    non_embedding_active = counts.active - counts.by_component["embedding"] - counts.by_component["lm_head"]
    assert 3.0e9 <= non_embedding_active <= 3.5e9, non_embedding_active


def test_simulator_counts_the_qwen3_next_layers():
    from harts.config.models import get_model_config
    from harts.config.parallel import ParallelConfig
    from harts.plan.stages import stage_layers
    from harts.plan.work import expanded_microbatch
    from harts.sim.costs import make_cost_model
    from harts.sim.hardware import load_hardware
    from harts.sim.ops import OpKind, Phase

    model = get_model_config("qwen3-next-80b-a3b")
    lays = stage_layers(model, 2)
    assert sum(s.num_gdn for s in lays) == 36 and sum(s.num_gated_attention for s in lays) == 12
    cost = make_cost_model("roofline", model, ParallelConfig(dp=4, pp=2, ep=4), load_hardware("h200"))
    dense = sum(cost.stages[s].stage_params()[0] for s in range(2))
    experts = sum(cost.stages[s].stage_params()[1] for s in range(2))
    assert dense + experts == parameter_counts(model).total
    n = 4096
    w = expanded_microbatch(0, 0, [n])
    ops = [op for s in range(2) for op in cost.stages[s].pass_ops(Phase.FWD, [w])]
    names = {op.name for op in ops}
    assert {"gdn.core", "gattn.attention", "moe.shared_expert_gate"} <= names
    assert not any(name.startswith(("kda.", "mla.")) for name in names)
    # forward GEMMs do 2 FLOPs per active weight per row; routed experts run k of E per row
    gemm = sum(op.flops for op in ops if op.kind == OpKind.GEMM)
    active = parameter_counts(model).active - parameter_counts(model).by_component["embedding"]
    assert gemm == pytest.approx(2 * n * active, rel=0.01)
    assert cost.forward(0, [w]).seconds > 0 and cost.backward(1, [w]).seconds > 0


@pytest.mark.parametrize("planner", [None, "l1l2"])
def test_verify_step_tree_equals_expanded(planner):
    """`harts verify`'s check on the Qwen3-Next shape: whole trees, and a planner's plan with
    a sharing window (the GDN conv inputs, KDA-round inputs and states handed from producer
    to consumer), with and without replay."""
    from harts.verify.equivalence import verify_step

    config = ADAPTER.to_config(Qwen3NextConfig(**HF_CONFIG).to_dict()).replace(chunk_size=CHUNK)
    # with the planner, a budget below the deep tree's 39 rows (its longest trajectory has 28),
    # so that a tree must be split into a window
    r = verify_step(_forked_trajectories(2), model=config, dtype=torch.float64, planner=planner,
                    microbatch_tokens=48 if planner is None else 32)
    assert r["max_rel_logprob_err"] <= 1e-10 and r["max_rel_grad_err"] <= 1e-10, r
    assert r["no_replay"]["max_rel_grad_err"] <= 1e-10, r["no_replay"]
    assert r["kda_layer"]["replay"]["bit_identical"]
    assert r["rounds"] >= 2
    if planner is not None:
        assert r["sharing_windows"] >= 1


def test_tied_embeddings_map_without_an_lm_head_tensor():
    cfg = Qwen3NextConfig(**{**HF_CONFIG, "tie_word_embeddings": True})
    config = ADAPTER.to_config(cfg.to_dict())
    assert config.tie_embeddings
    torch.manual_seed(0)
    model = HybridModel(config).to(torch.float64)
    hf = ADAPTER.to_hf(model.state_dict(), config, cfg.to_dict())
    assert "lm_head.weight" not in hf  # a tied checkpoint's files hold the embedding only
    back = ADAPTER.to_harts(hf, config)
    assert sorted(back) == sorted(model.state_dict())
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    # a state dict that lists the tied head too (transformers' state_dict()) maps the same
    with_head = {**hf, "lm_head.weight": hf["model.embed_tokens.weight"]}
    assert all(torch.equal(ADAPTER.to_harts(with_head, config)[k], back[k]) for k in back)
    from harts.exec.model.weights import WeightLoadError

    with pytest.raises(WeightLoadError, match="lm_head.weight"):
        ADAPTER.to_harts({**hf, "lm_head.weight": hf["model.embed_tokens.weight"] + 1}, config)
