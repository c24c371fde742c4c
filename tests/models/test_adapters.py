"""The adapter registry, the kimi_linear config mapping and the registered Kimi-Linear-48B-A3B
shape (its parameter count against the published total)."""

from __future__ import annotations

import dataclasses

import pytest

from harts.config.models import PUBLISHED_PARAMS_B, ConfigError, ModelName, get_model_config
from harts.config.param_counts import parameter_counts
from harts.models.hf import (
    HFAdapter,
    HFModelType,
    get_adapter,
    register_adapter,
    supported_model_types,
)
from harts.models.hf.kimi_linear import ADAPTER, to_config

# config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct as published (the fields that
# shape the model; metadata such as auto_map left out)
KIMI_48B_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216, "moe_intermediate_size": 1024,
    "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 72,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "initializer_range": 0.02,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "rope_theta": 10000.0, "rope_scaling": None, "model_max_length": 1048576,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "num_experts": 256, "num_experts_per_token": 8, "num_expert_group": 1, "topk_group": 1,
    "num_shared_experts": 1, "routed_scaling_factor": 2.446, "use_grouped_topk": True, "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128, "num_heads": 32,
        "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
    },
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "use_cache": True,
}


def test_registry_knows_kimi_linear_and_refuses_unknown_types():
    assert "kimi_linear" in supported_model_types()
    assert get_adapter("kimi_linear") is ADAPTER
    with pytest.raises(ConfigError) as err:
        get_adapter("llama")
    msg = str(err.value)
    assert "config.json" in msg and "model_type" in msg and "'llama'" in msg and "kimi_linear" in msg


def test_registry_refuses_duplicates_and_names_outside_the_enum():
    with pytest.raises(ConfigError, match="registered twice"):
        register_adapter(ADAPTER)
    with pytest.raises(ConfigError, match="HFModelType"):
        register_adapter(dataclasses.replace(ADAPTER, model_type="llama"))
    assert isinstance(ADAPTER, HFAdapter) and HFModelType(ADAPTER.model_type) is HFModelType.KIMI_LINEAR


def test_the_published_config_maps_to_the_registered_shape():
    got = to_config(KIMI_48B_CONFIG)
    want = get_model_config(ModelName.KIMI_LINEAR_48B)
    assert dataclasses.replace(got, name=want.name) == want
    assert [i + 1 for i, k in enumerate(want.layer_kinds) if k.value == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert want.ffn_kinds.count(want.ffn_kinds[0]) == 1  # one dense layer first


def test_kimi_linear_48b_parameter_count_matches_the_published_total():
    counts = parameter_counts(get_model_config(ModelName.KIMI_LINEAR_48B))
    total_b, active_b = PUBLISHED_PARAMS_B[ModelName.KIMI_LINEAR_48B]
    # the model's name rounds: 49.1B counted (48B named), 3.5B active with the embedding
    # and head (A3B named)
    assert abs(counts.total / 1e9 - total_b) / total_b < 0.03
    assert abs(counts.active / 1e9 - active_b) / active_b < 0.2
    assert counts.by_component["routed_experts"] == 26 * 256 * 3 * 2304 * 1024


@pytest.mark.parametrize("changes, field", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
    ({"moe_capacity_factor": 1.0}, "moe_capacity_factor"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"num_experts": 256, "num_local_experts": 128}, "num_local_experts"),
    ({"mlp_layer_types": ["sparse"] + ["dense"] * 26}, "mlp_layer_types"),
    ({"linear_attn_config": {**KIMI_48B_CONFIG["linear_attn_config"], "gate_low_rank": 8}}, "linear_attn_config.gate_low_rank"),
    ({"model_type": "qwen3_next"}, "model_type"),
])
def test_unsupported_values_are_refused_naming_the_field(changes, field):
    with pytest.raises(ConfigError) as err:
        to_config({**KIMI_48B_CONFIG, **changes})
    assert field in str(err.value) and "config.json" in str(err.value)


def test_sim_prices_a_checkpoint_directory_by_its_config(tmp_path, capsys):
    import json

    from harts.cli.main import main

    (tmp_path / "config.json").write_text(json.dumps(KIMI_48B_CONFIG))  # the shapes need no weights
    common = ["sim", "--workload", "swe-treestep-8", "--gpus", "8", "--json"]
    assert main([*common, "--model-path", str(tmp_path)]) == 0
    by_path = json.loads(capsys.readouterr().out)
    assert main([*common, "--model", "kimi-linear-48b-a3b"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    assert by_path["step_seconds"] == by_name["step_seconds"] > 0
    assert by_path["peak_memory_bytes"] == by_name["peak_memory_bytes"]


@pytest.mark.parametrize("changes, field", [
    ({"layer_kind_list": ("kda", "mla")}, "layer_kind_list"),  # 4 layers
    ({"layer_kind_list": ("kda", "kda", "xyz", "mla")}, "layer_kind_list"),
    ({"router": "softmax", "router_groups": 2}, "router_groups"),
    ({"router": "sigmoid", "router_groups": 3}, "router_groups"),  # 8 experts do not split in 3
    ({"router": "sigmoid", "router_groups": 4, "router_topk_groups": 5}, "router_topk_groups"),
    ({"router": "sigmoid", "router_groups": 4, "router_topk_groups": 1, "top_k": 3}, "router_topk_groups"),
    ({"routed_scaling_factor": 0.0}, "routed_scaling_factor"),
    ({"mla_norm_eps": -1.0}, "mla_norm_eps"),
    ({"kda_gate_bias": 1}, "kda_gate_bias"),
])
def test_new_model_fields_are_validated(changes, field):
    base = get_model_config("tiny-cpu")
    with pytest.raises(ConfigError, match=field):
        base.replace(**changes)
