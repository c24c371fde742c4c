"""`HartsGRPOTrainer` against TRL's own `GRPOTrainer`, on tiny Kimi-Linear and Qwen3-Next
models built with transformers' classes, on the CPU.

Both trainers start from the same weights and seed and run the same TRL configuration:
4 prompts of 24 tokens, 4 completions each (a group shares its prompt), two iterations per
generation (`num_iterations=2`, so the second update's PPO ratio is not 1 and the loss
reads the log-probs), a learning rate that moves the weights. Every step must see the same
completions, and give the same loss, gradient norm, entropy and rewards, and the final
weights must agree. float64, AdamW: losses within 1e-10, the logged values within 1e-9
(relative, absolute below 1), weights within 1e-9 of the largest weight. float32, SGD:
losses within 1e-5, logged values within 1e-4, weights within 1e-6. In float32 the two
forwards round differently (~1e-6 relative at the first step), and AdamW turns a
gradient entry near zero into a full step of either sign, so over four AdamW steps the
float32 weights part by ~1e-4 whichever way the log-probs are computed; SGD keeps the
comparison at the rounding's own size.

In float64 both run inside `reference_float64`: transformers' modeling code, TRL's fused
LM head (`trl.kernels.chunked_logprob`, which accumulates in float32) and the Mixtral
load-balancing loss TRL adds for Qwen3-Next (float32 accumulators) keep their float32
steps in float64 without changing their algorithm, so TRL's own trainer is a true float64
reference. HARTS's tree step computes the log-probs of the completions with each
group's prompt run once (`harts/compression` > 1 in its logs).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import transformers.models.mixtral.modeling_mixtral as modeling_mixtral  # noqa: E402
import trl.kernels.chunked_logprob as trl_chunked_logprob  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from harts.integrations.hf import TreeLogProbs  # noqa: E402
from harts.integrations.trl import HartsGRPOTrainer  # noqa: E402
from tests.integrations.tiny_models import VOCAB, build, reference_float64, tokenizer  # noqa: E402
from tests.models.float64_reference import float64_module  # noqa: E402

STEPS = 4
COMPARED = ("loss", "grad_norm", "entropy", "reward", "reward_std", "completions/mean_length", "aux_loss")


def prompts(vocab: int, n: int = 4, length: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_dict(
        {"prompt": [" ".join(f"t{x}" for x in rng.integers(2, vocab, length)) for _ in range(n)]})


def reward(completions, **_):
    """Toy reward: how many completion tokens have an id divisible by 3."""
    return [float(sum(int(t[1:]) % 3 == 0 for t in c.split())) for c in completions]


class Recording:
    """Records each `compute_loss` call's loss (unrounded) and completions."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.recorded.append((float(loss.detach()), inputs["completion_ids"].clone()))
        return loss


class TRLRun(Recording, GRPOTrainer):
    pass


class HartsRun(Recording, HartsGRPOTrainer):
    pass


@contextlib.contextmanager
def numerics(family: str, dtype: torch.dtype):
    if dtype != torch.float64:
        yield
        return
    with reference_float64(family), float64_module(trl_chunked_logprob, modeling_mixtral):
        yield


def train(cls, family: str, dtype: torch.dtype, tmp_path, **config):
    model = build(family, dtype)
    args = GRPOConfig(
        output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, num_iterations=2, max_steps=STEPS, learning_rate=1e-2, logging_steps=1,
        report_to=[], use_cpu=True, seed=0, save_strategy="no", bf16=False, disable_tqdm=True, **config)
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=prompts(VOCAB[family]),
                  processing_class=tokenizer(VOCAB[family]))
    trainer.recorded = []
    with numerics(family, dtype):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return trainer, model, logs


def _rel(a: float, b: float) -> float:
    """Relative difference; values below 1 (a loss near 0) compare absolutely."""
    return abs(a - b) / max(abs(a), abs(b), 1.0)


def _weights_error(a, b) -> float:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    scale = max(float(p.detach().abs().max()) for p in pa.values())
    return max(float((pa[n].detach() - pb[n].detach()).abs().max()) for n in pa) / scale


@pytest.mark.slow
@pytest.mark.parametrize("family, dtype, optim, tol, weight_tol", [
    ("kimi_linear", torch.float64, "adamw_torch", 1e-9, 1e-9),
    ("qwen3_next", torch.float64, "adamw_torch", 1e-9, 1e-9),
    ("qwen3_next", torch.float32, "sgd", 1e-4, 1e-6),
])
def test_harts_grpo_takes_trls_steps(family, dtype, optim, tol, weight_tol, tmp_path):
    ref, ref_model, ref_logs = train(TRLRun, family, dtype, tmp_path, optim=optim)
    ours, our_model, our_logs = train(HartsRun, family, dtype, tmp_path, optim=optim)
    assert len(ref.recorded) == len(ours.recorded) == STEPS
    assert len(ref_logs) == len(our_logs) == STEPS
    for step, ((l_ref, c_ref), (l_ours, c_ours)) in enumerate(zip(ref.recorded, ours.recorded, strict=True)):
        assert torch.equal(c_ref, c_ours), f"step {step}: other completions"
        # absolutely: GRPO's loss is a near-cancelling sum of per-token terms of the
        # advantages' scale (1), so its own size says nothing about its rounding
        assert abs(l_ref - l_ours) <= tol / 10, f"step {step}: loss {l_ours} vs {l_ref}"
    for step, (a, b) in enumerate(zip(ref_logs, our_logs, strict=True)):
        assert sorted(set(a) & set(COMPARED)) == sorted(set(b) & set(COMPARED))
        assert {"loss", "grad_norm", "entropy"} <= set(a)
        for key in set(a) & set(COMPARED):
            assert _rel(a[key], b[key]) <= tol, f"step {step}: {key} {b[key]} vs {a[key]}"
        # the tree runs each group's prompt once
        assert b["harts/compression"] > 1.5
    # the comparison is not vacuous: the ratio moved the loss, the update moved the weights
    assert any(abs(loss) > 1e-4 for loss, _ in ref.recorded[1::2])
    assert _weights_error(ref_model, build(family, dtype)) > 1e3 * weight_tol
    assert _weights_error(ref_model, our_model) <= weight_tol


def test_log_probs_are_trls_at_every_completion_position():
    """One call of the replaced method against TRL's fused head on the same rows (left-padded
    prompts of different lengths, completions cut by EOS), in float64."""
    from trl.trainer.utils import add_fused_lm_head

    family = "qwen3_next"
    rng = np.random.default_rng(1)
    B, P, C, V = 6, 10, 7, VOCAB[family]
    ids = torch.as_tensor(rng.integers(2, V, (B, P + C)))
    mask = torch.ones(B, P + C, dtype=torch.int64)
    mask[0, :3] = 0  # a shorter prompt, left-padded
    mask[1, P + 4:] = 0  # a completion ended early
    ids[3:, :P] = ids[2, :P]  # rows 2-5 share their prompt
    for temperature in (1.0, 0.7):
        model = build(family)
        ours, ent, result = TreeLogProbs(model).completion_logps(ids, mask, C, temperature=temperature)
        add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-C] = -100
        with reference_float64(family), float64_module(trl_chunked_logprob), torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        # rows with left padding differ in transformers' own positions only by a constant
        # RoPE offset, which cancels in the attention scores
        assert torch.allclose(ours.detach(), out.log_probs[:, -C:], rtol=0, atol=1e-12)
        assert torch.allclose(ent, out.entropy[:, -C:], rtol=0, atol=1e-12)
        assert float(ours.detach()[1, 4:].abs().max()) == 0.0
        assert result.executed_rows < result.tokens  # rows 2-5: one prompt
