"""TRL's GRPO update with HARTS's tree log-probs vs TRL's own, on one group sharing its prompt.

    python benchmarks/bench_trl_update.py [--prompt 512] [--completion 32] [--group 8] [--json]

One update's model work: `compute_loss` (the policy's per-token log-probs and GRPO's loss)
and its backward, on the same inputs, for `GRPOTrainer` and `HartsGRPOTrainer` (the
optimizer step, generation and rewards are the same code in both and are not timed). The
model is a small Qwen3-Next (float32, 4 layers, d_model 128) built with transformers'
classes, on transformers' pure-torch paths (no fla on the CPU) and eager experts; a group
of `--group` completions shares one `--prompt`-token prompt. Reports the median of
`--repeats` timed runs after one warm-up, and the ratio of the tokens TRL computes to the
rows HARTS does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.modules.setdefault("fla", None)  # transformers' pure-torch linear attention on the CPU
sys.modules.setdefault("causal_conv1d", None)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harts.integrations.trl import HartsGRPOTrainer  # noqa: E402
from tests.integrations.tiny_models import tokenizer  # noqa: E402

VOCAB = 512


def model() -> Qwen3NextForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_experts_per_tok=2, num_experts=8, router_aux_loss_coef=0.0,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    m = Qwen3NextForCausalLM(cfg).float().train()
    m.set_experts_implementation("eager")
    m.set_attn_implementation("sdpa")
    return m


def time_update(cls, inputs: dict, repeats: int, out: Path) -> list[float]:
    policy = model()
    args = GRPOConfig(output_dir=str(out / cls.__name__), per_device_train_batch_size=inputs["n"],
                      num_generations=inputs["n"], max_steps=1, report_to=[], use_cpu=True, bf16=False,
                      disable_tqdm=True)
    trainer = cls(model=policy, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                  train_dataset=Dataset.from_dict({"prompt": ["t2"]}), processing_class=tokenizer(VOCAB))
    batch = {k: v for k, v in inputs.items() if k != "n"}
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() otherwise
    times = []
    for i in range(repeats + 1):
        policy.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = trainer.compute_loss(policy, batch)
        loss.backward()
        if i:
            times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--completion", type=int, default=32, help="tokens per completion (default 32)")
    parser.add_argument("--group", type=int, default=8, help="completions of the prompt (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (default 5)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    a = parser.parse_args()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, VOCAB, (1, a.prompt), generator=g).expand(a.group, -1).contiguous()
    inputs = {
        "n": a.group,
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt),
        "completion_ids": torch.randint(2, VOCAB, (a.group, a.completion), generator=g),
        "completion_mask": torch.ones(a.group, a.completion, dtype=torch.int64),
        "advantages": torch.randn(a.group, generator=g), "num_items_in_batch": torch.tensor(float(a.group * a.completion)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        trl = time_update(GRPOTrainer, inputs, a.repeats, Path(tmp))
        harts = time_update(HartsGRPOTrainer, inputs, a.repeats, Path(tmp))
    tokens = a.group * (a.prompt + a.completion)
    rows = a.prompt + a.group * a.completion
    result = {"prompt": a.prompt, "completion": a.completion, "group": a.group, "threads": torch.get_num_threads(),
              "trl_s": statistics.median(trl), "harts_s": statistics.median(harts),
              "speedup": statistics.median(trl) / statistics.median(harts), "tokens_per_row": tokens / rows}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"TRL {result['trl_s']:.3f} s, HARTS {result['harts_s']:.3f} s: {result['speedup']:.2f}x "
              f"({result['tokens_per_row']:.2f} tokens per executed row)")


if __name__ == "__main__":
    main()
