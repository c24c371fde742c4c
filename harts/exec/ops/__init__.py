"""Sequence-mixing ops in fla's shape: `<op>/naive.py` is the readable reference, other
modules are faster forms tested against it on outputs and every gradient.

- `kda`: Kimi Delta Attention (gated delta rule with per-channel decay), token-by-token
  recurrence and the chunkwise (UT transform / WY) form, on packed varlen tensors.
- `conv`: short causal depthwise convolution in gather form, so one op serves packed
  sequences (windows from cu_seqlens) and rollout trees (windows from parent pointers).
"""
