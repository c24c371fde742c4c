"""Rollouts from the policy: sampling with the current weights, branching at turn boundaries.

Legend: B prefixes advanced together, V vocabulary.

A `Policy` gives the next-token log-probs of a batch of prefixes. `HartsPolicy` runs a
HARTS `HybridModel` over the prefixes packed into one `PackedContext` and reads each
prefix's last row: a *recomputed* forward (every call runs the whole prefixes again, no KV
or KDA state is cached), which costs O(L^2) over an episode and is what the toy
environments' tiny models and short episodes need. `HFCausalLMPolicy` is the hook for a
transformers causal LM (a model loaded from a Hugging Face directory): the same
recomputed forward over right-padded prefixes; a cached or `generate`-based sampler goes
behind the same `Policy` protocol.

Sampling: the next token is drawn from softmax(logp / temperature), restricted to the
smallest set of tokens whose probability reaches `top_p`. The log-prob recorded as the
rollout's `old_logprobs` is the *policy's* log-prob of the drawn token (temperature 1, no
top-p), the quantity the trainer recomputes, so the rollout-vs-training gap measures the
numerics of the two forwards (packed recomputation here, tree or packed training there),
not the sampling transform. Every run from a prefix draws from its own generator,
seeded from (seed, step, prompt, phase, index), so a rollout does not depend on which
other rollouts were advanced in the same batch.

Trees: `sample_tree_rollouts` first runs `roots[p]` episodes from each prompt p, then
hands the finished root episodes to an expansion allocation, which picks intermediate
prefixes (turn boundaries inside an episode, `boundary_prefixes`) and how many further
continuations each gets; the continuations
share the prefix token for token, so `build_forest` merges them into one tree per prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from harts.rl.env import CALL_TOKENS, OBS_TOKENS, EpisodeState, Switchboard, Turn


class SamplingError(ValueError):
    """A sampling config or call that breaks the contract; the message names it."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> SamplingConfig:
        if not self.temperature > 0:
            raise SamplingError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        return self


class Policy(Protocol):
    """Next-token log-probs of a batch of prefixes: float64 [B, V], rows summing to 1 in
    probability."""

    def next_logprobs(self, prefixes: Sequence[np.ndarray]) -> np.ndarray: ...


class HartsPolicy:
    """A HARTS model as a sampler: recomputed forward over the packed prefixes, no grad."""

    def __init__(self, model: Any):
        self.model = model

    def next_logprobs(self, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        # identical prefixes (the roots of one prompt, before their first token) run once
        index: dict[bytes, int] = {}
        unique: list[np.ndarray] = []
        slot = []
        for p in prefixes:
            key = np.asarray(p, dtype=np.int64).tobytes()
            if key not in index:
                index[key] = len(unique)
                unique.append(np.asarray(p, dtype=np.int64))
            slot.append(index[key])
        return self._forward(unique)[np.asarray(slot, dtype=np.int64)]

    def _forward(self, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        import torch

        from harts.exec.model.context import PackedContext

        model = self.model
        device = model.lm_head_weight.device
        lengths = np.array([len(p) for p in prefixes], dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lengths)])
        ids = torch.from_numpy(np.concatenate(prefixes).astype(np.int64)).to(device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                ctx = PackedContext(torch.from_numpy(cu), chunk_size=model.config.chunk_size).to(device)
                hidden = model(ids, ctx).hidden_TD[torch.from_numpy(cu[1:] - 1).to(device)]
                logits = hidden @ model.lm_head_weight.T
                return torch.log_softmax(logits.to(torch.float64), dim=-1).cpu().numpy()
        finally:
            model.train(was_training)


class HFCausalLMPolicy:
    """A transformers causal LM (e.g. `AutoModelForCausalLM.from_pretrained(dir)`) as a
    sampler: recomputed forward over right-padded prefixes, the logits at each prefix's
    last real position."""

    def __init__(self, model: Any, pad_token_id: int = 0):
        self.model = model
        self.pad_token_id = pad_token_id

    def next_logprobs(self, prefixes: Sequence[np.ndarray]) -> np.ndarray:
        import torch

        n = max(len(p) for p in prefixes)
        ids = np.full((len(prefixes), n), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(prefixes), n), dtype=np.int64)
        for i, p in enumerate(prefixes):
            ids[i, : len(p)] = p
            mask[i, : len(p)] = 1
        device = next(self.model.parameters()).device
        with torch.no_grad():
            out = self.model(input_ids=torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(mask).to(device))
        last = torch.as_tensor([len(p) - 1 for p in prefixes], device=device)
        logits = out.logits[torch.arange(len(prefixes), device=device), last]
        return torch.log_softmax(logits.to(torch.float64), dim=-1).cpu().numpy()


def draw(logp_V: np.ndarray, rng: np.random.Generator, config: SamplingConfig) -> int:
    """One token from softmax(logp / temperature) under top-p (ties in probability keep
    the lower token id first, so the nucleus is well defined)."""
    z = logp_V / config.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if config.top_p < 1.0:
        order = np.lexsort((np.arange(p.size), -p))
        csum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(csum, config.top_p * csum[-1])) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    u = rng.random()
    return int(min(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"), p.size - 1))


@dataclass(frozen=True)
class Prefix:
    """A partial episode: its tokens so far (ending at a turn boundary), the policy's
    log-prob and the loss mask of each, the environment state, and where it came from."""

    prompt: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    mask: tuple[bool, ...]
    state: EpisodeState
    path: tuple[int, ...] = ()  # branch indices from the prompt: (root, continuation, ...)

    @property
    def turn(self) -> int:
        return self.state.turns


@dataclass(frozen=True)
class Rollout:
    """A finished episode: one trajectory of a prompt's rollout tree."""

    prompt: int
    tokens: np.ndarray  # int64 [L]
    loss_mask: np.ndarray  # bool [L]: the policy's call tokens
    old_logprobs: np.ndarray  # float64 [L]: the policy's log-prob of each call token, 0 elsewhere
    turns: tuple[Turn, ...]
    reward: float
    path: tuple[int, ...]
    branch_turn: int = 0  # the turn boundary it branched from (0: a root episode)
    extra: dict = field(default_factory=dict)


def run_episodes(policy: Policy, env: Switchboard, starts: Sequence[Prefix],
                 rngs: Sequence[np.random.Generator], config: SamplingConfig) -> list[Rollout]:
    """Run every start prefix to the end of its episode, all advanced together one token
    per policy call."""
    config = config.validate()
    if len(starts) != len(rngs):
        raise SamplingError("one generator per start prefix")
    active = [(i, list(s.tokens), list(s.logprobs), list(s.mask), s.state) for i, s in enumerate(starts)]
    done: dict[int, Rollout] = {}
    while active:
        calls: list[list[int]] = [[] for _ in active]
        for _ in range(CALL_TOKENS):
            logp = policy.next_logprobs([np.asarray(a[1] + c, dtype=np.int64) for a, c in zip(active, calls, strict=True)])
            for k, (i, *_rest) in enumerate(active):
                tok = draw(logp[k], rngs[i], config)
                calls[k].append(tok)
                active[k][2].append(float(logp[k, tok]))
        nxt = []
        for (i, toks, lps, mask, state), call in zip(active, calls, strict=True):
            start = len(toks)
            out = env.step(state, tuple(call), start)
            toks = toks + call + list(out.observation)
            lps = lps + [0.0] * len(out.observation)
            mask = mask + [True] * len(call) + [False] * len(out.observation)
            if out.done:
                s = starts[i]
                done[i] = Rollout(s.prompt, np.asarray(toks, dtype=np.int64), np.asarray(mask, dtype=bool),
                                  np.asarray(lps, dtype=np.float64), out.state.history, float(out.reward),
                                  s.path, branch_turn=s.turn)
            else:
                nxt.append((i, toks, lps, mask, out.state))
        active = nxt
    return [done[i] for i in range(len(starts))]


def prompt_prefix(env: Switchboard, prompt: int) -> Prefix:
    tokens, state = env.reset(prompt)
    return Prefix(prompt, tuple(tokens), (0.0,) * len(tokens), (False,) * len(tokens), state)


def _rng(config: SamplingConfig, step: int, prompt: int, phase: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([config.seed, step, prompt, phase, index]))


def boundary_prefixes(env: Switchboard, rollout: Rollout) -> list[Prefix]:
    """The intermediate turn boundaries of a finished episode (after turn t for t = 1 ..
    T - 1: the episode still running there), replayed through the environment so each
    carries its state."""
    tokens, state = env.reset(rollout.prompt)
    out = []
    for turn in rollout.turns[:-1]:
        step = env.step(state, tuple(int(x) for x in rollout.tokens[turn.start:turn.end]), turn.start)
        state = step.state
        end = turn.end + OBS_TOKENS
        out.append(Prefix(rollout.prompt, tuple(int(x) for x in rollout.tokens[:end]),
                          tuple(float(x) for x in rollout.old_logprobs[:end]),
                          tuple(bool(x) for x in rollout.loss_mask[:end]), state, rollout.path))
    return out


# An expansion allocation: given the finished root episodes, which prefixes get how many
# further continuations ((prefix, count) pairs; counts >= 0).
Expansion = Callable[[Sequence[Rollout]], Sequence[tuple[Prefix, int]]]


def sample_tree_rollouts(policy: Policy, env: Switchboard, prompts: Sequence[int], roots: Sequence[int],
                         expand: Expansion | None, config: SamplingConfig, step: int = 0) -> list[Rollout]:
    """Root episodes (`roots[i]` from prompt i), then continuations from the intermediate
    prefixes the `expand` allocation picks. Rollouts come back prompt by prompt, roots
    first, then continuations in the allocation's order."""
    if len(prompts) != len(roots):
        raise SamplingError("one root count per prompt")
    if any(r < 0 for r in roots):
        raise SamplingError("root counts must be >= 0")
    starts, rngs = [], []
    for prompt, r in zip(prompts, roots, strict=True):
        base = prompt_prefix(env, prompt)
        for k in range(r):
            starts.append(Prefix(base.prompt, base.tokens, base.logprobs, base.mask, base.state, (k,)))
            rngs.append(_rng(config, step, prompt, 0, k))
    rollouts = run_episodes(policy, env, starts, rngs, config)
    if expand is not None and rollouts:
        more, more_rngs = [], []
        for ci, (cand, c) in enumerate(expand(rollouts)):
            if int(c) < 0:
                raise SamplingError("the expansion allocation must give counts >= 0")
            for k in range(int(c)):
                more.append(Prefix(cand.prompt, cand.tokens, cand.logprobs, cand.mask, cand.state,
                                   cand.path + (cand.turn, k)))
                more_rngs.append(_rng(config, step, cand.prompt, 1 + ci, k))
        rollouts += run_episodes(policy, env, more, more_rngs, config)
    order = {p: i for i, p in enumerate(prompts)}
    return sorted(rollouts, key=lambda r: order[r.prompt])  # stable: roots, then continuations


__all__ = [
    "Expansion", "HFCausalLMPolicy", "boundary_prefixes", "HartsPolicy", "Policy", "Prefix", "Rollout", "SamplingConfig",
    "SamplingError", "draw", "prompt_prefix", "run_episodes", "sample_tree_rollouts",
]
