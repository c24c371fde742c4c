"""`--model-path` errors under --json name where the problem is: an unsupported config
value as `file` = the config.json and `field` = its config field (not the flag); an
unreadable weights file as `file` = that file (the shard, not the directory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harts.cli.main import main
from harts.config.models import ConfigError
from harts.models.hf import config_field
from harts.models.hf.io import write_checkpoint
from tests.models.test_adapters import KIMI_48B_CONFIG

# a small Qwen3-Next config.json (the fields that shape the model)
QWEN3_NEXT = {
    "model_type": "qwen3_next", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "decoder_sparse_step": 1, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8,
    "num_experts_per_tok": 2, "num_experts": 4, "norm_topk_prob": True,
}


def _config_dir(tmp_path: Path, cfg: dict) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _json_error(argv: list[str], capsys) -> dict:
    assert main([*argv, "--json"]) == 2
    out = capsys.readouterr().out
    return json.loads(out)


@pytest.mark.parametrize("cfg, field", [
    ({**QWEN3_NEXT, "hidden_act": "gelu"}, "hidden_act"),
    ({**QWEN3_NEXT, "rope_parameters": {"rope_type": "yarn"}}, "rope_parameters.rope_type"),
    ({**QWEN3_NEXT, "model_type": "llama"}, "model_type"),
    ({**KIMI_48B_CONFIG, "hidden_act": "gelu"}, "hidden_act"),
    ({**KIMI_48B_CONFIG, "linear_attn_config": {**KIMI_48B_CONFIG["linear_attn_config"], "gate_low_rank": 8}},
     "linear_attn_config.gate_low_rank"),
    # mapped, then refused by HARTS's own ModelConfig: the message names no config.json field
    ({**QWEN3_NEXT, "linear_num_value_heads": 3}, None),
])
def test_an_unsupported_config_value_names_the_file_and_the_field(cfg, field, tmp_path, capsys):
    d = _config_dir(tmp_path, cfg)
    for argv in (["model", "params", "--model-path", str(d)],
                 ["sim", "--workload", "tiny-treestep", "--gpus", "1", "--model-path", str(d)]):
        err = _json_error(argv, capsys)
        assert (err["file"], err["field"]) == (str(d / "config.json"), field), (argv, err)


def _rollouts(tmp_path: Path) -> Path:
    rec = {"id": "a", "group": "g", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "advantage": 1.0,
           "old_logprobs": [0, 0, 0]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    return path


@pytest.mark.parametrize("shard_bytes", [4000, 1 << 20], ids=["sharded", "one-file"])
def test_a_truncated_weights_file_is_named_not_its_folder(shard_bytes, tmp_path, capsys):
    d = tmp_path / "ckpt"
    write_checkpoint(d, QWEN3_NEXT, {"a": torch.zeros(1000), "b": torch.zeros(1000)}, shard_bytes=shard_bytes)
    weights = sorted(d.glob("*.safetensors"))
    bad = weights[-1]
    bad.write_bytes(bad.read_bytes()[:100])
    rollouts = _rollouts(tmp_path)
    for argv in (["logprobs", "--model-path", str(d), "--input", str(rollouts), "--out", str(tmp_path / "o.jsonl")],
                 ["verify", "--model-path", str(d), "--input", str(rollouts)]):
        err = _json_error(argv, capsys)
        assert err["file"] == str(bad) and "truncated or corrupt" in err["error"], err
    bad.unlink()
    if shard_bytes == 4000:  # a shard the index lists is missing
        err = _json_error(["logprobs", "--model-path", str(d), "--input", str(rollouts), "--out",
                           str(tmp_path / "o.jsonl")], capsys)
        assert err["file"] == str(bad) and "missing shard" in err["error"], err


def test_config_field_reads_the_adapters_messages():
    cases = {
        "config.json: field 'hidden_act' is 'gelu'; only SiLU": "hidden_act",
        "config.json: fields 'num_experts' and 'n_routed_experts' disagree (1, 2)": "num_experts",
        "config.json: field 'linear_attn_config.kda_layers' holds 0": "linear_attn_config.kda_layers",
        "rope_parameters.rope_type: 'yarn' is not supported": "rope_parameters.rope_type",
        "num_hidden_layers: missing from the checkpoint's config": "num_hidden_layers",
        "config.json: dense_ffn_dim: must be >= 1": None,
        "qwen3_next config: gdn_num_v_heads: must be a multiple": None,
        "something else entirely": None,
    }
    assert {m: config_field(ConfigError(m)) for m in cases} == cases
