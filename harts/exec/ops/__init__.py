"""Sequence-mixing ops, one package per op family in fla's shape: `<op>/naive.py` is the
readable reference (any device, every dtype), the other modules of the package are its
faster forms, tested against it on outputs and every gradient. An op family the executor
gains gets the same shape. Each family's `paths` module declares its registry
(`registry.OpRegistry`): every fast path with the devices, dtypes, settings and package it
needs, and its priority; `harts.exec.backend` selects through them from the caller's
`KernelConfig`.

- `attention`: ancestor attention over a tree's compact layout and the baseline's causal
  attention: dense-mask reference, FlexAttention, varlen flash over root-to-row paths,
  cuDNN per segment (`split`), cuDNN's graph API (`cudnn_graph`).
- `kda`: Kimi Delta Attention (gated delta rule with per-channel decay): token-by-token
  recurrence (`naive`), the chunkwise form (`chunk`), fla-core's kernels with the boundary
  states the tree needs (`fla`) and their Triton state backward (`dhu`).
- `gdn`: Gated DeltaNet (gated delta rule with one decay per head): token-by-token
  recurrence (`naive`), chunkwise (`chunk`), fla-core's `chunk_gated_delta_rule` (`fla`).
  The model runs GDN layers through the KDA path with the decay broadcast along K (the same
  recurrence), so trees get KDA's replay rounds and state handoff; the family is the
  reference that identity is tested against.
- `conv`: short causal depthwise convolution in gather form, so one op serves packed
  sequences (windows from cu_seqlens) and rollout trees (windows from parent pointers):
  `naive`, `gather`, fused Triton kernels (`triton`).
- `moe`: MoE's routed experts: the per-expert loop (`naive`), grouped matrix products on
  torch's `grouped_mm` (`grouped`).
- `gather` (row gathers with a gather-form backward) and `segment_sum` (fixed-order
  scatter-adds on Triton) are shared by the families.
- `record`: what each op ran, and the fallbacks, per call.
"""
