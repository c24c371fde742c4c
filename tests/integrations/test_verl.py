"""The `harts` verl engine against transformers' own per-sequence forward, under verl's own
`ppo_loss`, on tiny Kimi-Linear and Qwen3-Next checkpoints built with transformers' classes
(CPU, one process).

The batch is verl's: left-padded prompts and right-padded responses turned into the
no-padding layout by verl's `left_right_2_no_padding`, two prompt groups of three
responses each, old, reference log-probs and GRPO advantages. The engine's outputs go
through `ppo_loss` (clipped PPO, entropy bonus, low-variance KL to the reference); the
reference feeds the same `ppo_loss` with log-probs and entropies from transformers' model
run on each sequence alone (Kimi-Linear under transformers < 5.11, verl's pin, which has no
Kimi-Linear class: HARTS's own forward on each sequence alone, itself equal to transformers'
class in float64 to ~1e-14 in tests/models/test_kimi_linear.py; and transformers' own class
run by the main test environment's Python, `HARTS_REFERENCE_PYTHON`, in
`test_kimi_linear_against_transformers_class_in_another_environment`). The losses must agree within 1e-10 in float64 (5e-6 in
float32), every parameter's gradient within 1e-10 of the largest (5e-5 in float32);
`get_per_tensor_param` must yield the checkpoint's own names, shapes, dtypes and values;
`save_checkpoint` / `load_checkpoint` must give back the model, optimizer and scheduler bit
for bit, so that the next step is bit-identical too.

Data parallel (`test_data_parallel_*`): two worker processes on gloo (the launcher of
tests/distributed, `harts.distributed.runner.launch`), one engine each, every rank given its
half of the same batch as verl's dispatch cuts it (`chunk_tensordict`). The ranks' losses
(each dp_size times its share of the global batch's loss, verl's normalisation) summed and
divided by dp_size, and every gradient after the engine's FSDP reduction, must equal the
one-process per-sequence reference over the whole batch with the same tolerances;
`infer_batch` gives the training pass's log-probs; the weights sent for sync are the
checkpoint's; a dp=2 optimizer step (gradient norm, clipping, AdamW) is the one-process
engine's step on the whole batch within 1e-10; a checkpoint saved under dp=2 loads back bit
for bit (model, optimizer, scheduler, the next step) under dp=2 and in one process.

These tests need verl, which pins transformers < 5.11: they run in their own environment
(`bash scripts/verl_env.sh`, which `.ci/run` calls).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config.actor import ActorConfig  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from harts.integrations.hf import CheckpointLayout  # noqa: E402
from harts.integrations.verl import HartsEngine  # noqa: E402
from harts.models import load  # noqa: E402
from harts.models.hf.io import read_checkpoint  # noqa: E402
from tests.integrations.tiny_models import (  # noqa: E402
    VOCAB,
    PerSequence,
    build,
    harts_kimi_checkpoint,
    has_transformers_class,
    reference_float64,
)

TEMPERATURE = 0.8
PROMPTS = (12, 9)  # the two groups' prompt lengths (the shorter one left-padded)
RESPONSES = ((8, 5, 7), (6, 8, 3))  # each group's response lengths (right-padded to 8)


def verl_batch(vocab: int, seed: int = 0) -> TensorDict:
    """verl's actor batch for 2 groups x 3 responses, in the no-padding layout."""
    rng = np.random.default_rng(seed)
    P, R = max(PROMPTS), max(max(r) for r in RESPONSES)
    rows = []
    for g, (p_len, r_lens) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        prompt = rng.integers(2, vocab, p_len)
        advantages = rng.normal(size=len(r_lens))
        for r_len, adv in zip(r_lens, advantages, strict=True):
            rows.append((g, prompt, rng.integers(2, vocab, r_len), adv))
    B = len(rows)
    prompts = torch.zeros(B, P, dtype=torch.int64)
    responses = torch.zeros(B, R, dtype=torch.int64)
    attention = torch.zeros(B, P + R, dtype=torch.int64)
    for b, (_, prompt, response, _) in enumerate(rows):
        prompts[b, P - prompt.size:] = torch.as_tensor(prompt)
        responses[b, : response.size] = torch.as_tensor(response)
        attention[b, P - prompt.size: P + response.size] = 1
    response_mask = attention[:, P:].clone()
    td = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention, "response_mask": response_mask,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
        "old_log_probs": torch.as_tensor(rng.normal(-3.0, 0.5, (B, R))) * response_mask,
        "ref_log_prob": torch.as_tensor(rng.normal(-3.0, 0.5, (B, R))) * response_mask,
        "advantages": torch.as_tensor(np.array([r[3] for r in rows]))[:, None] * response_mask,
    }, batch_size=[B])
    data = left_right_2_no_padding(td)
    tu.assign_non_tensor(data, global_batch_size=B, calculate_entropy=True, temperature=TEMPERATURE)
    return data


def actor_config() -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=3, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                       clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean", entropy_coeff=0.01,
                       use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")


def engine(ckpt, dtype: str, lr: float = 1e-3, microbatch_tokens: int | None = None) -> HartsEngine:
    eng = EngineRegistry.new(model_type="language_model", backend="harts",
                             model_config=SimpleNamespace(path=str(ckpt)),
                             engine_config=SimpleNamespace(dtype=dtype, device="cpu",
                                                           harts_microbatch_tokens=microbatch_tokens),
                             optimizer_config=SimpleNamespace(lr=lr, weight_decay=0.01, clip_grad=1.0),
                             checkpoint_config=None)
    eng.initialize()
    return eng


def reference_outputs(model, data: TensorDict) -> dict:
    """transformers' forward on each sequence alone, in verl's layout (entry p: token p + 1)."""
    log_probs, entropy = [], []
    for seq in data["input_ids"].unbind():
        logits = model(seq[None]).logits[0] / TEMPERATURE
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        lp = torch.cat([logp[:-1].gather(1, seq[1:, None])[:, 0], logp.new_zeros(1)])
        log_probs.append(lp)
        entropy.append(-(logp.exp() * logp).sum(-1))
    offsets = data["input_ids"].offsets()
    return {"log_probs": torch.nested.nested_tensor_from_jagged(torch.cat(log_probs), offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(torch.cat(entropy), offsets)}


@pytest.fixture(scope="module", params=["kimi_linear", "qwen3_next"])
def family(request):
    return request.param


def _checkpoint(tmp_path, family: str, dtype: torch.dtype):
    """(reference model, checkpoint directory): transformers' model and its `save_pretrained`,
    or, for Kimi-Linear under transformers < 5.11 (verl's pin), which has no Kimi-Linear
    class, HARTS's per-sequence forward and checkpoint (`harts_kimi_checkpoint`)."""
    path = tmp_path / f"tiny-{family}"
    if family == "kimi_linear" and not has_transformers_class(family):
        return harts_kimi_checkpoint(path, dtype), path
    model = build(family, dtype)
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 5e-6)])
def test_ppo_loss_and_gradients_equal_transformers(family, dtype, tol, tmp_path):
    model, ckpt = _checkpoint(tmp_path, family, dtype)
    eng = engine(ckpt, str(dtype).removeprefix("torch."))
    data = verl_batch(VOCAB[family])
    loss_fn = functools.partial(ppo_loss, actor_config())
    with eng.train_mode():
        eng.optimizer_zero_grad()
        out = eng.forward_backward_batch(data, loss_fn, forward_only=False)
    ours = out["loss"][0]
    assert out["metrics"]["harts/compression"][0] > 1.2  # the groups' prompts ran once
    use64 = dtype == torch.float64 and not isinstance(model, PerSequence)
    with reference_float64(family) if use64 else _nothing():
        ref_out = reference_outputs(model, data)
        ref_loss, _ = ppo_loss(actor_config(), ref_out, data)
        ref_loss.backward()
    assert abs(ours - float(ref_loss)) <= tol * max(1.0, abs(float(ref_loss))), (ours, float(ref_loss))
    # the log-probs themselves, where the loss reads them
    mask = data["response_mask"].bool()
    lp = _responses(out["model_output"]["log_probs"], data)
    lp_ref = _responses(ref_out["log_probs"].detach(), data)
    assert float((lp - lp_ref)[mask].abs().max()) <= tol * 10
    # every parameter's gradient, transformers' mapped through the checkpoint adapter (its
    # on-disk layout, then HARTS's) onto the engine's parameters
    loaded = eng.loaded
    ours_g = {k: p.grad for k, p in eng.module.named_parameters()}
    if isinstance(model, PerSequence):
        ref_g = {k: p.grad for k, p in model.model.named_parameters()}
    else:
        on_disk = CheckpointLayout(model).tensors(model, {k: p.grad for k, p in model.named_parameters()})
        ref_g = loaded.adapter.to_harts(on_disk, loaded.config)
    assert ours_g.keys() == ref_g.keys()
    scale = max(float(g.abs().max()) for g in ref_g.values())
    assert scale > 0
    worst = max(float((ours_g[k] - ref_g[k]).abs().max()) for k in ref_g) / scale
    assert worst <= tol * 10, worst


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 5e-6)])
def test_kimi_linear_against_transformers_class_in_another_environment(dtype, tol, tmp_path):
    """Kimi-Linear against transformers' own class, where verl's environment has none
    (transformers < 5.11): the Python of the main test environment (HARTS_REFERENCE_PYTHON,
    which scripts/verl_env.sh sets) builds the checkpoint with transformers'
    KimiLinearForCausalLM and runs each sequence alone in float64 (kimi_reference.py). Here
    verl's `ppo_loss` over those log-probs and entropies gives the reference loss and its
    gradient with respect to them; that gradient goes back to the other Python, whose
    backward through transformers' model gives the reference parameter gradients (a
    vector-Jacobian product: the loss's gradient through the same log-probs). The engine's
    loss, log-probs and every gradient must agree within the one-environment test's
    tolerances (float64 1e-10, float32 5e-6)."""
    import os
    import subprocess
    from pathlib import Path

    python = os.environ.get("HARTS_REFERENCE_PYTHON")
    if has_transformers_class("kimi_linear"):
        pytest.skip("this transformers has Kimi-Linear: test_ppo_loss_and_gradients_equal_transformers runs it")
    if not python:
        pytest.skip("HARTS_REFERENCE_PYTHON (a Python with transformers >= 5.11) is not set; scripts/verl_env.sh sets it")
    root = Path(__file__).resolve().parents[2]

    def other(*args):
        run = subprocess.run([python, "-m", "tests.integrations.kimi_reference", *map(str, args)], cwd=root,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]

    ckpt = tmp_path / "tiny-kimi_linear"
    other("build", ckpt)
    name = str(dtype).removeprefix("torch.")
    eng = engine(ckpt, name)
    data = verl_batch(VOCAB["kimi_linear"])
    with eng.train_mode():
        eng.optimizer_zero_grad()
        out = eng.forward_backward_batch(data, functools.partial(ppo_loss, actor_config()), forward_only=False)
    sequences = [s.clone() for s in data["input_ids"].unbind()]
    request, result = tmp_path / "request.pt", tmp_path / "result.pt"
    torch.save({"sequences": sequences, "temperature": TEMPERATURE, "dtype": name}, request)
    other("forward", ckpt, request, result)
    ref = torch.load(result, weights_only=True)
    offsets = data["input_ids"].offsets()
    lp = ref["log_probs"].clone().requires_grad_()
    ent = ref["entropy"].clone().requires_grad_()
    ref_out = {"log_probs": torch.nested.nested_tensor_from_jagged(lp, offsets),
               "entropy": torch.nested.nested_tensor_from_jagged(ent, offsets)}
    ref_loss, _ = ppo_loss(actor_config(), ref_out, data)
    g_lp, g_ent = torch.autograd.grad(ref_loss, (lp, ent))
    ref_value = float(ref_loss.detach())
    assert abs(out["loss"][0] - ref_value) <= tol * max(1.0, abs(ref_value)), (out["loss"][0], ref_value)
    mask = data["response_mask"].bool()
    ours_lp = _responses(out["model_output"]["log_probs"], data)
    assert float((ours_lp - _responses(ref_out["log_probs"].detach(), data))[mask].abs().max()) <= tol * 10
    torch.save({"sequences": sequences, "temperature": TEMPERATURE, "dtype": name, "grad_log_probs": g_lp,
                "grad_entropy": g_ent}, request)
    other("forward", ckpt, request, result)
    loaded = eng.loaded
    ref_all = loaded.adapter.to_harts(torch.load(result, weights_only=True)["grads"], loaded.config)
    ours_g = {k: p.grad for k, p in eng.module.named_parameters()}
    assert ours_g.keys() <= ref_all.keys()  # the rest: buffers (zeros)
    ref_g = {k: ref_all[k] for k in ours_g}
    scale = max(float(g.abs().max()) for g in ref_g.values())
    assert scale > 0
    worst = max(float((ours_g[k] - ref_g[k]).abs().max()) for k in ref_g) / scale
    assert worst <= tol * 10, worst


def _responses(nested, data):
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(nested, data)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_per_tensor_params_are_the_checkpoints(family, tmp_path):
    _, ckpt = _checkpoint(tmp_path, family, torch.float32)
    eng = engine(ckpt, "float32")
    gen, peft = eng.get_per_tensor_param()
    assert peft is None
    ours = dict(gen)
    files = read_checkpoint(ckpt).tensors
    assert ours.keys() == files.keys()
    for name, t in files.items():
        assert ours[name].shape == t.shape and ours[name].dtype == t.dtype, name
        assert torch.equal(ours[name], t), name


def _step(eng, data):
    with eng.train_mode():
        eng.optimizer_zero_grad()
        out = eng.forward_backward_batch(data, functools.partial(ppo_loss, actor_config()), forward_only=False)
        norm = eng.optimizer_step()
        eng.lr_scheduler_step()
    return out["loss"][0], norm


def test_checkpoint_round_trip_is_bit_identical(family, tmp_path):
    _, ckpt = _checkpoint(tmp_path, family, torch.float64)
    data = verl_batch(VOCAB[family])
    a = engine(ckpt, "float64", lr=1e-2)
    _step(a, data)
    a.save_checkpoint(str(tmp_path / "saved"), global_step=1)
    saved = {k: v.clone() for k, v in a.module.state_dict().items()}
    b = engine(ckpt, "float64", lr=1e-2)
    b.load_checkpoint(str(tmp_path / "saved"))
    for (k, x), (k2, y) in zip(a.module.state_dict().items(), b.module.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(x, y), k
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sb["state"][i][k]), (i, k)
    assert a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()
    # the next step from either is the same, bit for bit, and moves the weights
    before = {k: v.clone() for k, v in a.module.state_dict().items()}
    la, na = _step(a, data)
    lb, nb = _step(b, data)
    assert la == lb and na == nb
    for (k, x), (_, y) in zip(a.module.state_dict().items(), b.module.state_dict().items(), strict=True):
        assert torch.equal(x, y), k
    assert any(not torch.equal(before[k], v) for k, v in a.module.state_dict().items())
    # the exported Hugging Face directory holds the weights as saved
    exported = load(tmp_path / "saved" / "huggingface").model.state_dict()
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], saved[k]) for k in saved)


def test_the_harts_backend_is_registered_by_importing_verl():
    """verl loads HARTS's `verl.plugins` entry point when it is imported."""
    import subprocess
    import sys

    code = ("import verl; from verl.workers.engine.base import EngineRegistry; "
            "print(EngineRegistry.get_engine_cls('language_model', 'harts').__module__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "harts.integrations.verl"


def test_uid_sets_the_trees(tmp_path):
    """With verl's `uid` per sequence the trees follow it (here every sequence its own, so
    nothing is shared); without it, the prompts; the log-probs are the same either way."""
    _, ckpt = _checkpoint(tmp_path, "qwen3_next", torch.float64)
    eng = engine(ckpt, "float64")
    by_prompt = verl_batch(VOCAB["qwen3_next"])
    by_uid = verl_batch(VOCAB["qwen3_next"])
    tu.assign_non_tensor_stack(by_uid, "uid", [f"u{i}" for i in range(len(by_uid))])
    with eng.eval_mode():
        shared = eng.infer_batch(by_prompt)
        alone = eng.infer_batch(by_uid)
    assert shared["metrics"]["harts/compression"][0] > 1.2
    assert alone["metrics"]["harts/compression"][0] == 1.0
    a = shared["model_output"]["log_probs"].values()
    b = alone["model_output"]["log_probs"].values()
    assert float((a - b).abs().max()) <= 1e-12


# ---- data parallel: two ranks on gloo ----------------------------------------------------------

DP = 2
DP_CASES = [(family, dtype, tol) for family in ("kimi_linear", "qwen3_next")
            for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 5e-6))]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _full_optimizer(eng) -> dict:
    sd = eng.optimizer.state_dict()
    return {i: {k: _full(v) for k, v in st.items()} for i, st in sd["state"].items()}


def _dp_worker(cases: list[tuple[str, str, str]], out_dir: str) -> None:
    """One rank: per case (name, family, dtype, checkpoint) the engine's weights for sync,
    one step's loss and full gradients on this rank's half of the batch; then, on the float64
    checkpoints, a save / load round trip under dp=2. Rank 0 writes what it gathered."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict = {}
    for name, family, dtype, ckpt in cases:
        eng = engine(ckpt, dtype)
        group = eng.get_data_parallel_group()
        assert group is not None and eng.get_data_parallel_size() == DP and eng.get_data_parallel_rank() == rank
        synced = dict(eng.get_per_tensor_param()[0])
        half = tu.chunk_tensordict(verl_batch(VOCAB[family]), DP)[rank]
        with eng.train_mode():
            eng.optimizer_zero_grad()
            step = eng.forward_backward_batch(half, functools.partial(ppo_loss, actor_config()), forward_only=False)
        grads = {k: _full(p.grad) for k, p in eng.module.named_parameters()}
        with eng.eval_mode():
            inferred = eng.infer_batch(tu.chunk_tensordict(verl_batch(VOCAB[family]), DP)[rank])
        mine = (step["loss"][0], step["metrics"]["harts/compression"][0], step["model_output"]["log_probs"].values(),
                tu.get_non_tensor_data(half, "batch_num_tokens", None), tu.get_non_tensor_data(half, "dp_size", None),
                inferred["model_output"]["log_probs"].values())
        parts = [None] * DP
        dist.all_gather_object(parts, mine, group=group)
        out[name] = {"synced": synced, "grads": grads, "loss": [p[0] for p in parts],
                     "compression": [p[1] for p in parts], "log_probs": torch.cat([p[2] for p in parts]),
                     "batch_num_tokens": [p[3] for p in parts], "dp_size": [p[4] for p in parts],
                     "inferred": torch.cat([p[5] for p in parts])}
        if dtype != "float64":
            continue
        # every sequence its own tree and a budget that holds one (13-20 tokens) per
        # microbatch: three forwards and one backward per rank before FSDP's one reduction
        many = engine(ckpt, dtype, microbatch_tokens=16)
        alone = tu.chunk_tensordict(verl_batch(VOCAB[family]), DP)[rank]
        tu.assign_non_tensor_stack(alone, "uid", [f"{rank}/{i}" for i in range(len(alone))])
        with many.train_mode():
            many.optimizer_zero_grad()
            many.forward_backward_batch(alone, functools.partial(ppo_loss, actor_config()), forward_only=False)
        out[name]["grads_microbatched"] = {k: _full(p.grad) for k, p in many.module.named_parameters()}
        # save / load under dp=2: the same model, optimizer, scheduler and next step, bit for bit
        saved_dir = f"{out_dir}/saved-{family}"
        a = engine(ckpt, "float64", lr=1e-2)
        first = _step(a, half)
        out[name]["first_step"] = (first, a._full_state())
        a.save_checkpoint(saved_dir, global_step=1)
        b = engine(ckpt, "float64", lr=1e-2)
        b.load_checkpoint(saved_dir)
        sa, sb = a._full_state(), b._full_state()
        same = sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        oa, ob = _full_optimizer(a), _full_optimizer(b)
        same = same and oa.keys() == ob.keys() and all(
            torch.equal(torch.as_tensor(v), torch.as_tensor(ob[i][k])) for i, st in oa.items() for k, v in st.items())
        same = same and a.lr_scheduler.state_dict() == b.lr_scheduler.state_dict()
        la, na = _step(a, half)
        lb, nb = _step(b, half)
        ta, tb = a._full_state(), b._full_state()
        out[name]["round_trip"] = {
            "state_and_optimizer_equal": same, "saved": sa, "next": (la, na, lb, nb),
            "next_states_equal": all(torch.equal(ta[k], tb[k]) for k in ta),
            "moved": any(not torch.equal(sa[k], ta[k]) for k in sa), "dir": saved_dir}
    if rank == 0:
        torch.save(out, f"{out_dir}/dp.pt")


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """Every data-parallel case in one launch of two gloo workers: (results, reference
    models and checkpoints)."""
    from harts.distributed.runner import launch

    root = tmp_path_factory.mktemp("dp")
    cases, models = [], {}
    for family, dtype, _ in DP_CASES:
        name = f"{family}-{str(dtype).removeprefix('torch.')}"
        (root / name).mkdir()
        model, ckpt = _checkpoint(root / name, family, dtype)
        models[name] = model, ckpt
        cases.append((name, family, str(dtype).removeprefix("torch."), str(ckpt)))
    launch(_dp_worker, (cases, str(root)), DP, timeout=240)
    return torch.load(root / "dp.pt", weights_only=False), models


@pytest.mark.parametrize("family, dtype, tol", DP_CASES,
                         ids=[f"{f}-{str(d).removeprefix('torch.')}" for f, d, _ in DP_CASES])
def test_data_parallel_ppo_loss_and_gradients_equal_transformers(dp_run, family, dtype, tol):
    results, models = dp_run
    name = f"{family}-{str(dtype).removeprefix('torch.')}"
    res = results[name]
    model, ckpt = models[name]
    data = verl_batch(VOCAB[family])
    # verl's normalisation: the global batch's loss tokens on every rank, dp_size 2
    mask_ = data["loss_mask"]
    total = int((mask_.values() if mask_.is_nested else mask_).sum())
    assert res["batch_num_tokens"] == [total] * DP and res["dp_size"] == [DP] * DP
    tu.assign_non_tensor(data, batch_num_tokens=total, dp_size=1)  # the whole batch in one process
    assert min(res["compression"]) > 1.2  # each rank's group ran its prompt once
    use64 = dtype == torch.float64 and not isinstance(model, PerSequence)
    with reference_float64(family) if use64 else _nothing():
        ref_out = reference_outputs(model, data)
        ref_loss, _ = ppo_loss(actor_config(), ref_out, data)
        ref_loss.backward()
    ours = sum(res["loss"]) / DP
    assert abs(ours - float(ref_loss)) <= tol * max(1.0, abs(float(ref_loss))), (res["loss"], float(ref_loss))
    mask = data["response_mask"].bool()
    lp = _responses(torch.nested.nested_tensor_from_jagged(res["log_probs"], data["input_ids"].offsets()), data)
    lp_ref = _responses(ref_out["log_probs"].detach(), data)
    assert float((lp - lp_ref)[mask].abs().max()) <= tol * 10
    assert torch.equal(res["inferred"], res["log_probs"])  # infer_batch's forward is the training pass's
    loaded = load(ckpt, dtype=dtype)
    if isinstance(model, PerSequence):
        ref_g = {k: p.grad for k, p in model.model.named_parameters()}
    else:
        on_disk = CheckpointLayout(model).tensors(model, {k: p.grad for k, p in model.named_parameters()})
        ref_g = loaded.adapter.to_harts(on_disk, loaded.config)
    ours_g = res["grads"]
    assert ours_g.keys() == ref_g.keys()
    scale = max(float(g.abs().max()) for g in ref_g.values())
    assert scale > 0
    worst = max(float((ours_g[k] - ref_g[k]).abs().max()) for k in ref_g) / scale
    assert worst <= tol * 10, worst
    if "grads_microbatched" in res:  # float64: several microbatches per rank, nothing shared
        many = res["grads_microbatched"]
        worst = max(float((many[k] - ref_g[k]).abs().max()) for k in ref_g) / scale
        assert worst <= tol * 10, worst
    # the weights verl's sync sends: the checkpoint's tensors, whole, under dp=2
    files = read_checkpoint(ckpt).tensors
    assert res["synced"].keys() == files.keys()
    for k, t in files.items():
        assert res["synced"][k].dtype == t.dtype and torch.equal(res["synced"][k], t), k


@pytest.mark.parametrize("family", ["kimi_linear", "qwen3_next"])
def test_data_parallel_checkpoint_round_trip_is_bit_identical(dp_run, family, tmp_path):
    results, models = dp_run
    res = results[f"{family}-float64"]
    rt = res["round_trip"]
    assert rt["state_and_optimizer_equal"]
    la, na, lb, nb = rt["next"]
    assert la == lb and na == nb and rt["next_states_equal"] and rt["moved"]
    saved = rt["saved"]
    # the file holds the full tensors: one process loads it to the same state, and the
    # exported Hugging Face directory holds the weights as saved
    _, ckpt = models[f"{family}-float64"]
    one = engine(ckpt, "float64", lr=1e-2)
    one.load_checkpoint(rt["dir"])
    state = one.module.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    exported = load(rt["dir"] + "/huggingface").model.state_dict()
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    # the dp=2 step (gradient norm, clipping, AdamW) is the one-process step on the whole batch
    (_, norm), after = res["first_step"]
    single = engine(ckpt, "float64", lr=1e-2)
    _, norm1 = _step(single, verl_batch(VOCAB[family]))
    assert abs(norm - norm1) <= 1e-10 * norm1, (norm, norm1)
    assert norm1 > single.clip_grad  # clipping acted
    state1 = single.module.state_dict()
    assert max(float((after[k] - state1[k]).abs().max()) for k in state1) <= 1e-10
