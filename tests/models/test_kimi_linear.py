"""Kimi-Linear checkpoints against transformers' own `KimiLinearForCausalLM`, in float64.

A tiny random model built with transformers' classes (dense first layer, KDA, MLA with a
q LoRA, MoE with grouped top-k routing, a correction bias and routed scaling) is saved with
`save_pretrained` and loaded by HARTS. Rollout groups fork inside the first KDA chunk,
exactly on a chunk boundary, one past it, and several times in depth. `harts logprobs`
(tree execution) must equal transformers' per-trajectory forward at every position,
`harts verify --model-path` must find tree == expanded, a trained checkpoint must come back
through `from_pretrained` bit for bit, and malformed or unsupported checkpoints must be
refused in one line with nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

from harts.cli.main import main  # noqa: E402
from harts.models import load, save  # noqa: E402
from harts.models.hf.io import read_checkpoint  # noqa: E402
from harts.tree import Trajectory  # noqa: E402
from harts.tree.io import save_jsonl  # noqa: E402
from tests.models.float64_reference import float64_module, torch_only_modeling  # noqa: E402

# the reference: transformers' modeling code on its pure-torch KDA and convolution
modeling_kimi_linear = torch_only_modeling("transformers.models.kimi_linear.modeling_kimi_linear")

VOCAB = 96
CHUNK = 64  # the model's KDA chunk size (ModelConfig.chunk_size of a kimi_linear checkpoint)


def _hf_model(**over):
    kw = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=12,
        qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=2, topk_group=1, num_experts_per_tok=2,
        num_local_experts=8, n_shared_experts=1, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
        linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 8, "num_heads": 2,
                            "short_conv_kernel_size": 4},
        first_k_dense_replace=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    kw.update(over)
    torch.manual_seed(0)
    model = modeling_kimi_linear.KimiLinearForCausalLM(KimiLinearConfig(**kw)).to(torch.float64).eval()
    with torch.no_grad():  # off the trivial init: correction biases and norm weights matter
        for m in model.modules():
            if isinstance(m, modeling_kimi_linear.KimiLinearTopkRouter):
                m.e_score_correction_bias.normal_(0.0, 0.1)
            if isinstance(m, (modeling_kimi_linear.KimiLinearRMSNorm, modeling_kimi_linear.KimiLinearRMSNormGated)):
                m.weight.normal_(1.0, 0.1)
    model.set_experts_implementation("eager")
    model.set_attn_implementation("eager")
    return model


def _trajectories(seed: int = 0) -> list[Trajectory]:
    """Groups whose trees fork inside the first chunk, on a chunk boundary, one past it, and deep."""
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(0, VOCAB, n)  # noqa: E731
    shapes = {  # group -> (shared prefix, [(second prefix, [tails])] ...)
        "inside": [20, [(0, [15, 7]), (9, [4, 11])]],
        "boundary": [CHUNK, [(0, [10, 3])]],
        "past": [CHUNK + 1, [(0, [6, 12])]],
        "deep": [30, [(40, [60, 5]), (CHUNK + 2, [8, 1])]],
    }
    out = []
    for group, (prefix_len, branches) in shapes.items():
        prefix = tok(prefix_len)
        for b, (mid_len, tails) in enumerate(branches):
            mid = tok(mid_len)
            for t, tail_len in enumerate(tails):
                tokens = np.concatenate([prefix, mid, tok(tail_len)])
                mask = np.ones(tokens.size, dtype=bool)
                mask[: prefix_len] = False  # the prompt is not trained on; its log-probs are still output
                out.append(Trajectory.make(f"{group}-{b}-{t}", group, tokens, loss_mask=mask,
                                           advantage=float(rng.normal()), old_logprobs=np.zeros(tokens.size)))
    return out


@pytest.fixture(scope="module")
def hf_model():
    return _hf_model()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, hf_model) -> Path:
    path = tmp_path_factory.mktemp("kimi") / "tiny-kimi"
    hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> tuple[Path, list[Trajectory]]:
    trajs = _trajectories()
    path = tmp_path_factory.mktemp("rollouts") / "rollouts.jsonl"
    save_jsonl(trajs, path)
    return path, trajs


def _reference(model, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' per-trajectory forward: (log-prob of token p from the logits at p-1, entropy)."""
    with torch.no_grad(), float64_module(modeling_kimi_linear):
        logits = model(torch.as_tensor(tokens)[None]).logits[0]
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp[:-1].gather(1, torch.as_tensor(tokens[1:])[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)[:-1]
    return lp.numpy(), ent.numpy()


def test_the_trees_fork_where_the_test_says(rollouts):
    _, trajs = rollouts
    forks = {g: sorted({_common(a.tokens, b.tokens) for a in trajs for b in trajs
                        if a.group == b.group == g and a is not b}) for g in ("inside", "boundary", "past", "deep")}
    assert forks["inside"][0] == 20 < CHUNK  # inside the first chunk (and again at 29)
    assert forks["boundary"] == [CHUNK]  # exactly on a chunk boundary
    assert forks["past"] == [CHUNK + 1]  # one past it
    assert forks["deep"] == [30, 70, 30 + CHUNK + 2]  # forks on forks, past the second chunk
    assert max(len(t) for t in trajs) > 2 * CHUNK


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def test_logprobs_equal_transformers_at_every_position(ckpt, rollouts, hf_model, tmp_path, capsys):
    path, trajs = rollouts
    out = tmp_path / "logprobs.jsonl"
    rc = main(["logprobs", "--model-path", str(ckpt), "--input", str(path), "--out", str(out),
               "--dtype", "float64", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compact_tokens"] < summary["expanded_tokens"]  # shared rows computed once
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [t.id for t in trajs]
    for rec, t in zip(lines, trajs, strict=True):
        assert len(rec["logprobs"]) == len(t) and rec["logprobs"][0] is None and rec["entropy"][0] is None
        lp_ref, ent_ref = _reference(hf_model, t.tokens)
        lp = np.array(rec["logprobs"][1:], dtype=np.float64)
        ent = np.array(rec["entropy"][1:], dtype=np.float64)
        np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-9)
        np.testing.assert_allclose(ent, ent_ref, rtol=0, atol=1e-9)


def test_verify_tree_equals_expanded(ckpt, rollouts, capsys):
    path, _ = rollouts
    rc = main(["verify", "--model-path", str(ckpt), "--input", str(path), "--dtype", "float64", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["passed"] is True
    assert report["max_rel_logprob_err"] <= 1e-10
    assert report["max_rel_grad_err"] <= 1e-10
    assert report["compact_tokens"] < report["expanded_tokens"]


@pytest.mark.parametrize("spec", ["tp=2", "dp=2"])
def test_verify_parallel_from_a_checkpoint_equals_expanded(ckpt, rollouts, capsys, spec):
    """Every worker starts from the checkpoint's weights; tp=2 with sequence parallel on
    this model's KDA, MLA, dense FFN and shared experts."""
    path, _ = rollouts
    rc = main(["verify", "--model-path", str(ckpt), "--input", str(path), "--dtype", "float64", "--parallel", spec,
               "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["passed"] is True, report
    assert report["world_size"] == 2 and spec in report["parallel"]
    assert report["max_rel_logprob_err"] <= 1e-10 and report["max_rel_grad_err"] <= 1e-10


def test_train_parallel_from_a_checkpoint_takes_the_single_process_steps(ckpt, rollouts, capsys, tmp_path):
    """`harts train --model-path --parallel dp=1` (the distributed path on one rank) trains
    the checkpoint's weights: its steps equal `harts train --model-path`'s."""
    path, _ = rollouts
    args = ["train", "--model-path", str(ckpt), "--input", str(path), "--mode", "tree", "--steps", "2",
            "--old-logprobs", "input", "--dtype", "float64", "--json"]
    assert main(args) == 0
    single = json.loads(capsys.readouterr().out)["steps"]
    assert main([*args, "--parallel", "dp=1"]) == 0
    dist_steps = json.loads(capsys.readouterr().out)["steps"]
    for a, b in zip(dist_steps, single, strict=True):
        for key in ("loss", "pg_loss", "aux_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-10 * max(1.0, abs(b[key])), (key, a[key], b[key])
    # a distributed run writes torch.distributed.checkpoint shards, not --save's directory
    assert main([*args, "--parallel", "dp=1", "--save", str(tmp_path / "out")]) == 2
    assert "--checkpoint-dir" in capsys.readouterr().out and not (tmp_path / "out").exists()


def test_round_trip_after_a_training_step_is_exact(ckpt, rollouts, tmp_path):
    from harts.exec.loss import PolicyLossConfig
    from harts.exec.tree_trainer import TreeTrainer

    _, trajs = rollouts
    loaded = load(ckpt, dtype=torch.float64)
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    trainer = TreeTrainer(loaded.model, loss=PolicyLossConfig())
    trainer.step(trainer.recompute_old_logprobs(trajs, 1 << 16), 1 << 16)
    after = loaded.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in after)
    out = save(loaded, tmp_path / "trained")
    assert json.loads((out / "config.json").read_text()) == json.loads((ckpt / "config.json").read_text())
    back, info = KimiLinearForCausalLM.from_pretrained(out, dtype=torch.float64, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    expected = loaded.adapter.to_hf(after, loaded.config, loaded.hf_config)
    # transformers' runtime layout: stacked convs and experts, the forget gate as a module
    got = back.state_dict()
    for i, kind in enumerate(loaded.config.layer_kinds):
        p = f"model.layers.{i}."
        if kind.value == "kda":
            conv = torch.cat([expected.pop(f"{p}self_attn.{x}_conv1d.weight") for x in "qkv"])
            assert torch.equal(got.pop(f"{p}self_attn.conv1d.weight"), conv)
            for n in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
                expected[f"{p}self_attn.forget_gate.{n}"] = expected.pop(f"{p}self_attn.{n}")
    for name in list(expected):
        if ".block_sparse_moe." in name:
            expected[name.replace(".block_sparse_moe.", ".mlp.")] = expected.pop(name)
    for i, ffn in enumerate(loaded.config.ffn_kinds):
        if ffn.value == "moe":
            e = f"model.layers.{i}.mlp.experts."
            E = loaded.config.num_experts
            gate_up = torch.stack([torch.cat([expected.pop(f"{e}{j}.w1.weight"), expected.pop(f"{e}{j}.w3.weight")])
                                   for j in range(E)])
            down = torch.stack([expected.pop(f"{e}{j}.w2.weight") for j in range(E)])
            assert torch.equal(got.pop(e + "gate_up_proj"), gate_up)
            assert torch.equal(got.pop(e + "down_proj"), down)
    assert set(got) == set(expected)
    # transformers keeps some tensors in float32 whatever dtype is asked for (its
    # `_keep_in_fp32_modules_strict`: dt_bias since 5.24): those load as the float32 rounding
    # of the saved values; every other one exactly. The files themselves hold the trained
    # float64 weights exactly.
    keep32 = [*(getattr(back, "_keep_in_fp32_modules_strict", None) or [])]
    for name, t in expected.items():
        if any(k in name for k in keep32) and got[name].dtype == torch.float32:
            assert torch.equal(got[name], t.to(torch.float32)), name
        else:
            assert got[name].dtype == torch.float64 and torch.equal(got[name], t), name
    written = read_checkpoint(out).tensors
    saved = loaded.adapter.to_hf(after, loaded.config, loaded.hf_config)
    assert written.keys() == saved.keys()
    for name, t in saved.items():
        assert written[name].dtype == torch.float64 and torch.equal(written[name], t), name


def test_save_keeps_each_tensors_dtype_and_shards(ckpt, tmp_path):
    loaded = load(ckpt, dtype=torch.float32)
    out = save(loaded, tmp_path / "sharded", shard_bytes=64 * 1024)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = load(out)
    assert all(dt == torch.float64 for dt in again.source_dtypes.values())
    for k, v in again.model.state_dict().items():
        assert torch.equal(v, loaded.model.state_dict()[k].to(torch.float64)), k


def test_train_model_path_save(ckpt, rollouts, tmp_path, capsys):
    path, _ = rollouts
    out = tmp_path / "ckpt-out"
    rc = main(["train", "--model-path", str(ckpt), "--input", str(path), "--mode", "tree", "--steps", "1",
               "--old-logprobs", "input", "--dtype", "float64", "--save", str(out), "--json"])
    assert rc == 0
    assert f"wrote {out}" in capsys.readouterr().err
    back, info = KimiLinearForCausalLM.from_pretrained(out, dtype=torch.float64, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    src = KimiLinearForCausalLM.from_pretrained(ckpt, dtype=torch.float64)
    assert not torch.equal(back.lm_head.weight, src.lm_head.weight)  # the step changed the weights


# ---------------------------------------------------------------------------------------
# Refusals: exit code 2, one line naming file / field / tensor, nothing written


def _copy(ckpt: Path, tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(ckpt, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _refused(args: list[str], capsys, *must_name: str) -> str:
    rc = main(args)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    for word in must_name:
        assert word in err, (word, err)
    return err


def _bad(ckpt: Path, tmp_path: Path, kind: str) -> tuple[Path, tuple[str, ...]]:
    bad = _copy(ckpt, tmp_path, kind)
    if kind == "hidden_act":
        _edit_config(bad, hidden_act="gelu")
        return bad, ("config.json", "hidden_act", "gelu")
    if kind == "capacity":
        _edit_config(bad, moe_capacity_factor=1.25)
        return bad, ("config.json", "moe_capacity_factor")
    if kind == "model_type":
        _edit_config(bad, model_type="llama")
        return bad, ("config.json", "model_type", "llama", "kimi_linear")
    if kind == "pickle":
        from safetensors.torch import load_file

        torch.save(load_file(bad / "model.safetensors"), bad / "pytorch_model.bin")
        (bad / "model.safetensors").unlink()
        return bad, ("pytorch_model.bin", "allow-pickle")
    if kind == "truncated":
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
        return bad, ("model.safetensors", "truncated")
    if kind == "shape":
        _edit_config(bad, intermediate_size=44)
        return bad, ("model.safetensors", "model.layers.0.block_sparse_moe.", "shape")
    if kind == "missing_shard":
        loaded = load(ckpt)
        shutil.rmtree(bad)
        save(loaded, bad, shard_bytes=64 * 1024)
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        shard = sorted(set(index["weight_map"].values()))[1]
        (bad / shard).unlink()
        return bad, (shard, "missing shard")
    if kind == "missing_tensor":
        from safetensors.torch import load_file, save_file

        tensors = load_file(bad / "model.safetensors")
        del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
        save_file(tensors, bad / "model.safetensors")
        return bad, ("model.safetensors", "model.layers.2.self_attn.kv_b_proj.weight", "missing")
    raise AssertionError(kind)


REFUSALS = ["hidden_act", "capacity", "model_type", "pickle", "truncated", "shape", "missing_shard", "missing_tensor"]


@pytest.mark.parametrize("kind", REFUSALS)
def test_a_bad_checkpoint_is_refused_and_nothing_is_written(ckpt, rollouts, tmp_path, capsys, kind):
    bad, names = _bad(ckpt, tmp_path, kind)
    path, _ = rollouts
    out = tmp_path / "out.jsonl"
    _refused(["logprobs", "--model-path", str(bad), "--input", str(path), "--out", str(out)], capsys, *names)
    assert not out.exists()
    saved = tmp_path / "saved"
    _refused(["train", "--model-path", str(bad), "--input", str(path), "--steps", "1", "--save", str(saved)],
             capsys, *names)
    assert not saved.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [kind]  # no temporary files left either


def test_pickle_checkpoint_loads_when_asked(ckpt, tmp_path):
    bad, _ = _bad(ckpt, tmp_path, "pickle")
    a, b = load(bad, allow_pickle=True), load(ckpt)
    assert all(torch.equal(v, b.model.state_dict()[k]) for k, v in a.model.state_dict().items())


def test_model_path_and_model_are_exclusive(ckpt, capsys):
    rc = main(["verify", "--model", "tiny-cpu", "--model-path", str(ckpt), "--json"])
    assert rc == 2
    assert "not allowed with" in json.loads(capsys.readouterr().out)["error"]


def test_bf16_routing_is_the_checkpoints(ckpt, hf_model):
    # transformers routes in float32 whatever the model's dtype; so does the loaded model
    loaded = load(ckpt, dtype=torch.bfloat16)
    layer = next(i for i, k in enumerate(loaded.config.ffn_kinds) if k.value == "moe")
    ours = loaded.model.layers[layer].ffn
    theirs = modeling_kimi_linear.KimiLinearTopkRouter(hf_model.config)
    with torch.no_grad():
        theirs.weight.copy_(hf_model.model.layers[layer].mlp.gate.weight.to(torch.bfloat16))
        theirs.e_score_correction_bias.copy_(hf_model.model.layers[layer].mlp.gate.e_score_correction_bias)
        x = torch.randn(257, loaded.config.d_model, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        _, w_ref, i_ref = theirs.to(torch.bfloat16)(x)
        _, i_got, w_got = ours.route(x)
    order_ref, order_got = i_ref.argsort(-1), i_got.argsort(-1)
    assert torch.equal(i_ref.gather(1, order_ref), i_got.gather(1, order_got))
    assert torch.equal(w_ref.gather(1, order_ref), w_got.gather(1, order_got).to(w_ref.dtype))


VARIANTS = [
    # full-rank q, one expert group, weights not renormalised, tied flag (transformers never ties)
    {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "tie_word_embeddings": True},
    # two dense layers, MLA first, four groups keeping two, no shared-prefix help from layer 0's KDA
    {"first_k_dense_replace": 2, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "rms_norm_eps": 1e-6,
     "linear_attn_config": {"kda_layers": [2, 3], "full_attn_layers": [1, 4], "head_dim": 8, "num_heads": 3,
                            "short_conv_kernel_size": 3}},
]


@pytest.mark.parametrize("over", VARIANTS, ids=["full-q-unnormalised", "mla-first-grouped"])
def test_config_variants_equal_transformers(over, tmp_path):
    model = _hf_model(**over)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load(tmp_path / "ckpt")
    from harts.exec.tree_trainer import TreeTrainer

    rng = np.random.default_rng(3)
    prefix = rng.integers(0, VOCAB, 9)
    trajs = [Trajectory.make(f"t{i}", "g", np.concatenate([prefix, rng.integers(0, VOCAB, n)]))
             for i, n in enumerate((12, 5))]
    result = TreeTrainer(loaded.model).evaluate(trajs, 1 << 16)
    for t, lp, ent in zip(trajs, result.logprobs, result.entropy, strict=True):
        lp_ref, ent_ref = _reference(model, t.tokens)
        np.testing.assert_allclose(lp[1:], lp_ref, rtol=0, atol=1e-9)
        np.testing.assert_allclose(ent[1:], ent_ref, rtol=0, atol=1e-9)


def test_load_then_save_writes_the_same_bf16_tensors(tmp_path):
    from safetensors.torch import load_file

    _hf_model().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded = load(tmp_path / "bf16")
    assert loaded.model.lm_head_weight.dtype == torch.bfloat16  # the checkpoint's dtype by default
    out = save(loaded, tmp_path / "out")
    src, got = load_file(tmp_path / "bf16" / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(src) == set(got)
    for name, t in src.items():
        assert got[name].dtype == t.dtype == torch.bfloat16 and torch.equal(got[name], t), name
    assert (out / "generation_config.json").read_text() == (tmp_path / "bf16" / "generation_config.json").read_text()
