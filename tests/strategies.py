"""Hypothesis strategies shared by the test suite (one section per owner; add yours with a
targeted edit, never rewrite the file)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

# KDA call planner (harts/plan/kda_calls.py): small rollout forests whose segment lengths
# put forks on chunk boundaries, inside a chain's first chunk, or mid-chunk further down.


@dataclass(frozen=True)
class KDATreeCase:
    """A forest in DFS preorder plus a chunk size; has the attributes plan_kda_calls_for reads."""

    node_parent: tuple[int, ...]
    node_start: tuple[int, ...]
    node_end: tuple[int, ...]
    chunk_size: int


def kda_tree_from_lengths(
    parents: list[int] | tuple[int, ...], lengths: list[int] | tuple[int, ...], chunk_size: int
) -> KDATreeCase:
    """Build a case from parent ids (parents first) and segment lengths (token counts)."""
    starts: list[int] = []
    ends: list[int] = []
    for p, length in zip(parents, lengths, strict=True):
        s = 0 if p < 0 else ends[p]
        starts.append(s)
        ends.append(s + length)
    return KDATreeCase(tuple(parents), tuple(starts), tuple(ends), chunk_size)


# Binary twice: it is the shape that reaches three rounds within a dozen nodes.
_KDA_SHAPES = ("bushy", "binary", "binary", "forest", "chain", "fan", "caterpillar")


@st.composite
def small_kda_trees(
    draw: st.DrawFn, max_nodes: int = 12, chunk_sizes: tuple[int, ...] = (2, 3, 4, 8)
) -> KDATreeCase:
    """Small forests for exhaustive checks of the KDA call planner.

    Shapes: bushy trees (0-3 children per node), full binary trees (the shape that needs
    the most rounds), forests (several roots), deep chains, wide fans (all children of the
    root) and caterpillars (each spine node has a leaf first, then the next spine node, so
    the better continuation is not the first child). Each segment length is drawn to end
    exactly on a chunk boundary, stay inside its chunk, cross one boundary, or be long.
    """
    B = draw(st.sampled_from(chunk_sizes))
    shape = draw(st.sampled_from(_KDA_SHAPES))
    parents: list[int] = []
    if shape in ("bushy", "binary"):
        # Preorder by a stack of open child slots; a slot is only opened if it can be filled.
        slots = [-1]
        while slots:
            p = slots.pop()
            v = len(parents)
            parents.append(p)
            room = max_nodes - len(parents) - len(slots)
            fanout = draw(st.sampled_from((2, 2, 0) if shape == "binary" else (0, 1, 2, 3)))
            if fanout <= room:
                slots.extend([v] * fanout)
    else:
        n = draw(st.integers(1, max_nodes))
        path: list[int] = []
        for v in range(n):
            if v == 0:
                depth = 0
            elif shape == "chain":
                depth = len(path)
            elif shape == "fan":
                depth = 1
            elif shape == "caterpillar":
                depth = len(path) if v % 2 else len(path) - 1
            else:
                depth = draw(st.integers(0, len(path)))
            parents.append(path[depth - 1] if depth else -1)
            del path[depth:]
            path.append(v)
    lengths: list[int] = []
    ends: list[int] = []
    for p in parents:
        s = 0 if p < 0 else ends[p]
        to_boundary = B - s % B
        # "inside" twice: short segments that fork inside their chain's first chunk are
        # where the planner's IN/OUT distinction decides the continuation.
        kind = draw(st.sampled_from(("boundary", "inside", "inside", "cross", "long")))
        if kind == "boundary":
            length = to_boundary + B * draw(st.integers(0, 1))
        elif kind == "inside" and to_boundary > 1:
            length = draw(st.integers(1, to_boundary - 1))
        elif kind == "cross" and B > 1:
            length = to_boundary + draw(st.integers(1, B - 1))
        else:
            length = draw(st.integers(1, 3 * B))
        lengths.append(length)
        ends.append(s + length)
    return kda_tree_from_lengths(parents, lengths, B)


# Rollout-tree core (harts/tree): trajectory sets built to share prefixes. Tokens come from
# a tiny alphabet and many trajectories extend earlier ones, so prefixes, duplicates, forks
# at position 0 and forks deep inside segments all appear often.


@st.composite
def trajectory_sets(
    draw: st.DrawFn,
    max_groups: int = 3,
    max_per_group: int = 6,
    max_len: int = 24,
    alphabet: int = 3,
    with_ref: bool | None = None,
):
    import numpy as np

    from harts.tree.trajectory import Trajectory

    num_groups = draw(st.integers(1, max_groups))
    ref = draw(st.booleans()) if with_ref is None else with_ref
    out = []
    for g in range(num_groups):
        seqs: list[list[int]] = []
        for _ in range(draw(st.integers(1, max_per_group))):
            how = draw(st.sampled_from(("fresh", "extend", "prefix", "duplicate")))
            if seqs and how != "fresh":
                base = draw(st.sampled_from(seqs))
                if how == "extend":
                    cut = draw(st.integers(0, len(base)))
                    tail = draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_len // 2))
                    seq = base[:cut] + tail
                elif how == "prefix":
                    seq = base[: draw(st.integers(1, len(base)))]
                else:
                    seq = list(base)
            else:
                seq = draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=max_len))
            seqs.append(seq[:max_len] or [0])
        for i, seq in enumerate(seqs):
            n = len(seq)
            mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
            mask[0] = False
            scalar = draw(st.booleans())
            floats = st.floats(-5, 5, allow_nan=False, width=32)
            adv = draw(floats) if scalar else draw(st.lists(floats, min_size=n, max_size=n))
            old = draw(st.lists(st.floats(-9, 0, allow_nan=False, width=32), min_size=n, max_size=n))
            refl = (
                draw(st.lists(st.floats(-9, 0, allow_nan=False, width=32), min_size=n, max_size=n))
                if ref
                else None
            )
            out.append(
                Trajectory.make(f"g{g}-t{i}", f"g{g}", np.asarray(seq), np.asarray(mask), adv, old, refl)
            )
    # shuffle across groups so the builder cannot rely on input order
    return draw(st.permutations(out))


# ---- simulator (harts/sim): steps of microbatches with sharing windows, engine programs --


@st.composite
def sim_steps(draw: st.DrawFn, max_replicas: int = 3, max_windows: int = 3, max_consumers: int = 3):
    """A StepWork: per replica, windows of a producer and its consumers or plain
    microbatches, with small random token counts, KDA rounds and attention pairs."""
    from harts.plan.work import KDARound, MicrobatchWork, StepWork

    replicas = draw(st.integers(1, max_replicas))
    mbs = []
    nxt = 0
    for r in range(replicas):
        slot = 0
        for _ in range(draw(st.integers(1, max_windows))):
            with_producer = draw(st.booleans())
            producer = None
            if with_producer:
                producer = nxt
                mbs.append(_sim_mb(draw, nxt, r, slot, None, KDARound, MicrobatchWork))
                nxt += 1
            for _ in range(draw(st.integers(1 if not with_producer else 0, max_consumers))):
                mbs.append(_sim_mb(draw, nxt, r, slot, producer, KDARound, MicrobatchWork))
                nxt += 1
                slot += 1
            if with_producer and mbs[-1].mb == producer:
                slot += 1
    expanded = sum(m.expanded_tokens for m in mbs) or 1
    return StepWork(tuple(mbs), replicas, expanded_tokens=expanded)


def _sim_mb(draw, mb, replica, slot, producer, KDARound, MicrobatchWork):
    tokens = draw(st.integers(1, 6000))
    rounds = tuple(
        KDARound(t, max(1, -(-t // 64)), 1)
        for t in draw(st.lists(st.integers(1, tokens + 63), min_size=1, max_size=3))
    )
    tree = draw(st.booleans())
    pairs = draw(st.integers(tokens, tokens * (tokens + 1) // 2 + tokens * 4000))
    return MicrobatchWork(
        mb=mb, replica=replica, tokens=tokens, kda_rounds=rounds,
        attn_pairs_causal=0 if tree else pairs, attn_pairs_tree=pairs if tree else 0,
        producer=producer, slot=slot, order=mb,
        expanded_tokens=0 if producer == mb else draw(st.integers(tokens, 4 * tokens)),
    )


@st.composite
def device_host_actions(draw: st.DrawFn, max_actions: int = 12) -> list[tuple[float, float]]:
    """(device seconds, host seconds) of actions run in sequence on one lane."""
    pair = st.tuples(st.floats(0.0, 5.0, allow_nan=False), st.floats(0.0, 5.0, allow_nan=False))
    return draw(st.lists(pair, min_size=1, max_size=max_actions))


@st.composite
def sim_programs(draw: st.DrawFn, max_actions: int = 24, hosts: bool = False):
    """An engine Program: a random DAG over a few lanes, each lane's order consistent with
    the dependencies (a topological order), optional two-member gangs, random buffers;
    with `hosts`, random host issue seconds (`Action.host`) too."""
    from harts.sim.engine import Action, Program

    n = draw(st.integers(1, max_actions))
    lanes = [(r, s, k) for r in range(2) for s in range(2) for k in ("compute", "comm")]
    lanes = lanes[: draw(st.integers(1, len(lanes)))]
    lane_of = [draw(st.sampled_from(lanes)) for _ in range(n)]
    deps = []
    for i in range(n):
        cands = list(range(i))
        deps.append(tuple(sorted(set(draw(st.lists(st.sampled_from(cands), max_size=3))))) if cands else ())
    durations = [draw(st.floats(0.0, 5.0, allow_nan=False)) for _ in range(n)]
    # buffers: an action may allocate one that a later action on the same rank frees
    alloc = [() for _ in range(n)]
    free = [() for _ in range(n)]
    for i in range(n):
        later = [j for j in range(i + 1, n) if lane_of[j][:2] == lane_of[i][:2] and i in deps[j]]
        if later and draw(st.booleans()):
            j = draw(st.sampled_from(later))
            alloc[i] = ((f"buf{i}", float(draw(st.integers(1, 100)))),)
            free[j] = free[j] + (f"buf{i}",)
    # gangs: pairs of actions on different lanes with no dependency path between them are
    # unsafe in general; gang only actions that are each first on their lane and dep-free
    gang = [None] * n
    firsts = {}
    for i in range(n):
        firsts.setdefault(lane_of[i], i)
    heads = [i for i in firsts.values() if not deps[i]]
    if len(heads) >= 2 and draw(st.booleans()):
        for i in heads[:2]:
            gang[i] = "g0"
    actions = tuple(
        Action(idx=i, name=f"a{i}", kind="X", lane=lane_of[i], duration=durations[i], deps=deps[i],
               gang=gang[i], alloc=alloc[i], free=free[i],
               transient=float(draw(st.integers(0, 10))),
               host=draw(st.floats(0.0, 5.0, allow_nan=False)) if hosts else 0.0)
        for i in range(n)
    )
    order = {}
    for i in range(n):
        order.setdefault(lane_of[i], []).append(i)
    static = {lane[:2]: float(draw(st.integers(0, 50))) for lane in set(lane_of)}
    return Program(actions, {k: tuple(v) for k, v in order.items()}, static)


# ---- step planners (harts/plan/planners): forests to plan and configurations to plan them
# with. Forests are workload presets under random seeds or random segment-symbol forests
# (several groups, shared prefixes, forks at the root and deep down, duplicate
# sequences); budgets range from the longest trajectory (tight) to several times it.


@st.composite
def plan_forests(draw: st.DrawFn, max_groups: int = 4, max_per_group: int = 6):
    import numpy as np

    from harts.tree.build import build_structure
    from harts.tree.workload import generate, preset

    if draw(st.booleans()):
        name = draw(st.sampled_from(("tiny-stepwise", "tiny-treestep", "small-stepwise", "small-treestep")))
        return generate(preset(name, seed=draw(st.integers(0, 10_000)))).forest()
    num_symbols = draw(st.integers(3, 12))
    lengths = draw(st.lists(st.integers(1, 90), min_size=num_symbols, max_size=num_symbols))
    seqs, groups, ids = [], [], []
    for g in range(draw(st.integers(1, max_groups))):
        mine: list[list[int]] = []
        for _ in range(draw(st.integers(1, max_per_group))):
            if mine and draw(st.booleans()):
                base = draw(st.sampled_from(mine))
                cut = draw(st.integers(1, len(base)))
                tail = draw(st.lists(st.integers(0, num_symbols - 1), min_size=0, max_size=4))
                seq = base[:cut] + tail
            else:
                seq = draw(st.lists(st.integers(0, num_symbols - 1), min_size=1, max_size=6))
            mine.append(seq)
            seqs.append(np.asarray(seq, dtype=np.int64))
            groups.append(f"g{g}")
            ids.append(f"g{g}/s{len(ids)}")
    return build_structure(seqs, groups, ids, np.asarray(lengths, dtype=np.int64))


@st.composite
def plan_configs(draw: st.DrawFn, forest):
    from harts.config.plan import PlanConfig

    longest = int(forest.traj_length.max())
    budget = draw(st.one_of(st.just(longest), st.integers(longest, 4 * longest)))
    return PlanConfig(
        dp=draw(st.integers(1, 5)),
        microbatch_tokens=budget,
        producer_retention=draw(st.sampled_from((0.0, 0.35, 1.0))),
        seed=draw(st.integers(0, 3)),
        time_limit=0.05,
        chunk_size=draw(st.sampled_from((1, 4, 64))),
    )


# ---- pipeline-aware planning (PlanConfig.pp): the configurations of `plan_configs`, planned
# for a pipeline of 2-4 stages with 1-3 microbatches per stage wanted per replica.


@st.composite
def pipeline_plan_configs(draw: st.DrawFn, forest):
    import dataclasses

    base = draw(plan_configs(forest))
    return dataclasses.replace(
        base, pp=draw(st.integers(2, 4)), min_microbatches_per_stage=draw(st.integers(1, 3))
    )


# ---- l1l2's 1-slot windows: budgets between the longest trajectory and the largest tree,
# so some trees are over the budget and may run as a window of one slot (producer and
# consumer in the same slot); without a pipeline or with one of 2-3 stages.


@st.composite
def tight_plan_configs(draw: st.DrawFn, forest):
    import dataclasses

    from harts.plan.planners.common import ForestIndex

    base = draw(plan_configs(forest))
    idx = ForestIndex(forest, base.cost_model)
    longest = int(forest.traj_length.max())
    biggest = max(int(idx.sub_rows[r]) for r in idx.roots)
    return dataclasses.replace(
        base,
        microbatch_tokens=draw(st.integers(longest, max(longest, biggest))),
        pp=draw(st.sampled_from((1, 1, 2, 3))),
    )



# ---- l1l2's stages: any of the configurations above (budgets loose or tight, with or
# without a pipeline), and small bounded linear programs for its LP back ends.


def l1l2_plan_configs(forest):
    return st.one_of(plan_configs(forest), tight_plan_configs(forest), pipeline_plan_configs(forest))


@st.composite
def bounded_linear_programs(draw: st.DrawFn, max_vars: int = 5, max_rows: int = 4):
    """(objective, lower, upper, matrix, row_lo, row_hi) of a linear program over a box of
    finite bounds, rows bounded on one side, the other or both (infinite: absent); dense
    numpy arrays. Feasible or not, its optimum (if any) is finite."""
    import numpy as np

    n = draw(st.integers(1, max_vars))
    m = draw(st.integers(0, max_rows))
    coef = st.integers(-4, 4).map(float)
    obj = np.array(draw(st.lists(coef, min_size=n, max_size=n)))
    lower = np.array(draw(st.lists(st.integers(-5, 0).map(float), min_size=n, max_size=n)))
    upper = lower + np.array(draw(st.lists(st.integers(0, 6).map(float), min_size=n, max_size=n)))
    mat = np.array(draw(st.lists(st.lists(coef, min_size=n, max_size=n), min_size=m, max_size=m))).reshape(m, n)
    row_lo, row_hi = [], []
    for _ in range(m):
        lo = draw(st.integers(-10, 10).map(float))
        kind = draw(st.sampled_from(("le", "ge", "both")))
        row_lo.append(-np.inf if kind == "le" else lo)
        row_hi.append(np.inf if kind == "ge" else lo + draw(st.integers(0, 8)))
    return obj, lower, upper, mat, np.array(row_lo, dtype=float), np.array(row_hi, dtype=float)

# Row gathers (harts/exec/ops/gather.py): a source row count and an index into it, with
# repeats (replayed rows) and, sometimes, every source row present (a permutation plus repeats).


@st.composite
def gather_indices(draw: st.DrawFn, max_rows: int = 12, max_len: int = 30):
    n = draw(st.integers(1, max_rows))
    idx = draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=max_len))
    if draw(st.booleans()):  # cover every row: a permutation with the drawn repeats mixed in
        perm = draw(st.permutations(range(n)))
        where = draw(st.lists(st.integers(0, len(idx)), min_size=n, max_size=n))
        out = list(idx)
        for r, w in zip(perm, where, strict=True):
            out.insert(min(w, len(out)), r)
        idx = out
    return n, idx

# Rollout simulator (harts/sim/rollout): small agentic workloads, long tails included,
# sometimes with so little KV room (low usable HBM) that admission waits and evicts.


@st.composite
def rollout_workloads(draw: st.DrawFn, max_trajectories: int = 12):
    from harts.config.rollout import RolloutWorkload

    prompts = draw(st.integers(1, 3))
    per = draw(st.integers(1, max(1, max_trajectories // prompts)))
    return RolloutWorkload(
        num_prompts=prompts,
        rollouts_per_prompt=per,
        prompt_tokens=(100, 600),
        turns_median=draw(st.sampled_from((1.5, 3.0, 5.0))),
        turns_sigma=draw(st.sampled_from((0.3, 1.0))),
        turns_range=(1, 12),
        action_median=draw(st.sampled_from((30.0, 120.0))),
        action_range=(4, 1500),
        obs_median=60.0,
        obs_range=(4, 600),
        tool_latency_median_s=draw(st.sampled_from((0.05, 0.5, 2.0))),
        max_context=draw(st.sampled_from((4096, 16384))),
        # 0.4125 / 0.415: about 0.7 / 2.2 GB of KV on an MP4 worker of the 124B model (a
        # few of these sequences), 0.9: ample
        hbm_utilization=draw(st.sampled_from((0.4125, 0.415, 0.9))),
        max_batch=draw(st.sampled_from((2, 8, 256))),
        # the hybrid MoE (MLA latent KV) and a dense GQA model (KV reads dominate decode)
        model=draw(st.sampled_from(("flash", "qwen3-8b"))),
        anneal_iterations=10,
        # KV allocated as tokens are generated (preempting when a worker runs out) or per turn
        kv_alloc=draw(st.sampled_from(("paged", "paged", "reserve"))),
        preemption=draw(st.sampled_from(("recompute", "swap"))),
        tool_task_sigma=draw(st.sampled_from((0.0, 1.0))),
        seed=draw(st.integers(0, 2**16)),
    )

# RL credit and allocation (harts/rl/signatures, rtmc, trace): JSON tool arguments with
# every formatting the normaliser documents as irrelevant, and groups of multi-turn
# rollouts over a tiny step alphabet, so histories (states) are shared across rollouts.

_ARG_WORDS = ("a", "b c", "Foo", "caf\u00e9", "x  y")
_ARG_KEYS = ("q", "n", "path", "k")


def json_args(max_leaves: int = 8):
    """JSON values as tool arguments: objects, lists, ints, non-integral floats, bools,
    null and short strings (case and inner spaces that matter kept as drawn)."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-1000, 1000),
        st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()),
        st.sampled_from(_ARG_WORDS),
    )
    return st.recursive(
        leaves,
        lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(st.sampled_from(_ARG_KEYS), kids, max_size=3)),
        max_leaves=max_leaves,
    )


@st.composite
def formatted_json(draw: st.DrawFn, value):
    """JSON text of `value` in a drawn formatting the normaliser ignores: whitespace
    between tokens, key order, number spelling (1 / 1.0 / 1e0; a float's repr or 17
    significant digits), string escapes, surrounding and doubled inner whitespace in
    strings, and composed or decomposed accents (NFC)."""
    import json
    import unicodedata

    def ws():
        return draw(st.sampled_from(("", " ", "  ", "\n", "\t", " \n ")))

    def text(s: str) -> str:
        s = s.replace(" ", draw(st.sampled_from((" ", "  ", "\t", " \n"))))
        s = ws() + s + ws()
        if draw(st.booleans()):
            s = unicodedata.normalize("NFD", s)
        return json.dumps(s, ensure_ascii=draw(st.booleans()))

    def number(x) -> str:
        if isinstance(x, int) or float(x).is_integer():
            i = int(x)
            return draw(st.sampled_from((str(i), f"{i}.0", f"{i}e0", f"{i * 10}e-1", f"{float(i)!r}")))
        return draw(st.sampled_from((repr(x), f"{x:.17g}", f"{x:.17e}")))

    def render(v) -> str:
        if v is None or isinstance(v, bool):
            return json.dumps(v)
        if isinstance(v, (int, float)):
            return number(v)
        if isinstance(v, str):
            return text(v)
        if isinstance(v, list):
            return "[" + ws() + ("," + ws()).join(render(x) + ws() for x in v) + "]"
        keys = draw(st.permutations(sorted(v)))
        return "{" + ws() + ("," + ws()).join(json.dumps(k) + ws() + ":" + ws() + render(v[k]) for k in keys) + ws() + "}"

    return ws() + render(value) + ws()


@dataclass(frozen=True)
class RTMCCase:
    """One group of multi-turn rollouts (with validated turns) and their terminal rewards."""

    trajectories: tuple
    rewards: tuple[float, ...]


_STEP_TOOLS = ("search", "open", "answer")
_STEP_ARGS = ({"q": "a"}, {"q": "b", "n": 2}, "x")
_STEP_OUTCOMES = ("ok", "error")


@st.composite
def rtmc_groups(draw: st.DrawFn, max_rollouts: int = 8, max_turns: int = 4, formatted: bool = True):
    """A group of 1..max_rollouts rollouts with 0..max_turns steps each, from a 3x3x2 step
    alphabet; most rollouts copy a prefix of an earlier one's steps, as tree rollouts and
    repeated tool calls do. With `formatted`, each turn's arguments and names are written
    in a drawn formatting (so matching relies on the normaliser). Rewards are drawn from
    {0, 0.25, 0.5, 1} or uniformly in [0, 1]."""
    from harts.tree.trajectory import Trajectory

    step = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 1))
    histories: list[list[tuple[int, int, int]]] = []
    for _ in range(draw(st.integers(1, max_rollouts))):
        if histories and draw(st.integers(0, 3)) > 0:
            base = draw(st.sampled_from(histories))
            h = base[: draw(st.integers(0, len(base)))]
            h = h + draw(st.lists(step, max_size=max_turns - len(h)))
        else:
            h = draw(st.lists(step, max_size=max_turns))
        histories.append(h)
    trajs = []
    for i, h in enumerate(histories):
        pos = draw(st.integers(1, 3))  # prompt tokens
        turns = []
        for tool, arg, out in h:
            length = draw(st.integers(1, 3))
            name, args, outcome = _STEP_TOOLS[tool], _STEP_ARGS[arg], _STEP_OUTCOMES[out]
            if formatted:
                name = draw(st.sampled_from((name, name.upper(), f" {name.title()} ")))
                outcome = draw(st.sampled_from((outcome, outcome.upper(), f"{outcome}\n")))
                args = draw(st.one_of(st.just(args), formatted_json(args)))
            turns.append({"start": pos, "end": pos + length, "tool": name, "args": args, "outcome": outcome})
            pos += length + draw(st.integers(0, 2))  # observation tokens
        pos += draw(st.integers(0, 2))  # text after the last action
        tokens = draw(st.lists(st.integers(0, 9), min_size=pos, max_size=pos))
        trajs.append(Trajectory.make(f"r{i}", "g", tokens, turns=turns))
    rewards = draw(st.one_of(
        st.lists(st.sampled_from((0.0, 0.25, 0.5, 1.0)), min_size=len(trajs), max_size=len(trajs)),
        st.lists(st.floats(0, 1), min_size=len(trajs), max_size=len(trajs)),
    ))
    return RTMCCase(tuple(trajs), tuple(rewards))


@st.composite
def trace_candidates(draw: st.DrawFn, max_candidates: int = 8, n_features: int = 3):
    """Allocation candidates: roots and prefixes (with observed successes / failures, none
    included) with small feature rows, distinct ids."""
    from harts.rl.trace import Candidate, CandidateKind

    feats = st.tuples(*[st.floats(-3, 3, allow_nan=False) for _ in range(n_features)])
    out = []
    for i in range(draw(st.integers(0, max_candidates))):
        f = draw(feats)
        if draw(st.booleans()):
            out.append(Candidate.root(f"p{i}", f))
        else:
            s, fl = draw(st.tuples(st.integers(0, 3), st.integers(0, 3)))
            out.append(Candidate(f"p{i}/t1", f"p{i}", CandidateKind.PREFIX, f, s, fl, draw(st.integers(1, 3)),
                                 f"p{i}-r0", draw(st.integers(1, 50))))
    return out


# ---- distributed launches (harts/distributed): a world of 1-4 ranks, a `--parallel` spec (a
# factorization of the world, or degrees drawn freely so that some do not fit it or the
# model; dp left out at times, to fill the world) and a small forest of
# tests/distributed/cases.py, whose groups may be fewer than the DP replicas.


@dataclass(frozen=True)
class LaunchCase:
    """A launch as `torchrun --nproc-per-node world ... --parallel spec` would make it."""

    world: int
    spec: str
    seed: int
    groups: int
    kids: int

    def trajectories(self):
        from tests.distributed.cases import small_trajectories

        return small_trajectories(self.seed, self.groups, self.kids)


@st.composite
def parallel_launches(draw: st.DrawFn, min_world: int = 1, max_world: int = 4, max_groups: int = 3,
                      max_kids: int = 3, free_degrees: bool = True):
    """`free_degrees=False`: factorizations of the world only."""
    world = draw(st.integers(min_world, max_world))

    def divisor(n: int) -> int:
        return draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))

    if not free_degrees or draw(st.integers(0, 3)):  # mostly a factorization: pp x dp x tp, ep | dp
        pp = divisor(world)
        tp = divisor(world // pp)
        dp = world // (pp * tp)
        degrees = {"dp": dp, "pp": pp, "ep": divisor(dp), "tp": tp}
    else:
        degrees = {name: draw(st.integers(1, max_world)) for name in ("dp", "pp", "ep", "tp")}
    # a degree of 1 may be left out, and dp at any value (it then fills the world)
    parts = [f"{name}={n}" for name, n in degrees.items()
             if not ((name == "dp" or n == 1) and draw(st.booleans()))]
    return LaunchCase(world, ",".join(draw(st.permutations(parts))), draw(st.integers(0, 1000)),
                      draw(st.integers(1, max_groups)), draw(st.integers(1, max_kids)))


# Op families (tests/exec/ops, tests/exec/gpu): packed problems, forests as parent arrays,
# conv windows and scatter targets.


@st.composite
def gdn_problems(draw, max_len: int = 40):
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=3))
    H = draw(st.integers(1, 2))
    K = draw(st.sampled_from([2, 4]))
    V = draw(st.sampled_from([3, 4]))
    seed = draw(st.integers(0, 2**16))
    with_h0 = draw(st.booleans())
    return lens, H, K, V, seed, with_h0


@st.composite
def kda_problem_shapes(draw, dtype, max_len: int, max_seqs: int = 3):
    """(lens, H, K, V, seed, decay): small heads and dims, lengths from 1 to max_len.

    float64 also draws the ill-conditioned corners: K = 2 (unit keys in a plane are nearly
    collinear, so the UT system is poorly conditioned) and decay 1.0 (mean retention 0.45
    per token, e^-50 over a chunk). There, float32 chunkwise gradients are only good to a
    few 1e-6 against a float64 truth, fla's own naive_chunk_kda dg up to ~8e-6 (measured
    over 2000 draws), too near the 1e-5 bound to be a test of our code; so float32 draws
    K >= 4 and decay <= 0.3, where both forms stay below ~3e-6.
    """
    import torch

    wide = dtype == torch.float64
    lens = draw(st.lists(st.integers(1, max_len), min_size=1, max_size=max_seqs))
    H = draw(st.integers(1, 3))
    K = draw(st.sampled_from([2, 4, 8, 16] if wide else [4, 8, 16]))
    V = draw(st.sampled_from([1, 3, 8, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    decay = draw(st.sampled_from([0.05, 0.3, 1.0] if wide else [0.05, 0.3]))
    return lens, H, K, V, seed, decay


@st.composite
def parent_arrays(draw, max_rows: int = 40):
    """Random forests: every row's parent is an earlier row or -1 (a root)."""
    T = draw(st.integers(1, max_rows))
    return [draw(st.integers(-1, t - 1)) for t in range(T)]


@st.composite
def conv_setups(draw):
    D = draw(st.integers(1, 6))
    W = draw(st.integers(1, 5))
    return dict(
        D=D,
        W=W,
        seed=draw(st.integers(0, 2**31 - 1)),
        bias=draw(st.booleans()),
        activation=draw(st.sampled_from(["silu", None])),
    )


@st.composite
def conv_windows(draw):
    """A short conv's windows over a random forest (parent pointers) or packed sequences."""
    import torch

    from harts.exec.ops.conv import window_from_cu_seqlens, window_from_parents

    W = draw(st.integers(1, 4))
    if draw(st.booleans()):
        T = draw(st.integers(1, 40))
        parent = [draw(st.integers(-1, t - 1)) for t in range(T)]
        return window_from_parents(torch.tensor(parent), W)
    lens = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return window_from_cu_seqlens(cu, W, int(cu[-1]))


@st.composite
def segment_scatters(draw):
    """(rows, scatter targets with -1 for none, feature shape) of a fixed-order sum."""
    import torch

    T = draw(st.integers(1, 40))
    P = draw(st.integers(0, 60))
    targets = draw(st.lists(st.integers(-1, T - 1), min_size=P, max_size=P))
    feat = draw(st.sampled_from([(3,), (2, 5), (1,), (300,)]))
    return T, torch.tensor(targets, dtype=torch.int64), feat


@st.composite
def repeated_gathers(draw):
    """(source rows, a gather index into them, feature shape): mostly with repeats, some rows
    read many times, as a KDA round reads a fork's last partial chunk once per sequence
    below it; else no row read twice (some left out, or every row once)."""
    import numpy as np

    n = draw(st.integers(1, 30))
    if draw(st.integers(0, 3)) == 0:
        index = list(range(n)) if draw(st.booleans()) else \
            draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    else:
        plain = draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=40))
        hot = draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=3, unique=True))
        reps = draw(st.integers(2, 40))
        index = plain + [r for r in hot for _ in range(reps)]
    perm = draw(st.permutations(range(len(index))))
    feat = draw(st.sampled_from([(3,), (2, 5), (300,)]))
    return n, np.array([index[i] for i in perm], dtype=np.int64), feat


# Sharing windows (tests/exec/test_window_fast.py): a consumer's rows placed from its own
# rows and a producer's.


@st.composite
def row_placements(draw):
    """(rows, own positions, source positions, source rows, source size)."""
    import numpy as np

    L = draw(st.integers(1, 24))
    n_own = draw(st.integers(0, L))
    n_src = draw(st.integers(0, L - n_own))
    if draw(st.booleans()):  # a consumer's usual layout: every stashed row in order, then its own
        n_src = L - n_own
        src_at, own_at = list(range(n_src)), list(range(n_src, L))
        num_src = n_src + draw(st.sampled_from((0, 0, 2)))
        src_rows = list(range(n_src))
    else:
        perm = draw(st.permutations(list(range(L))))
        own_at, src_at = perm[:n_own], perm[n_own:n_own + n_src]
        num_src = n_src + draw(st.integers(0, 6))  # source rows never read
        src_rows = draw(st.permutations(list(range(num_src))))[:n_src]
    return L, np.array(own_at, np.int64), np.array(src_at, np.int64), np.array(src_rows, np.int64), num_src


# TRACE allocation (tests/rl/test_trace.py): small cases with one feature, the oracle
# success probability.


@st.composite
def trace_small_cases(draw):
    """1-3 roots or observed prefixes and a budget of 0-6 rollouts."""
    from harts.rl.trace import Candidate, CandidateKind

    cands = []
    for i in range(draw(st.integers(1, 3))):
        v = draw(st.one_of(st.floats(0.01, 0.99), st.sampled_from((0.5, 0.1, 0.9))))
        if draw(st.booleans()):
            cands.append(Candidate.root(f"p{i}", (v,)))
        else:
            s, f = draw(st.sampled_from(((1, 0), (0, 1), (1, 1), (2, 0), (0, 3), (0, 0))))
            cands.append(Candidate(f"q{i}", f"q{i}", CandidateKind.PREFIX, (v,), s, f, 1, "t", 1))
    return cands, draw(st.integers(0, 6))


@st.composite
def trace_grouped_candidates(draw):
    """Prefix candidates in 1-3 groups (several per group), each group's observed outcomes,
    oracle success probabilities as the first feature, a budget."""
    from harts.rl.trace import Candidate, CandidateKind

    cands, outcomes = [], {}
    for g in range(draw(st.integers(1, 3))):
        outcomes[f"g{g}"] = draw(st.sampled_from(((0, 0), (2, 0), (0, 2), (1, 1))))
        for j in range(draw(st.integers(1, 3))):
            v = draw(st.floats(0.01, 0.99))
            s, f = draw(st.sampled_from(((1, 0), (0, 1), (1, 1), (0, 0))))
            cands.append(Candidate(f"g{g}/t1/{j}", f"g{g}", CandidateKind.PREFIX, (v,), s, f, 1, "t", 1))
    return cands, outcomes, draw(st.integers(0, 7)), draw(st.integers(0, 2**31))


# Simulator executor model (harts/sim/executor.py): rates and one microbatch's features.


@st.composite
def executor_rates(draw):
    from harts.sim.executor_rates import BASE_EXECUTOR, executor_rates_from_dict

    base = executor_rates_from_dict(BASE_EXECUTOR, {})
    return base.with_values(
        host_s_per_launch=draw(st.floats(1e-6, 1e-4)),
        launches_per_microbatch=draw(st.floats(10.0, 1e4)),
        launches_per_consumer=draw(st.floats(0.0, 1e3)),
        device_scale=draw(st.floats(0.3, 3.0)),
        half_efficiency_rows=draw(st.floats(0.0, 1e4)),
        consumer_device_s_per_producer_row=draw(st.floats(0.0, 1e-5)),
        step_fixed_s=draw(st.floats(0.0, 0.1)),
    )


@st.composite
def microbatch_features(draw):
    from harts.sim.executor import MicrobatchFeatures

    fwd = draw(st.floats(1e-5, 1.0))
    return MicrobatchFeatures(fwd_s=fwd, bwd_s=fwd * draw(st.floats(1.0, 4.0)), comm_fwd_s=0.0, comm_bwd_s=0.0,
                              rows=draw(st.integers(1, 200_000)), kda_rounds=draw(st.integers(1, 4)),
                              consumer=False, producer_rows=0, producer=False)


# Norms (harts/exec/ops/norm): input shapes, scales and epsilons.


@st.composite
def norm_cases(draw):
    """(leading shape, channels, input scale, eps, seed)."""
    lead = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=2)))
    return (lead, draw(st.sampled_from([1, 2, 3, 8, 64, 128, 130])), draw(st.sampled_from([1e-3, 1.0, 40.0])),
            draw(st.sampled_from([1e-6, 1e-5, 1e-2])), draw(st.integers(0, 2**31)))


# ---- chains of windows: trajectories longer than the microbatch budget ------------------


def long_chain_trajectories(trunk: int, forks: list[tuple[int, int]], seed: int = 0, groups: int = 1,
                            short: int = 9):
    """`groups` trees, each a trunk of `trunk` tokens with a branch of `n` tokens forking at
    each (depth, n) of `forks`, and a short tree of `short` tokens beside them; random
    tokens, masks, advantages and old / reference log-probs from `seed`."""
    import numpy as np

    from harts.tree.trajectory import Trajectory

    rng = np.random.default_rng(seed)

    def make(name: str, group: str, tokens) -> Trajectory:
        mask = rng.random(len(tokens)) < 0.8
        mask[0] = False
        return Trajectory.make(name, group, tokens, loss_mask=mask, advantage=float(rng.normal()),
                               old_logprobs=rng.normal(-2, 0.5, len(tokens)),
                               ref_logprobs=rng.normal(-2, 0.5, len(tokens)))

    out = []
    for g in range(groups):
        base = rng.integers(1, 500, trunk)
        out.append(make(f"g{g}/trunk", f"g{g}", base))
        for i, (depth, n) in enumerate(forks):
            # the branch differs from the trunk at `depth` (its first own token)
            tail = rng.integers(1, 500, n)
            if depth < trunk:
                tail[0] = (int(base[depth]) % 499) + 1
            out.append(make(f"g{g}/b{i}", f"g{g}", np.concatenate([base[:depth], tail])))
    out.append(make("short", "s", rng.integers(1, 500, short)))
    return out


@st.composite
def long_chain_forests(draw: st.DrawFn, budget: int, max_forks: int = 3):
    """Trajectories 2-4x `budget` long with forks drawn anywhere along the trunk (inside a
    piece's first chunk, on a cut, one past it, deep), some branches longer than the budget."""
    trunk = draw(st.integers(2 * budget, 4 * budget))
    forks = draw(st.lists(st.tuples(st.integers(1, trunk - 1), st.integers(1, budget)), min_size=1,
                          max_size=max_forks))
    return long_chain_trajectories(trunk, forks, seed=draw(st.integers(0, 2**16)))


# Shape-family instances (harts.tree.shapes): a family, a seed and a small budget.


@st.composite
def shape_instances(draw, budgets=(1024, 2048)):
    """(family, seed, budget) of `harts.tree.shapes.draw`."""
    from harts.tree import shapes

    return (draw(st.sampled_from(sorted(shapes.FAMILIES))), draw(st.integers(0, 10_000)),
            draw(st.sampled_from(list(budgets))))


@dataclass(frozen=True)
class LockstepMicrobatch:
    """What `harts.plan.lockstep` reads of a plan's microbatch."""

    id: int
    replica: int
    order: int
    slot: int
    producer: int | None
    executed_tokens: int


@st.composite
def nested_windows(draw):
    """(microbatches, replicas) of an EP group whose replicas each run nested windows:
    chains of random depth whose pieces have a few consumers, beside standalone
    microbatches, over a few slots (`harts.plan.lockstep`'s input)."""
    replicas = draw(st.integers(2, 4))
    mbs: list[LockstepMicrobatch] = []
    for r in range(replicas):
        order = 0
        slot = 0

        def add(producer, rows, slot_, r=r) -> int:
            nonlocal order
            mbs.append(LockstepMicrobatch(len(mbs), r, order, slot_, producer, rows))
            order += 1
            return len(mbs) - 1

        for _ in range(draw(st.integers(0, 4))):
            kind = draw(st.sampled_from(["standalone", "window"]))
            if kind == "standalone":
                add(None, draw(st.integers(100, 20000)), slot)
                slot += 1
                continue

            def window(producer, depth) -> None:
                nonlocal slot
                p = add(producer, draw(st.integers(100, 20000)), slot)
                for _ in range(draw(st.integers(1, 3))):
                    if depth and draw(st.booleans()):
                        window(p, depth - 1)
                    else:
                        add(p, draw(st.integers(100, 20000)), slot)
                        slot += 1

            window(None, draw(st.integers(0, 3)))
    return mbs, replicas


# ---- l1l2 on the benchmark suites' shape families at budgets around their longest path:
# a family instance (harts.tree.shapes) drawn at a small budget, planned at 0.45-1.6x it
# (below the longest path some trajectories are chained; above it trees over the budget
# are split into windows, nested where one window does not hold them).


@st.composite
def family_plan_cases(draw: st.DrawFn, chunk: int = 8):
    from harts.config.plan import PlanConfig
    from harts.tree import build_forest, shapes

    family = draw(st.sampled_from(sorted(shapes.FAMILIES)))
    drawn = draw(st.sampled_from((256, 384, 512)))
    forest = build_forest(shapes.draw(family, draw(st.integers(0, 50)), drawn, vocab_size=256))
    budget = max(2 * chunk, int(drawn * draw(st.floats(0.45, 1.6))))
    return forest, PlanConfig(microbatch_tokens=budget, chunk_size=chunk,
                              producer_retention=draw(st.sampled_from((0.35, 0.2, 0.5))))


# chain pieces under the producer charge alone (None) or sized by their context
CHAIN_RETENTIONS = st.sampled_from((None, 0.076, 0.0, 0.3))


@st.composite
def long_family_plan_cases(draw: st.DrawFn, chunk: int = 8):
    """A long family's drawn instance (paths past the budget it was drawn at, beside short
    trees), planned at 0.8-1.2 of that budget on 1-3 replicas."""
    from harts.config.plan import PlanConfig
    from harts.tree import build_forest, shapes

    family = draw(st.sampled_from(sorted(shapes.LONG_FAMILIES)))
    drawn = draw(st.sampled_from((256, 384, 512)))
    forest = build_forest(shapes.draw(family, draw(st.integers(0, 50)), drawn, vocab_size=256))
    budget = max(2 * chunk, int(drawn * draw(st.floats(0.8, 1.2))))
    return forest, PlanConfig(microbatch_tokens=budget, chunk_size=chunk, dp=draw(st.integers(1, 3)),
                              producer_retention=draw(st.sampled_from((0.35, 0.2, 0.5))),
                              chain_retention=draw(CHAIN_RETENTIONS))


@st.composite
def split_tree_cases(draw: st.DrawFn, chunk: int = 8):
    """A family instance (short or long families) drawn at a small budget and planned at
    0.5-1.5 of it on 2-4 replicas: the cases where a tree may hold more than a replica's
    share."""
    from harts.config.plan import PlanConfig
    from harts.tree import build_forest, shapes

    family = draw(st.sampled_from(sorted({*shapes.FAMILIES, *shapes.LONG_FAMILIES})))
    drawn = draw(st.sampled_from((256, 384, 512)))
    forest = build_forest(shapes.draw(family, draw(st.integers(0, 50)), drawn, vocab_size=256))
    budget = max(2 * chunk, int(drawn * draw(st.floats(0.5, 1.5))))
    return forest, PlanConfig(microbatch_tokens=budget, chunk_size=chunk, dp=draw(st.integers(2, 4)),
                              chain_retention=draw(CHAIN_RETENTIONS))
