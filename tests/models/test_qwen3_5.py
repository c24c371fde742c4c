"""Qwen3.5 text models (dense and MoE) in HARTS against transformers' own classes in float64:
per-trajectory log-probs within 1e-9 absolute at every position, an exact round trip of the
state dict (the split GDN projections permuted into Qwen3-Next's layout and back), and the
multimodal composite refused with the field named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts.config.models import ConfigError, FFNKind
from harts.config.param_counts import parameter_counts
from harts.exec.model import PackedContext
from harts.exec.model.model import HybridModel
from harts.models.hf import qwen3_5, qwen3_5_moe
from tests.models.float64_reference import float64_module, perturb_from_init, torch_only_modeling

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig  # noqa: E402

M5 = torch_only_modeling("transformers.models.qwen3_5.modeling_qwen3_5")
M5moe = torch_only_modeling("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

COMMON = dict(
    vocab_size=53, hidden_size=24, intermediate_size=36, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    linear_conv_kernel_dim=4, linear_key_head_dim=6, linear_value_head_dim=5,
    linear_num_key_heads=2, linear_num_value_heads=6, initializer_range=0.3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [1, 1, 0], "mrope_interleaved": True},
)
MOE = dict(moe_intermediate_size=10, shared_expert_intermediate_size=14, num_experts_per_tok=2, num_experts=4)
CASES = {
    "dense": (Qwen3_5TextConfig, M5.Qwen3_5ForCausalLM, M5, qwen3_5.ADAPTER, {}),
    "moe": (Qwen3_5MoeTextConfig, M5moe.Qwen3_5MoeForCausalLM, M5moe, qwen3_5_moe.ADAPTER, MOE),
}


@pytest.fixture(scope="module", autouse=True)
def _few_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    config_cls, model_cls, module, adapter, extra = CASES[request.param]
    cfg = config_cls(**COMMON, **extra)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    with float64_module(module):  # transformers' pure-torch GDN and convolution, in float64
        torch.manual_seed(1)
        model = model_cls(cfg).to(torch.float64).eval()
        perturb_from_init(model)
        yield request.param, model, adapter


def test_logprobs_equal_transformers_and_round_trip_is_exact(case):
    kind, hf_model, adapter = case
    config = adapter.to_config(hf_model.config.to_dict())
    assert set(config.ffn_kinds) == {FFNKind.MOE if kind == "moe" else FFNKind.DENSE}
    sd = dict(hf_model.state_dict())
    model = HybridModel(config).to(torch.float64)
    model.load_state_dict(adapter.to_harts(sd, config), strict=True)
    assert parameter_counts(config).total == model.num_parameters() == sum(p.numel() for p in hf_model.parameters())
    rng = np.random.default_rng(0)
    for length in (3, 17):
        tokens = rng.integers(0, COMMON["vocab_size"], length)
        ids = torch.as_tensor(tokens)
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(ids[None]).logits[0], -1)
            h = model(ids, PackedContext(torch.tensor([0, length]), chunk_size=8)).hidden_TD
            ours = torch.log_softmax(h @ model.lm_head_weight.T, -1)
        rows = torch.arange(length - 1)
        err = (ours[rows, ids[1:]] - ref[rows, ids[1:]]).abs().max()
        assert float(err) <= 1e-9, float(err)
        assert float(ref[rows, ids[1:]].std()) > 0.1  # not a near-uniform model
    back = adapter.to_hf(adapter.to_harts(sd, config), config, hf_model.config.to_dict())
    assert sorted(back) == sorted(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_tree_rows_rotate_by_their_depth(case):
    """The multimodal RoPE as 1-D RoPE at the depth, in a tree: two branches of a shared
    prefix (the second branch's rows sit at row indices other than their depths) equal
    transformers' forward on each trajectory alone."""
    from harts.exec.tree_trainer import TreeTrainer
    from harts.tree.trajectory import Trajectory

    _, hf_model, adapter = case
    config = adapter.to_config(hf_model.config.to_dict())
    model = HybridModel(config).to(torch.float64)
    model.load_state_dict(adapter.to_harts(dict(hf_model.state_dict()), config), strict=True)
    rng = np.random.default_rng(2)
    prefix = rng.integers(0, COMMON["vocab_size"], 7)
    trajs = [Trajectory.make(f"t{n}", "g", np.concatenate([prefix, rng.integers(0, COMMON["vocab_size"], n)]))
             for n in (6, 4)]
    result = TreeTrainer(model).evaluate(trajs, 1 << 16)
    assert result.executed_rows == 7 + 6 + 4
    for t, lp in zip(trajs, result.logprobs, strict=True):
        ids = torch.as_tensor(t.tokens)
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(ids[None]).logits[0], -1)[:-1].gather(1, ids[1:, None])[:, 0]
        assert np.abs(lp[1:] - ref.numpy()).max() <= 1e-9, (t.id, np.abs(lp[1:] - ref.numpy()).max())


def test_the_multimodal_composite_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="model_type.*text_config"):
        qwen3_5.ADAPTER.to_config({"model_type": "qwen3_5", "text_config": {}})
    with pytest.raises(ConfigError, match="model_type"):
        qwen3_5_moe.ADAPTER.to_config({**COMMON, "model_type": "qwen3_5_text"})
