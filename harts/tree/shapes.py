"""Families of rollout-tree shapes, drawn at the scale of a microbatch budget.

Each family is a way agentic-RL steps share tokens; an instance is drawn from a seed and
sized relative to a budget `B` (the microbatch token budget it will be planned with), so
the same family is "the same shape" at 8k, 16k and 32k: every trajectory fits the budget
(the longest path is at most `MAX_PATH` x B), one tree is larger than B (so a planner must
split it into sharing windows) and all of them hold at most `MAX_COMPACT_BUDGETS` x B rows. Families:

- `grpo`: one prompt (0.25-0.45 B, untrained) and 8-24 responses (each up to what fits),
  the GRPO group;
- `bushy`: a prompt (0.1-0.2 B) branching 3-4 ways per level over two levels of short
  multi-turn nodes (observation untrained, action trained), 9-16 leaves;
- `fanout`: one very long prompt (0.5-0.8 B) and 32-96 short responses (0.012-0.04 B);
- `stepwise`: 2-3 prompts x 3-5 multi-turn rollouts, every turn prefix a sequence that
  trains its last action (the step-wise sampling scheme);
- `swe-tree`: a SWE-agent-like tree: a prompt, chains of observation/action turns that
  fork 2-3 ways at 2-3 turn boundaries (tree-step sampling), paths to 0.5-0.9 B;
- `long-chain`: one chain that nearly fills the budget (0.7-0.95 B) with 4-12 short
  branches off it at random turns, beside 2-6 short independent trajectories.

`LONG_FAMILIES` are drawn the same way but their longest path is longer than the budget
(1.5-`LONG_MAX_PATH` B), so a planner cuts it into a chain of windows; they hold at most
`LONG_MAX_COMPACT_BUDGETS` x B rows:

- `long-agent`: an agent trajectory of observation/action turns running to 1.5-4 B, with
  2-5 short branches off it at random turns (forks anywhere along the chain), beside 1-3
  short independent trajectories;
- `long-group`: a GRPO group whose responses run long: a prompt (0.1-0.6 B) and 2-6
  responses of 0.2-1.2 B, one of them running on past the budget (1.1 B to the longest
  path).

`draw(family, seed, budget)` (either kind of family) gives the trajectories (token ids below `vocab_size`,
siblings' first tokens distinct so token-level forks sit at segment-level ones, random
advantages per trajectory and old log-probs); `FAMILIES` lists the names. These are the
benchmark suites' instances (benchmarks/gpu/window_suite.py) and the simulator's
validation cases; numpy only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from harts.tree.trajectory import Trajectory

MAX_PATH = 0.95  # longest path, as a fraction of the budget
MAX_COMPACT_BUDGETS = 4.0  # at most this many budgets of compact rows per instance
LONG_MAX_PATH = 4.0  # a long family's longest path, as a fraction of the budget
LONG_MAX_COMPACT_BUDGETS = 6.0


@dataclass
class _Node:
    """A segment of the tree: `length` tokens, trained or not, children after it."""

    length: int
    trained: bool
    children: list[_Node]


def _seg(length: float, trained: bool) -> _Node:
    return _Node(max(1, int(length)), trained, [])


def _chain(nodes: list[_Node]) -> _Node:
    for a, b in zip(nodes, nodes[1:], strict=False):
        a.children.append(b)
    return nodes[0]


def _tail(node: _Node) -> _Node:
    while node.children:
        node = node.children[-1]
    return node


def _turns(rng: np.random.Generator, budget: int, room: float, obs: tuple[float, float],
           act: tuple[float, float], turns: int) -> list[_Node]:
    """Up to `turns` (observation, action) pairs, stopping before `room` tokens."""
    out: list[_Node] = []
    used = 0.0
    for _ in range(turns):
        o, a = rng.uniform(*obs) * budget, rng.uniform(*act) * budget
        if used + o + a > room:
            break
        out += [_seg(o, False), _seg(a, True)]
        used += o + a
    return out


def _grpo(rng: np.random.Generator, budget: int) -> list[_Node]:
    prompt = rng.uniform(0.25, 0.45) * budget
    root = _seg(prompt, False)
    room = MAX_PATH * budget - prompt
    for _ in range(int(rng.integers(8, 25))):
        root.children.append(_seg(rng.uniform(0.1, 1.0) * room, True))
    return [root]


def _bushy(rng: np.random.Generator, budget: int) -> list[_Node]:
    branching = int(rng.integers(3, 5))
    root = _seg(rng.uniform(0.1, 0.2) * budget, False)
    level = [root]
    per_level = (MAX_PATH * budget - root.length) / 2
    for _ in range(2):
        nxt = []
        for parent in level:
            for _ in range(branching):
                turns = _turns(rng, budget, per_level, (0.02, 0.06), (0.01, 0.04), int(rng.integers(1, 4)))
                if not turns:
                    turns = [_seg(0.01 * budget, True)]
                parent.children.append(_chain(turns))
                nxt.append(_tail(turns[0]))
        level = nxt
    return [root]


def _fanout(rng: np.random.Generator, budget: int) -> list[_Node]:
    root = _seg(rng.uniform(0.5, 0.8) * budget, False)
    for _ in range(int(rng.integers(32, 97))):
        root.children.append(_seg(rng.uniform(0.012, 0.04) * budget, True))
    return [root]


def _stepwise(rng: np.random.Generator, budget: int) -> list[_Node]:
    """Each rollout's turn prefixes as sequences: a chain whose every action ends a
    sequence (`_paths` emits a sequence at each trained node marked as an end)."""
    roots = []
    for _ in range(int(rng.integers(2, 4))):
        prompt = _seg(rng.uniform(0.05, 0.15) * budget, False)
        for _ in range(int(rng.integers(3, 6))):
            turns = _turns(rng, budget, MAX_PATH * budget - prompt.length, (0.01, 0.05), (0.005, 0.03),
                           int(rng.integers(4, 11)))
            if turns:
                prompt.children.append(_chain(turns))
        roots.append(prompt)
    return roots


def _swe_tree(rng: np.random.Generator, budget: int) -> list[_Node]:
    prompt = _seg(rng.uniform(0.08, 0.15) * budget, False)
    path_len = rng.uniform(0.5, 0.9) * budget

    def grow(parent: _Node, used: float, forks: int) -> None:
        room = path_len - used
        turns = _turns(rng, budget, room, (0.01, 0.06), (0.005, 0.02), 400)
        if not turns:
            turns = [_seg(0.005 * budget, True)]
        parent.children.append(_chain(turns))
        if forks <= 0:
            return
        # fork after U(0.3, 0.8) of this chain's turns
        k = max(1, int(len(turns) // 2 * rng.uniform(0.3, 0.8))) * 2
        head, rest = turns[:k], turns[k:]
        if not rest:
            return
        head[-1].children = []
        at = used + sum(n.length for n in head)
        for _ in range(int(rng.integers(2, 4))):
            grow(head[-1], at, forks - 1)

    grow(prompt, prompt.length, int(rng.integers(2, 4)))
    return [prompt]


def _branches(rng: np.random.Generator, budget: int, prompt: _Node, turns: list[_Node], count: tuple[int, int],
              length: tuple[float, float], max_path: float, trained_only: bool) -> None:
    """U(count) short trained branches (U(length) x B) off the chain `prompt` -> `turns`,
    after drawn turns (trained ones only, with `trained_only`), none past `max_path` x B."""
    depth, points = prompt.length, []
    for n in turns:
        depth += n.length
        if n.trained or not trained_only:
            points.append((n, depth))
    for i in rng.choice(len(points), size=min(len(points), int(rng.integers(*count))), replace=False):
        node, at = points[int(i)]
        room = max_path * budget - at
        if room > 2:
            node.children.append(_seg(min(room - 1, rng.uniform(*length) * budget), True))


def _singles(rng: np.random.Generator, budget: int, count: tuple[int, int], obs: tuple[float, float],
             act: tuple[float, float]) -> list[_Node]:
    """U(count) short independent trajectories: an observation and an action."""
    return [_chain([_seg(rng.uniform(*obs) * budget, False), _seg(rng.uniform(*act) * budget, True)])
            for _ in range(int(rng.integers(*count)))]


def _long_chain(rng: np.random.Generator, budget: int) -> list[_Node]:
    prompt = _seg(rng.uniform(0.05, 0.1) * budget, False)
    turns = _turns(rng, budget, rng.uniform(0.7, MAX_PATH) * budget - prompt.length, (0.01, 0.05),
                   (0.005, 0.02), 1000)
    prompt.children.append(_chain(turns))
    _branches(rng, budget, prompt, turns, (4, 13), (0.02, 0.1), MAX_PATH, trained_only=True)
    return [prompt, *_singles(rng, budget, (2, 7), (0.02, 0.05), (0.03, 0.15))]


def _long_agent(rng: np.random.Generator, budget: int) -> list[_Node]:
    prompt = _seg(rng.uniform(0.05, 0.15) * budget, False)
    length = rng.uniform(1.5, LONG_MAX_PATH) * budget
    turns = _turns(rng, budget, length - prompt.length, (0.01, 0.08), (0.005, 0.03), 10_000)
    prompt.children.append(_chain(turns))
    _branches(rng, budget, prompt, turns, (2, 6), (0.02, 0.3), LONG_MAX_PATH, trained_only=False)
    return [prompt, *_singles(rng, budget, (1, 4), (0.02, 0.1), (0.05, 0.3))]


def _long_group(rng: np.random.Generator, budget: int) -> list[_Node]:
    root = _seg(rng.uniform(0.1, 0.6) * budget, False)
    room = LONG_MAX_PATH * budget - root.length
    lengths = rng.uniform(0.2, 1.2, size=int(rng.integers(2, 7))) * budget
    lengths[int(rng.integers(len(lengths)))] = rng.uniform(1.1 * budget, room)  # one past the budget
    for n in lengths:
        root.children.append(_seg(n, True))
    return [root]


FAMILIES: dict[str, Callable[[np.random.Generator, int], list[_Node]]] = {
    "grpo": _grpo,
    "bushy": _bushy,
    "fanout": _fanout,
    "stepwise": _stepwise,
    "swe-tree": _swe_tree,
    "long-chain": _long_chain,
}
STEPWISE = {"stepwise"}  # families whose every action ends a sequence
LONG_FAMILIES: dict[str, Callable[[np.random.Generator, int], list[_Node]]] = {
    "long-agent": _long_agent,
    "long-group": _long_group,
}


def _paths(root: _Node, every_action: bool) -> list[list[_Node]]:
    out: list[list[_Node]] = []

    def walk(node: _Node, path: list[_Node]) -> None:
        path = [*path, node]
        if not node.children or (every_action and node.trained):
            out.append(path)
        for child in node.children:
            walk(child, path)

    walk(root, [])
    return out


def draw(family: str, seed: int, budget: int, vocab_size: int = 32768, _tries: int = 0) -> list[Trajectory]:
    """One instance of `family` at budget `budget` (module docstring): one tree larger
    than the budget at least, at most `MAX_COMPACT_BUDGETS` budgets of rows in all
    (`LONG_MAX_COMPACT_BUDGETS` for a long family, whose longest path is past the budget)."""
    long = family in LONG_FAMILIES
    if family not in FAMILIES and not long:
        raise KeyError(f"unknown shape family {family!r} (known: {', '.join([*FAMILIES, *LONG_FAMILIES])})")
    if budget < 256:
        raise ValueError(f"budget {budget}: shape families are drawn at budgets of at least 256 tokens")
    rng = np.random.default_rng([seed, budget, len(FAMILIES) + sorted(LONG_FAMILIES).index(family) if long
                                 else sorted(FAMILIES).index(family)])
    roots = (LONG_FAMILIES if long else FAMILIES)[family](rng, budget)
    every_action = family in STEPWISE
    # token ids per segment; a segment's first token is its index among its siblings, so
    # siblings fork at their first token
    tokens: dict[int, np.ndarray] = {}

    def fill(node: _Node, sibling: int) -> None:
        t = rng.integers(0, vocab_size, size=node.length, dtype=np.int64)
        t[0] = sibling % vocab_size
        tokens[id(node)] = t
        for i, c in enumerate(node.children):
            fill(c, i)

    out: list[Trajectory] = []
    compact = 0
    for g, root in enumerate(roots):
        fill(root, g)
        compact += _count(root)
        for j, path in enumerate(_paths(root, every_action)):
            toks = np.concatenate([tokens[id(n)] for n in path])
            last = path[-1]
            if every_action:  # step-wise: each sequence trains its last action only
                mask = np.concatenate([np.full(n.length, n is last) for n in path])
            else:
                mask = np.concatenate([np.full(n.length, n.trained) for n in path])
            mask[0] = False
            old = np.where(mask, -rng.exponential(1.0, size=toks.size), 0.0)
            out.append(Trajectory.make(f"{family}{g}/{j}", f"{family}{g}", toks, mask,
                                       float(np.round(rng.normal(), 6)), old))
    longest = max(t.tokens.size for t in out)
    assert longest <= (LONG_MAX_PATH if long else 1.0) * budget, (family, seed, budget, longest)
    # a tree larger than the budget (so a planner must split it into windows), a path past
    # it in a long family, and a few budgets in all: otherwise the next draw of the seed's
    # sequence
    if (max(_count(r) for r in roots) <= budget or (long and longest <= budget)
            or compact > (LONG_MAX_COMPACT_BUDGETS if long else MAX_COMPACT_BUDGETS) * budget):
        if _tries >= 100:
            raise RuntimeError(f"shape family {family!r}: no instance of the wanted size at budget {budget}")
        return draw(family, seed + 1_000_003, budget, vocab_size, _tries + 1)
    return out


def _count(node: _Node) -> int:
    return node.length + sum(_count(c) for c in node.children)
