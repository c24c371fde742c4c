"""transformers' own Kimi-Linear, run by a Python whose transformers has the class (>= 5.11),
for the verl tests, whose environment pins transformers < 5.11 (no Kimi-Linear class there).

    python -m tests.integrations.kimi_reference build OUT_DIR
    python -m tests.integrations.kimi_reference forward CKPT REQUEST.pt RESULT.pt

`build`: the tiny Kimi-Linear of `tiny_models.build` in float64, saved with `save_pretrained`.
`forward`: the checkpoint loaded with transformers' `KimiLinearForCausalLM` in REQUEST's
`dtype` (float64: the modeling copy `reference_float64` makes compute in true float64;
float32: the class as it is); REQUEST holds the sequences (a list of int64 tensors) and the
temperature, and optionally `grad_log_probs` / `grad_entropy` (flat
float64, one entry per position of every sequence, in order). RESULT gets, per position in
verl's layout (entry p: token p + 1, the last entry 0), the flat log-probs and entropies of
each sequence run alone, and with the gradients given, the gradient of
sum(grad_log_probs * log_probs + grad_entropy * entropy) for every checkpoint tensor (the
on-disk names and layouts, `CheckpointLayout`): the vector-Jacobian product through which any
loss of those log-probs and entropies reaches the weights.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from harts.integrations.hf import CheckpointLayout
from tests.integrations.tiny_models import _modeling, build, reference_float64


def _build(out_dir: str) -> None:
    build("kimi_linear", torch.float64).save_pretrained(out_dir)


def _forward(ckpt: str, request_path: str, result_path: str) -> None:
    request = torch.load(request_path, weights_only=True)
    dtype = getattr(torch, request.get("dtype", "float64"))
    # float64: the modeling copy computing in true float64; float32: transformers' class as it is
    with reference_float64("kimi_linear") if dtype == torch.float64 else contextlib.nullcontext():
        model = _modeling("kimi_linear").KimiLinearForCausalLM.from_pretrained(ckpt, torch_dtype=dtype)
        model.set_experts_implementation("eager")
        model.set_attn_implementation("eager")
        model.eval()
        log_probs, entropy = [], []
        for seq in request["sequences"]:
            logits = model(seq[None]).logits[0] / request["temperature"]
            logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            log_probs.append(torch.cat([logp[:-1].gather(1, seq[1:, None])[:, 0], logp.new_zeros(1)]))
            entropy.append(-(logp.exp() * logp).sum(-1))
        lp, ent = torch.cat(log_probs), torch.cat(entropy)
        result = {"log_probs": lp.detach(), "entropy": ent.detach()}
        if "grad_log_probs" in request:
            (request["grad_log_probs"] * lp + request["grad_entropy"] * ent).sum().backward()
            # every state tensor: the parameters' gradients, zeros for the buffers (the router's
            # correction bias), which the checkpoint holds too
            grads = {k: t.detach().new_zeros(t.shape) for k, t in model.state_dict().items()}
            grads.update({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
            result["grads"] = {k: v.detach() for k, v in CheckpointLayout(model).tensors(model, grads).items()}
    torch.save(result, result_path)


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"build": _build, "forward": _forward}[command](*paths)
