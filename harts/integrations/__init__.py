"""HARTS inside RL frameworks: the tree step behind the interfaces verl and TRL train through.

- `harts.integrations.hf`: `TreeLogProbs`, a transformers causal LM's own parameters run as
  HARTS's `HybridModel` over rollout trees, differentiably: per-token log-probs (and
  entropy) of many sequences, each shared prefix computed once, with gradients flowing
  back into the transformers model's parameters. No framework needed.
- `harts.integrations.trl`: `HartsGRPOTrainer`, TRL's `GRPOTrainer` whose policy log-probs
  come from `TreeLogProbs` (the `trl` extra).
- `harts.integrations.verl`: the `harts` training engine for verl's `EngineRegistry`
  (the `verl` extra).

The framework modules import their framework at import time; this package imports neither.
"""
