"""`harts verify` names its linear-attention rows by the model's own kind: "KDA" for a
Kimi-Linear-shaped model, "GDN" for a Qwen3-Next-shaped checkpoint (Gated DeltaNet and
gated attention layers), whose recurrence runs through the same tree path."""

from __future__ import annotations

import json

import pytest
import torch

from harts.cli.main import main
from harts.exec.model.model import build_model
from harts.models import LoadedModel, save
from harts.models.hf.qwen3_next import ADAPTER
from harts.tree import save_jsonl
from harts.tree.workload import generate, preset
from harts.verify import equivalence
from harts.verify.equivalence import verify_step

# a small Qwen3-Next config.json: GDN, gated attention (GQA, partial RoPE), MoE and a dense layer
QWEN3_NEXT = dict(
    model_type="qwen3_next", vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    linear_conv_kernel_dim=4, linear_key_head_dim=6, linear_value_head_dim=5,
    linear_num_key_heads=2, linear_num_value_heads=4,
    moe_intermediate_size=10, shared_expert_intermediate_size=14, num_experts_per_tok=2, num_experts=4,
    mlp_only_layers=[1], norm_topk_prob=True, rms_norm_eps=1e-6, initializer_range=0.3,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
)


@pytest.fixture
def rollouts(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    trajectories = generate(preset("tiny-treestep", vocab_size=QWEN3_NEXT["vocab_size"])).trajectories()
    save_jsonl(trajectories[:4], path)  # one group's tree, forks included
    return path


@pytest.fixture
def qwen3_next_checkpoint(tmp_path):
    config = ADAPTER.to_config(QWEN3_NEXT)
    model = build_model(config, seed=0, dtype=torch.float32)
    out = tmp_path / "tiny-qwen3-next"
    save(LoadedModel(model, config, dict(QWEN3_NEXT), ADAPTER), out)
    return out


def _rows(text: str) -> dict[str, str]:
    return {line.split("  ")[0]: line for line in text.splitlines()}


def test_verify_names_gated_deltanet_rows_gdn(qwen3_next_checkpoint, rollouts, capsys, monkeypatch):
    reports = []

    def kept(*args, **kwargs):  # the report the table is printed from (one run, not two)
        reports.append(verify_step(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(equivalence, "verify_step", kept)
    argv = ["verify", "--model-path", str(qwen3_next_checkpoint), "--input", str(rollouts), "--dtype", "float64"]
    assert main(argv) == 0
    rows = _rows(capsys.readouterr().out)
    assert "GDN rounds (most in a microbatch)" in rows
    assert "GDN layer bit-identical" in rows and "GDN layer max abs err" in rows
    assert not [r for r in rows if r.startswith("KDA")]
    (rep,) = reports
    assert rep["linear_attention"] == "GDN" and rep["kda_layer_kind"] == "GDN"
    assert rep["kda_layer"]["replay"]["bit_identical"]


def test_verify_names_kda_rows_kda(rollouts, capsys):
    assert main(["verify", "--input", str(rollouts), "--dtype", "float64", "--model", "tiny-cpu"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert "KDA rounds (most in a microbatch)" in rows and "KDA layer bit-identical" in rows
    assert not [r for r in rows if r.startswith("GDN")]
    assert main(["verify", "--input", str(rollouts), "--dtype", "float64", "--model", "tiny-cpu", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["linear_attention"] == "KDA" and rep["kda_layer_kind"] == "KDA"
