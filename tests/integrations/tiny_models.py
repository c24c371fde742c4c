"""Tiny Kimi-Linear and Qwen3-Next models built with transformers' own classes, for the
framework integration tests: random weights off the trivial initialisation (norms, decay
parameters, router scores and correction biases spread), eager attention and experts.

The classes come from `torch_only_modeling`'s copy of each modeling module (transformers'
pure-torch KDA, GDN and convolution functions), and `reference_float64(family)` is the
context under which that copy computes in true float64 (`float64_module`): transformers'
own classes cast norms, routers and the linear-attention fallbacks to float32 inside, so
without it a float64 model agrees with HARTS to ~1e-8 only (docs/LOG.md).
"""

from __future__ import annotations

import contextlib

import torch

from tests.models.float64_reference import float64_module, perturb_from_init, torch_only_modeling

FAMILIES = ("kimi_linear", "qwen3_next")
VOCAB = {"kimi_linear": 96, "qwen3_next": 61}


@contextlib.contextmanager
def reference_float64(family: str):
    """`float64_module` on the family's modeling copy; also, `Tensor.float()` of an integer
    tensor gives float64 there (transformers < 5.11 forms RoPE's positions with
    `position_ids.float()` and multiplies them with the float64 frequencies; integers are
    exact in either type)."""
    with float64_module(_modeling(family)):
        keep64 = torch.Tensor.float

        def float64_ints(self, *args, **kwargs):
            if not self.is_floating_point() and not self.is_complex():
                return self.to(torch.float64)
            return keep64(self, *args, **kwargs)

        torch.Tensor.float = float64_ints
        try:
            yield
        finally:
            torch.Tensor.float = keep64


def _modeling(family: str):
    return torch_only_modeling(f"transformers.models.{family}.modeling_{family}")


def build(family: str, dtype: torch.dtype = torch.float64, seed: int = 0, **over):
    """A tiny `family` causal LM in `dtype` (eval mode: no dropout)."""
    M = _modeling(family)
    torch.manual_seed(seed)
    with reference_float64(family):
        if family == "kimi_linear":
            from transformers import KimiLinearConfig

            kw = dict(
                vocab_size=VOCAB[family], hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                q_lora_rank=12, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=2, topk_group=1,
                num_experts_per_tok=2, num_local_experts=8, n_shared_experts=1, routed_scaling_factor=2.446,
                rms_norm_eps=1e-5, first_k_dense_replace=1, pad_token_id=None, bos_token_id=None,
                eos_token_id=None,
                linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 8,
                                    "num_heads": 2, "short_conv_kernel_size": 4},
            )
            kw.update(over)
            model = M.KimiLinearForCausalLM(KimiLinearConfig(**kw))
        elif family == "qwen3_next":
            from transformers import Qwen3NextConfig

            kw = dict(
                vocab_size=VOCAB[family], hidden_size=24, intermediate_size=40, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4,
                linear_key_head_dim=6, linear_value_head_dim=5, linear_num_key_heads=2, linear_num_value_heads=4,
                moe_intermediate_size=10, shared_expert_intermediate_size=14, num_experts_per_tok=2,
                num_experts=4, mlp_only_layers=[1], norm_topk_prob=True, rms_norm_eps=1e-6,
                initializer_range=0.3,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                pad_token_id=None, bos_token_id=None, eos_token_id=None,
            )
            kw.update(over)
            model = M.Qwen3NextForCausalLM(Qwen3NextConfig(**kw))
        else:
            raise ValueError(family)
        model = model.to(dtype).eval()
        perturb_from_init(model)
        with torch.no_grad():
            for m in model.modules():
                bias = getattr(m, "e_score_correction_bias", None)
                if bias is not None:
                    bias.normal_(0.0, 0.1)
    model.set_experts_implementation("eager")
    model.set_attn_implementation("eager")
    return model


def has_transformers_class(family: str) -> bool:
    """Whether this transformers has `family`'s classes (Kimi-Linear: from 5.11 on)."""
    import importlib.util

    return importlib.util.find_spec(f"transformers.models.{family}") is not None


KIMI_CONFIG = dict(
    model_type="kimi_linear", vocab_size=VOCAB["kimi_linear"], hidden_size=32, intermediate_size=40,
    moe_intermediate_size=12, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
    q_lora_rank=12, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=2, topk_group=1,
    num_experts_per_tok=2, num_local_experts=8, n_shared_experts=1, routed_scaling_factor=2.446, rms_norm_eps=1e-5,
    first_k_dense_replace=1, tie_word_embeddings=False,
    linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "head_dim": 8, "num_heads": 2,
                        "short_conv_kernel_size": 4},
)


def harts_kimi_checkpoint(path, dtype: torch.dtype = torch.float64, seed: int = 0):
    """Where transformers has no Kimi-Linear class: the same tiny model's checkpoint written
    by HARTS (`harts.models.save`, the layout transformers >= 5.11 reads) and its
    per-sequence reference, HARTS's HybridModel run on each sequence alone (equal to
    transformers' KimiLinearForCausalLM in float64 to ~1e-14: tests/models/test_kimi_linear.py)."""
    from harts.exec.model.model import HybridModel
    from harts.models import LoadedModel, save
    from harts.models.hf.kimi_linear import ADAPTER

    config = ADAPTER.to_config(dict(KIMI_CONFIG))
    torch.manual_seed(seed)
    model = HybridModel(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("dt_bias", "A_log")):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("router.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("score_bias"):
                b.normal_(0.0, 0.1)
    save(LoadedModel(model, config, dict(KIMI_CONFIG), ADAPTER), path)
    return PerSequence(model)


class PerSequence(torch.nn.Module):
    """`model(ids[None]).logits`: a HybridModel on one sequence alone (a packed context of one)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids_1T):
        from types import SimpleNamespace

        from harts.exec.model.context import PackedContext

        ids_T = ids_1T[0]
        ctx = PackedContext(torch.tensor([0, ids_T.numel()]), chunk_size=self.model.config.chunk_size)
        hidden_TD = self.model(ids_T, ctx).hidden_TD
        return SimpleNamespace(logits=(hidden_TD @ self.model.lm_head_weight.T)[None])


def tokenizer(vocab: int):
    """A word-level tokenizer over `vocab` ids: token `t{i}` is id i; t0 pads, t1 ends a
    completion."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t0")
