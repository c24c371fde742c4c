"""Model configs as data: registry, validation, layer pattern, Table 1 parameter counts."""

from __future__ import annotations

import json

import pytest

from harts.cli.main import main
from harts.config.models import (
    TABLE1_PARAMS_B,
    ConfigError,
    FFNKind,
    LayerKind,
    ModelName,
    get_model_config,
    known_models,
)
from harts.config.param_counts import parameter_counts


def test_registry_lists_every_name_and_fails_loudly_on_unknown():
    assert known_models() == [n.value for n in ModelName]
    for name in ModelName:
        assert get_model_config(name).name == name.value
        assert get_model_config(name.value) is get_model_config(name)
    with pytest.raises(ConfigError, match="unknown model 'tiny-gpu'.*tiny-cpu, tiny, flash"):
        get_model_config("tiny-gpu")


@pytest.mark.parametrize("name", [ModelName.TINY, ModelName.FLASH])
def test_table1_parameter_counts_within_3_percent(name):
    counts = parameter_counts(get_model_config(name))
    total_b, active_b = TABLE1_PARAMS_B[name]
    assert abs(counts.total / (total_b * 1e9) - 1) <= 0.03, counts.total
    assert abs(counts.active / (active_b * 1e9) - 1) <= 0.03, counts.active
    assert counts.total == sum(counts.by_component.values())
    assert counts.active == sum(counts.active_by_component.values())
    assert counts.active < counts.total


def test_table1_structure():
    tiny, flash = get_model_config("tiny"), get_model_config("flash")
    assert (tiny.num_layers, tiny.num_kda_layers, tiny.num_mla_layers) == (24, 18, 6)
    assert (flash.num_layers, flash.num_kda_layers, flash.num_mla_layers) == (42, 35, 7)
    assert (tiny.num_experts, tiny.top_k, tiny.num_dense_layers, tiny.num_moe_layers) == (128, 8, 1, 23)
    assert (flash.num_experts, flash.top_k, flash.num_moe_layers) == (512, 8, 42 - flash.num_dense_layers)
    assert flash.num_dense_layers in (1, 2)
    # every group is kda_per_mla KDA layers then one MLA layer
    assert tiny.layer_kinds[:4] == (LayerKind.KDA,) * 3 + (LayerKind.MLA,)
    assert flash.layer_kinds[:6] == (LayerKind.KDA,) * 5 + (LayerKind.MLA,)
    assert tiny.ffn_kinds[:2] == (FFNKind.DENSE, FFNKind.MOE)
    for c in (tiny, flash):
        assert not c.use_rope and c.capacity_factor is None and c.chunk_size == 64 and c.conv_window == 4


def test_active_counts_only_top_k_routed_experts():
    c = get_model_config("tiny-cpu")
    counts = parameter_counts(c)
    routed = counts.by_component["routed_experts"]
    assert routed == c.num_moe_layers * c.num_experts * 3 * c.d_model * c.expert_ffn_dim
    assert counts.active_by_component["routed_experts"] * c.num_experts == routed * c.top_k
    assert counts.total - counts.active == routed - counts.active_by_component["routed_experts"]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"top_k": 9}, r"top_k: must be in \[1, num_experts=8\]"),
        ({"top_k": 0}, r"top_k: must be in \[1, num_experts=8\]"),
        ({"num_layers": 6}, "KDA:MLA ratio of 3:1 needs num_layers to be a multiple of 4"),
        ({"kda_per_mla": -1}, "kda_per_mla: must be >= 0"),
        ({"kda_head_dim": 0}, "kda_head_dim: must be >= 1"),
        ({"d_model": 64.0}, "d_model: must be an integer"),
        ({"use_rope": True, "qk_rope_head_dim": 7}, "qk_rope_head_dim: RoPE rotates pairs"),
        ({"num_dense_layers": 5}, "num_dense_layers: 5 > num_layers 4"),
        ({"num_experts": 0}, "num_experts: MoE layers need at least one routed expert"),
        ({"router": "relu"}, "router: must be 'softmax' or 'sigmoid'"),
        ({"capacity_factor": 0.0}, "capacity_factor: must be > 0 or None"),
        ({"norm_eps": 0.0}, "norm_eps: must be > 0"),
        ({"q_lora_rank": 0}, "q_lora_rank: must be >= 1"),
    ],
)
def test_validate_names_the_bad_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        get_model_config("tiny-cpu").replace(**changes)


def test_dense_only_and_all_mla_configs_are_valid():
    c = get_model_config("tiny-cpu").replace(num_dense_layers=4, num_experts=0, top_k=0, kda_per_mla=0)
    assert c.num_moe_layers == 0 and c.num_kda_layers == 0 and c.num_mla_layers == 4
    assert parameter_counts(c).total == parameter_counts(c).active


def test_tree_mode_refuses_token_dropping():
    c = get_model_config("tiny-cpu")
    c.check_tree_mode()
    with pytest.raises(ConfigError, match="token dropping breaks the tree/expanded equivalence"):
        c.replace(capacity_factor=1.25).check_tree_mode()


def test_cli_model_params(capsys):
    assert main(["model", "params"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "flash" in out and "7.900B" in out and "124.000B" in out
    assert main(["model", "params", "--model", "flash", "--json"]) == 0
    (rec,) = json.loads(capsys.readouterr().out)
    counts = parameter_counts(get_model_config("flash"))
    assert (rec["model"], rec["total"], rec["active"]) == ("flash", counts.total, counts.active)
    assert rec["table1_total"] == 124_000_000_000
    assert main(["model", "params", "--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_layer_ratio_by_the_models_own_kinds(capsys):
    from harts.config.models import layer_ratio, linear_attention_label

    assert layer_ratio(get_model_config("tiny")) == "KDA:MLA 3:1"
    assert layer_ratio(get_model_config("kimi-linear-48b-a3b")) == "KDA:MLA 20:7"
    qwen = get_model_config("qwen3-next-80b-a3b")  # 36 Gated DeltaNet + 12 gated attention layers
    assert layer_ratio(qwen) == "GDN:attn 3:1" and linear_attention_label(qwen) == "GDN"
    assert layer_ratio(get_model_config("tiny-cpu").replace(kda_per_mla=0, num_layers=2)) == "MLA only"
    mixed = get_model_config("tiny-cpu").replace(layer_kind_list=("gdn", "gated_attention", "kda", "mla"))
    assert layer_ratio(mixed) == "KDA:MLA:GDN:attn 1:1:1:1" and linear_attention_label(mixed) == "KDA/GDN"

    assert main(["model", "params"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "GDN:attn 3:1" in rows["qwen3-next-80b-a3b"] and "KDA" not in rows["qwen3-next-80b-a3b"]
    assert "KDA:MLA 20:7" in rows["kimi-linear-48b-a3b"] and "KDA:MLA 3:1" in rows["tiny"]
    assert main(["model", "params", "--model", "qwen3-next-80b-a3b", "--json"]) == 0
    (rec,) = json.loads(capsys.readouterr().out)
    assert rec["layer_ratio"] == "GDN:attn 3:1" and rec["layer_kinds"] == {"gdn": 36, "gated_attention": 12}
