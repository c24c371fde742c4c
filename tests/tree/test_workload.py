"""Workload presets: reproducible, and the token-level tree equals the segment-level one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harts.config.workload import FLASH_CONTEXT, FLASH_GPUS, PRESETS, Scheme
from harts.tree import build_forest
from harts.tree.prefix import duplicate_counts
from harts.tree.workload import generate, preset


def _same_structure(a, b) -> None:
    for name in ("node_parent", "node_start", "node_end", "node_group", "traj_node"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


@settings(max_examples=10)
@given(st.sampled_from(["tiny-stepwise", "tiny-treestep", "small-stepwise", "small-treestep"]),
       st.integers(0, 10_000))
def test_token_forest_equals_structure_forest(name, seed):
    wl = generate(preset(name, seed=seed))
    _same_structure(build_forest(wl.trajectories()), wl.forest())


def test_same_seed_same_workload_and_seed_matters():
    a = generate(preset("small-treestep", seed=3))
    b = generate(preset("small-treestep", seed=3))
    c = generate(preset("small-treestep", seed=4))
    _same_structure(a.forest(), b.forest())
    assert all(x.same_as(y) for x, y in zip(a.trajectories(), b.trajectories(), strict=True))
    assert a.seg_length != c.seg_length


def test_schemes_have_their_shape():
    step = generate(preset("tiny-stepwise")).trajectories()
    # stepwise: a rollout's sequences are nested prefixes, each training only its last action
    by_rollout: dict[str, list] = {}
    for t in step:
        by_rollout.setdefault(t.id.rsplit("/", 1)[0], []).append(t)
    for seqs in by_rollout.values():
        for a, b in zip(seqs, seqs[1:], strict=False):
            assert np.array_equal(b.tokens[: len(a)], a.tokens)
            assert not b.loss_mask[: len(a)].any()
        for t in seqs:
            trained = np.flatnonzero(t.loss_mask)
            assert trained.size and trained[-1] == len(t) - 1
    tree = generate(preset("tiny-treestep")).forest()
    assert tree.num_trajectories == 2 * 4
    assert (tree.node_num_children > 1).any()


@pytest.mark.parametrize("name", [n for n in PRESETS if n.startswith("swe-")])
def test_swe_presets_follow_the_calibration(name):
    cfg = preset(name)
    wl = generate(cfg)
    f = wl.forest()
    lengths = f.traj_length
    prompts = [wl.seg_length[s[0]] for s in wl.seq_symbols]
    assert min(prompts) >= 3000 and max(prompts) <= 8000
    assert lengths.max() <= cfg.max_context
    assert lengths.max() <= cfg.microbatch_tokens  # every trajectory fits the preset's budget
    if cfg.scheme == Scheme.TREESTEP:
        # leaves the context cap cuts short together end as one sequence: at most the
        # group size, exactly it where no chain reaches the cap with several leaves
        copies = generate(dataclasses.replace(cfg, allow_duplicates=True)).forest()
        assert copies.num_trajectories == cfg.num_groups * cfg.rollouts_per_group
        assert f.num_trajectories == duplicate_counts(copies)["distinct_trajectories"]
        if cfg.num_groups in FLASH_GPUS:
            # Table 3's Flash tree-step rows (6.65x at 32 GPUs, 6.56x at 64) are matched,
            # within 10%, only by the generator that emits the cap's copies and last-turn
            # forks; without them these forests compress far less (2.5x / 2.9x)
            old = generate(dataclasses.replace(cfg, allow_duplicates=True, last_turn_branching=True)).forest()
            paper = {32: 6.65, 64: 6.56}[cfg.num_groups]
            assert abs(old.compression / paper - 1) < 0.10
            assert f.compression < 0.5 * paper
        else:
            # final contexts: most land in 25k-130k tokens
            assert np.mean((lengths >= 25_000) & (lengths <= 130_000)) > 0.5


def test_flash_presets_cap_contexts_and_budget_at_32k():
    for n in FLASH_GPUS:
        for scheme in Scheme:
            cfg = preset(f"swe-{scheme.value}-{n}")
            assert cfg.max_context == cfg.microbatch_tokens == FLASH_CONTEXT
    assert preset("swe-treestep-8").microbatch_tokens == 131072


def test_bad_config_and_unknown_preset():
    with pytest.raises(KeyError, match="unknown workload preset 'nope'"):
        preset("nope")
    with pytest.raises(ValueError, match="action_range"):
        preset("tiny-treestep", action_range=(5, 2))
    with pytest.raises(ValueError, match="materialising more than"):
        generate(preset("swe-stepwise-8")).trajectories()


# ---- duplicates and last-turn branching ------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS.known()))
def test_no_preset_emits_duplicate_sequences(name):
    from harts.tree.prefix import duplicate_counts

    wl = generate(preset(name))
    counts = duplicate_counts(wl.forest())
    assert counts["duplicate_trajectories"] == 0
    assert counts["distinct_trajectories"] == len(wl.seq_symbols)
    if wl.expanded_tokens <= 2_000_000:  # token level too, where materialising is cheap
        trajs = wl.trajectories()
        assert len({(t.group, t.tokens.tobytes()) for t in trajs}) == len(trajs)


def test_allow_duplicates_emits_the_copies_the_cap_makes():
    from harts.tree.prefix import duplicate_counts

    on = generate(preset("swe-treestep-64", allow_duplicates=True, last_turn_branching=True))
    counts = duplicate_counts(on.forest())
    assert len(on.seq_symbols) == 64 * 8 and counts["duplicate_trajectories"] > 0
    off = generate(preset("swe-treestep-64", last_turn_branching=True))
    # the same draws: the distinct sequences are exactly the copies' distinct ones
    assert {(g, s.tobytes()) for g, s in zip(off.seq_group, off.seq_symbols, strict=True)} == {
        (g, s.tobytes()) for g, s in zip(on.seq_group, on.seq_symbols, strict=True)}
    assert len(off.seq_symbols) == counts["distinct_trajectories"]


def _own_actions(wl):
    """Per sequence, the actions no other sequence of its group contains."""
    from collections import Counter

    from harts.tree.workload import ACTION

    uses = Counter((g, int(s)) for g, seq in zip(wl.seq_group, wl.seq_symbols, strict=True) for s in set(seq.tolist()))
    return [sum(1 for s in seq.tolist() if wl.seg_kind[s] == ACTION and uses[(g, s)] == 1)
            for g, seq in zip(wl.seq_group, wl.seq_symbols, strict=True)]


@pytest.mark.parametrize("seed", range(4))
def test_last_turn_branching_knob(seed):
    # contexts never reach the cap here, so every leaf runs its continuation in full
    base = dict(seed=seed, max_context=10**7, turns_range=(3, 40))
    off = _own_actions(generate(preset("small-treestep", **base)))
    assert min(off) >= 2  # every leaf trains at least two actions of its own
    on = _own_actions(generate(preset("small-treestep", last_turn_branching=True, **base)))
    assert min(on) >= 1


def test_last_turn_branching_resamples_single_actions_somewhere():
    found = [min(_own_actions(generate(preset("small-treestep", seed=s, max_context=10**7,
                                              last_turn_branching=True)))) for s in range(8)]
    assert 1 in found
