"""Attention over packed sequences and rollout trees: the references and the fast paths.

- `naive`: the references (a dense ancestor mask for trees, causal SDPA per sequence).
- `flex`: FlexAttention over a block mask built from the DFS intervals (fp32 and fallback).
- `varlen`: one causal varlen flash call over the query segments' root-to-row paths.
- `kernel`: the varlen kernel interface the split and graph paths share, and its float64
  reference.
- `split`: two calls per query segment (ancestors, own rows) merged by log-sum-exp, on
  cuDNN's SDPA; the split backward the graph path also runs.
- `cudnn_graph`: cuDNN's graph API (nvidia-cudnn-frontend): one bottom-right call for all
  segments.
- `tree`: which of these a tree layout runs (`FastTreeAttention`), from its `KernelConfig`.
- `causal`: the expanded baseline's causal attention on its configured path.

Modules that need a GPU library import it lazily, so the package imports on a CPU machine.
"""
