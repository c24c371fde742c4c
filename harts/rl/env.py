"""Toy agentic environments: deterministic, offline, multi-turn, a terminal reward in [0, 1].

Legend: V vocabulary size, S states, K tools, A argument values.

`switchboard` (the default) is a panel that shows one state word at a time. The policy
answers each observation with a tool call of two tokens, `[tool, argument]`; the
environment answers with two tokens, `[outcome, next observation]`. The right call for a
state is fixed by the environment's rule table (the same for every episode), so the right
tool depends on the observation and a policy can learn it; an episode is a seeded chain of
`depth` states to clear within `max_turns` calls, and its reward is the share of the chain
cleared (`switchboard-outcome`: 1 for a cleared chain, else 0, with chain lengths drawn per
prompt). A right call answers `OK` and shows the next state; a wrong one answers `FAIL` and
shows the same state again; the last answer ends in `END`.

The call grammar is total, so a policy that has learnt nothing still makes calls that
mean something (a random policy's reward is well inside (0, 1), which gives GRPO mixed
groups from the first step): the tool slot reads token id mod K as the tool, the argument
slot reads token id mod A as the argument value. Every token id is thus one spelling of a
tool and of an argument; the turn record keeps the normalised tool name and arguments
(what RTMC signatures match on) and the raw tokens beside them.

Token layout (V = 16 by default): 0 BOS, 1 OK, 2 FAIL, 3 END, 4.. the S state words; every
id is also a call word. A trajectory is `[BOS, s0]` then per turn `[tool, arg, outcome,
obs]`; loss is on the policy's two tokens of each turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from harts.config.registry import Registry

BOS, OK, FAIL, END = 0, 1, 2, 3
STATE_BASE = 4
CALL_TOKENS = 2  # tokens the policy emits per turn: [tool, argument]
OBS_TOKENS = 2  # tokens the environment answers with: [outcome, observation]

TOOL_NAMES = ("push", "pull", "turn", "lift", "tap", "hold", "flip", "slide")


class EnvError(ValueError):
    """An environment config or call that breaks the contract; the message names it."""


class EnvName(StrEnum):
    SWITCHBOARD = "switchboard"
    SWITCHBOARD_HARD = "switchboard-hard"
    SWITCHBOARD_OUTCOME = "switchboard-outcome"


class RewardKind(StrEnum):
    PROGRESS = "progress"  # the share of the chain cleared: cleared / depth
    OUTCOME = "outcome"  # 1 if the whole chain is cleared, else 0 (a pass/fail task)


@dataclass(frozen=True)
class EnvConfig:
    name: str
    vocab_size: int = 16
    num_states: int = 4  # S state words
    num_tools: int = 2  # K
    num_args: int = 2  # A
    depth: int = 2  # states to clear per episode
    max_turns: int = 3  # calls allowed per episode
    rule_seed: int = 0  # the environment's fixed rule table
    reward: str = RewardKind.PROGRESS
    # non-empty: each prompt's chain length is drawn from these (seeded by the prompt), so
    # prompts differ in difficulty; `depth` is then unused
    depth_choices: tuple[int, ...] = ()

    @property
    def depths(self) -> tuple[int, ...]:
        """The chain lengths a prompt can have."""
        return tuple(self.depth_choices) or (self.depth,)

    def validate(self) -> EnvConfig:
        for f in ("vocab_size", "num_states", "num_tools", "num_args", "depth", "max_turns"):
            if getattr(self, f) < 1:
                raise EnvError(f"{f} must be >= 1, got {getattr(self, f)}")
        if STATE_BASE + self.num_states > self.vocab_size:
            raise EnvError(f"vocab_size {self.vocab_size} holds no {self.num_states} state words after "
                           f"{STATE_BASE} specials")
        if self.num_tools > len(TOOL_NAMES):
            raise EnvError(f"num_tools must be <= {len(TOOL_NAMES)}, got {self.num_tools}")
        if self.reward not in tuple(RewardKind):
            raise EnvError(f"reward must be one of {', '.join(RewardKind)}, got {self.reward!r}")
        if any(d < 1 for d in self.depth_choices):
            raise EnvError(f"depth_choices must be >= 1, got {self.depth_choices}")
        if self.max_turns < max(self.depths):
            raise EnvError(f"max_turns {self.max_turns} < depth {max(self.depths)}: no episode could be cleared")
        return self

    @property
    def max_length(self) -> int:
        return 2 + self.max_turns * (CALL_TOKENS + OBS_TOKENS)


@dataclass(frozen=True)
class Call:
    """One parsed tool call: the normalised tool name and arguments, and the raw tokens."""

    tool: str
    args: dict[str, int]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Turn:
    """One turn's step structure: token range [start, end) of the policy's call in the
    trajectory, the normalised call and its outcome ("ok" or "fail")."""

    start: int
    end: int
    tool: str
    args: dict[str, int]
    outcome: str

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "tool": self.tool, "args": dict(self.args),
                "outcome": self.outcome}


@dataclass(frozen=True)
class EpisodeState:
    """Where an episode stands: the prompt's chain, how much of it is cleared, how many
    calls were made. Immutable, so branches of a rollout tree share it safely."""

    chain: tuple[int, ...]  # state index per position of the chain
    cleared: int = 0
    turns: int = 0
    history: tuple[Turn, ...] = field(default=())

    @property
    def observation(self) -> int:
        return self.chain[min(self.cleared, len(self.chain) - 1)]


@dataclass(frozen=True)
class StepOutcome:
    state: EpisodeState
    observation: tuple[int, ...]  # the tokens the environment answers with
    done: bool
    reward: float  # the terminal reward once done, else 0


class Switchboard:
    """The `switchboard` environment (module docstring): `reset(seed)` gives a prompt and a
    state, `step(state, call_tokens, start)` the answer and the next state."""

    def __init__(self, config: EnvConfig):
        self.config = config.validate()
        rng = np.random.default_rng(np.random.SeedSequence([config.rule_seed, 0x5B]))
        self.rule_tool = rng.integers(0, config.num_tools, size=config.num_states)
        self.rule_arg = rng.integers(0, config.num_args, size=config.num_states)

    @property
    def name(self) -> str:
        return self.config.name

    def reset(self, seed: int) -> tuple[tuple[int, ...], EpisodeState]:
        """The prompt tokens and the start state of episode `seed` (same seed, same episode)."""
        rng = np.random.default_rng(np.random.SeedSequence([self.config.rule_seed, 0xE9, int(seed)]))
        depth = self.config.depth
        if self.config.depth_choices:
            depth = int(self.config.depth_choices[int(rng.integers(len(self.config.depth_choices)))])
        chain = tuple(int(s) for s in rng.integers(0, self.config.num_states, size=depth))
        state = EpisodeState(chain)
        return (BOS, STATE_BASE + state.observation), state

    def parse(self, tokens: tuple[int, ...]) -> Call:
        """The call a policy's tokens make (total: every pair of ids is a call)."""
        if len(tokens) != CALL_TOKENS:
            raise EnvError(f"a call is {CALL_TOKENS} tokens, got {len(tokens)}")
        tool_tok, arg_tok = (int(t) for t in tokens)
        for t in (tool_tok, arg_tok):
            if not 0 <= t < self.config.vocab_size:
                raise EnvError(f"token {t} is outside the vocabulary (size {self.config.vocab_size})")
        return Call(TOOL_NAMES[tool_tok % self.config.num_tools], {"slot": arg_tok % self.config.num_args},
                    (tool_tok, arg_tok))

    def correct_call(self, state: EpisodeState) -> tuple[str, dict[str, int]]:
        s = state.observation
        return TOOL_NAMES[int(self.rule_tool[s])], {"slot": int(self.rule_arg[s])}

    def step(self, state: EpisodeState, call_tokens: tuple[int, ...], start: int) -> StepOutcome:
        """Answer the call whose tokens sit at [start, start + 2) of the trajectory."""
        if state.cleared >= len(state.chain) or state.turns >= self.config.max_turns:
            raise EnvError("step on a finished episode")
        call = self.parse(call_tokens)
        right = (call.tool, call.args) == self.correct_call(state)
        cleared = state.cleared + int(right)
        turns = state.turns + 1
        turn = Turn(start, start + CALL_TOKENS, call.tool, call.args, "ok" if right else "fail")
        nxt = EpisodeState(state.chain, cleared, turns, state.history + (turn,))
        done = cleared >= len(state.chain) or turns >= self.config.max_turns
        outcome = OK if right else FAIL
        obs = (outcome, END) if done else (outcome, STATE_BASE + nxt.observation)
        reward = self._reward(cleared, len(state.chain)) if done else 0.0
        return StepOutcome(nxt, obs, done, reward)

    def _reward(self, cleared: int, depth: int) -> float:
        if self.config.reward == RewardKind.OUTCOME:
            return float(cleared >= depth)
        return min(cleared, depth) / depth

    def prompt_features(self, seed: int) -> list[float]:
        """What an allocator may know of prompt `seed` before sampling: its start state
        (one-hot) and, where chain lengths vary, its length (one-hot over `depth_choices`)."""
        c = self.config
        _, state = self.reset(seed)
        f = [0.0] * c.num_states
        f[state.observation] = 1.0
        if c.depth_choices:
            d = [0.0] * len(c.depth_choices)
            d[c.depth_choices.index(len(state.chain))] = 1.0
            f += d
        return f

    def optimal_reward(self) -> float:
        return 1.0

    def random_reward(self) -> float:
        """The expected reward of a policy whose calls are uniform over the vocabulary,
        exactly (a small dynamic programme over (cleared, turns), averaged over the chain
        lengths a prompt can have)."""
        c = self.config
        p = _uniform_success(c)
        total = 0.0
        for depth in c.depths:
            dist = {0: 1.0}
            for _ in range(c.max_turns):
                nxt: dict[int, float] = {}
                for k, w in dist.items():
                    if k >= depth:
                        nxt[k] = nxt.get(k, 0.0) + w
                        continue
                    nxt[k + 1] = nxt.get(k + 1, 0.0) + w * p
                    nxt[k] = nxt.get(k, 0.0) + w * (1 - p)
                dist = nxt
            total += sum(self._reward(k, depth) * w for k, w in dist.items())
        return total / len(c.depths)


def _uniform_success(c: EnvConfig) -> float:
    """P(a call uniform over the vocabulary is right), averaged over the rule's states
    (each class of ids mod K / mod A holds ceil or floor of V / K ids)."""
    tools = np.bincount(np.arange(c.vocab_size) % c.num_tools, minlength=c.num_tools) / c.vocab_size
    args = np.bincount(np.arange(c.vocab_size) % c.num_args, minlength=c.num_args) / c.vocab_size
    env = Switchboard(c)
    return float(np.mean([tools[env.rule_tool[s]] * args[env.rule_arg[s]] for s in range(c.num_states)]))


_ENVS: Registry[EnvName, EnvConfig] = Registry("environment", EnvName, EnvError, "known environments")
_ENVS.register(EnvName.SWITCHBOARD, EnvConfig("switchboard").validate())
_ENVS.register(EnvName.SWITCHBOARD_HARD, EnvConfig("switchboard-hard", num_states=6, num_tools=3, num_args=2,
                                                   depth=3, max_turns=4).validate())
# pass/fail prompts of mixed difficulty: the switchboard's panel and rules, reward 1 only for
# a cleared chain, chains of 1, 2 or 4 states in 5 calls (a uniform policy clears them with
# probability 0.76, 0.37, 0.016): a prompt's rollouts can all pass or all fail, and "mixed
# rewards" is the binary notion TRACE allocates for
_ENVS.register(EnvName.SWITCHBOARD_OUTCOME, EnvConfig("switchboard-outcome", reward=RewardKind.OUTCOME,
                                                      depth_choices=(1, 2, 4), max_turns=5).validate())


def known_envs() -> list[str]:
    return _ENVS.known()


def get_env_config(name: str) -> EnvConfig:
    return _ENVS.get(name)


def make_env(name: str | EnvConfig) -> Switchboard:
    """The environment registered under `name` (or built from a config)."""
    return Switchboard(name if isinstance(name, EnvConfig) else get_env_config(name))


__all__ = [
    "BOS", "CALL_TOKENS", "END", "FAIL", "OBS_TOKENS", "OK", "STATE_BASE", "TOOL_NAMES",
    "Call", "EnvConfig", "EnvError", "EnvName", "EpisodeState", "StepOutcome", "Switchboard", "Turn",
    "get_env_config", "known_envs", "make_env",
]
