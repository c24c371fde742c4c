"""The online loop: tree and expanded modes give the same run in float64, the plug points
are one call each, the run is logged and reported, and the default run learns."""

import json
import resource
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from harts.rl.loop import (
    LoopError,
    RLConfig,
    advantages_for,
    grpo_episode_advantages,
    run,
    uniform_counts,
)
from harts.rl.sample import Prefix

SMALL = RLConfig(steps=3, prompts=2, roots=2, expansions=2, dtype="float64", seed=4)


def test_float64_tree_and_expanded_runs_have_the_same_samples_and_updates():
    res = {mode: run(replace(SMALL, mode=mode)) for mode in ("tree", "expanded")}
    for a, b in zip(res["tree"].steps, res["expanded"].steps, strict=True):
        assert a.sample_digest == b.sample_digest
        assert a.reward_mean == b.reward_mean
        assert abs(a.loss - b.loss) < 1e-10 and abs(a.grad_norm - b.grad_norm) < 1e-10
        assert abs(a.logprob_gap - b.logprob_gap) < 1e-10
        assert a.compression > 1.0 and b.compression == 1.0
    assert all(s.grad_norm > 0 for s in res["tree"].steps)  # every step updated the policy


@pytest.mark.slow
def test_the_default_command_in_float64_gives_the_same_run_in_both_modes():
    """The done-when's command, `harts rl run --steps 30` in float64: the expanded-mode run
    draws the same samples and gets the same reward curve as the tree-mode run on all 30
    steps, and each step's update, run in the other mode from the same weights and
    optimizer state (`--lockstep`), is within 1e-10 of the tree's (relative L2 norm of the
    update; gradients within 1e-10 of the largest entry). The two runs' own grad norms are not compared past the first steps: their
    weights drift apart from rounding (measured 4.6e-9 relative by step 29, after a
    gradient spike), which the lockstep check separates from the updates themselves."""
    base = [sys.executable, "-m", "harts", "rl", "run", "--steps", "30", "--dtype", "float64", "--json", "--no-track"]
    procs = {mode: subprocess.Popen(base + (["--lockstep"] if mode == "tree" else ["--mode", "expanded"]),
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for mode in ("tree", "expanded")}  # side by side: each is one process
    out = {}
    for mode, proc in procs.items():
        stdout, _ = proc.communicate(timeout=3000)
        assert proc.returncode == 0, mode
        out[mode] = json.loads(stdout)["steps"]
    tree, expanded = out["tree"], out["expanded"]
    assert len(tree) == len(expanded) == 30
    assert [s["sample_digest"] for s in tree] == [s["sample_digest"] for s in expanded]
    assert [s["reward_mean"] for s in tree] == [s["reward_mean"] for s in expanded]
    for s in tree:
        check = s["lockstep"]
        assert check["mode"] == "expanded"
        assert check["update_rel_l2_diff"] < 1e-10 and check["grad_max_rel_diff"] < 1e-10, (s["step"], check)
        assert check["grad_norm_rel_diff"] < 1e-10 and check["loss_abs_diff"] < 1e-10, (s["step"], check)
        assert check["logprob_max_abs_diff"] < 1e-10, (s["step"], check)
        assert s["grad_norm"] > 0  # every step updated the policy
    assert np.mean([s["reward_mean"] for s in tree][-5:]) > np.mean([s["reward_mean"] for s in tree][:5])


def test_lockstep_runs_the_other_mode_from_the_same_state_without_changing_the_run():
    plain = run(SMALL)
    checked = run(replace(SMALL, lockstep=True))
    for a, b in zip(plain.steps, checked.steps, strict=True):
        assert a.lockstep is None and b.lockstep["mode"] == "expanded"
        assert (a.sample_digest, a.loss, a.grad_norm) == (b.sample_digest, b.loss, b.grad_norm)
        assert b.lockstep["update_rel_l2_diff"] < 1e-10 and b.lockstep["grad_max_rel_diff"] < 1e-10
    other = run(replace(SMALL, mode="expanded", lockstep=True, steps=1)).steps[0].lockstep
    assert other["mode"] == "tree" and other["update_rel_l2_diff"] < 1e-10


def test_lockstep_sees_a_wrong_update():
    """The check can fail: a shadow started from another learning rate gives updates
    that differ by a visible fraction, and gradients from other weights differ too."""
    import harts.rl.loop as loop

    policy = loop._parts(SMALL, None, "cpu")[2]
    shadow = loop._shadow(policy, SMALL)
    env = loop.make_env(SMALL.env)
    from harts.rl.sample import SamplingConfig, sample_tree_rollouts

    sampler = loop.HartsPolicy(policy.model)
    prompts = loop.step_prompts(SMALL, 1)
    rollouts = sample_tree_rollouts(sampler, env, prompts, [SMALL.roots] * len(prompts), None,
                                    SamplingConfig(seed=SMALL.seed), step=1)
    batch = loop._scored_batch(SMALL, rollouts, 1)
    weights, opt_state = loop._snapshot(policy)
    result = policy.update(batch)
    opt_state["param_groups"][0]["lr"] *= 2
    check = loop.lockstep_difference(policy, shadow, (weights, opt_state), batch, result)
    assert check["update_rel_l2_diff"] > 0.1 and check["grad_max_rel_diff"] < 1e-10, check
    name, w = next(iter(weights.items()))
    weights = {**weights, name: w + 1e-3}
    check = loop.lockstep_difference(policy, shadow, (weights, opt_state), batch, result)
    assert check["grad_max_rel_diff"] > 1e-8, check


def test_grpo_advantages_are_group_normalised():
    class R:
        def __init__(self, prompt, reward):
            self.prompt, self.reward, self.tokens = prompt, reward, np.zeros(3)

    rs = [R(0, 1.0), R(1, 0.5), R(0, 0.0), R(1, 0.5)]
    adv = grpo_episode_advantages(rs)
    assert adv[0] == pytest.approx(1.0, abs=1e-5) and adv[2] == pytest.approx(-1.0, abs=1e-5)
    assert adv[1] == adv[3] == 0.0
    assert advantages_for("grpo", rs, None)[0].tolist() == pytest.approx([adv[0]] * 3)


def test_uniform_expansion_spreads_each_prompts_budget_over_its_prefixes():
    from harts.rl.env import EpisodeState

    def pre(prompt, turns):
        return Prefix(prompt, (0,), (0.0,), (False,), EpisodeState((0, 0), 0, turns))
    cands = [pre(0, 2), pre(0, 1), pre(1, 1), pre(0, 1)]
    assert uniform_counts(cands, 4) == [1, 2, 4, 1]  # prompt 0: turn-1 prefixes first


def test_unknown_names_are_refused():
    with pytest.raises(LoopError, match="advantage: unknown 'ppo'"):
        RLConfig(advantage="ppo").validate()
    with pytest.raises(LoopError, match="mode: unknown"):
        RLConfig(mode="window").validate()


def test_a_logged_run_is_plotted_by_the_report(tmp_path):
    from harts.cli.main import main
    from harts.track.query import latest_runs

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    assert main(["rl", "run", "--steps", "2", "--prompts", "2", "--roots", "2", "--expansions", "1",
                 "--tracking-uri", uri, "--json"]) == 0
    runs = latest_runs(uri, kind="study", group_by="harts.study", artifacts=("rl_steps.json",))
    steps = json.loads(runs["rl"].files["rl_steps.json"])
    assert [s["step"] for s in steps] == [1, 2]
    out = tmp_path / "r.html"
    assert main(["report", "--tracking-uri", uri, "--out", str(out), "--json"]) == 0
    page = out.read_text()
    assert 'alt="reward and log-prob gap over steps"' in page and "online RL on switchboard" in page


@pytest.mark.slow
def test_the_default_run_learns():
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "harts", "rl", "run", "--steps", "30", "--json", "--no-track"],
                          capture_output=True, text=True, timeout=3000, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    steps = json.loads(proc.stdout)["steps"]
    rewards = [s["reward_mean"] for s in steps]
    assert len(rewards) == 30
    assert np.mean(rewards[-5:]) - np.mean(rewards[:5]) >= 0.25, rewards
    assert max(s["logprob_gap"] for s in steps) < 1e-4  # float32 sampling vs tree training forward
    # CPU seconds the run used (not wall time, which a shared machine's load inflates)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 600, cpu


def test_rtmc_is_called_once_per_prompt_group_and_its_advantages_are_used(monkeypatch):
    import types

    from harts.rl.env import make_env
    from harts.rl.loop import rollout_batch
    from harts.rl.sample import SamplingConfig, sample_tree_rollouts
    from tests.rl.test_sample import TablePolicy

    env = make_env("switchboard")
    rollouts = sample_tree_rollouts(TablePolicy(), env, [1, 2], [2, 2], None, SamplingConfig(seed=5))
    trajs = rollout_batch(rollouts, [np.zeros(len(r.tokens)) for r in rollouts], 1).trajectories()
    calls = []

    def fake_rtmc(group, rewards):
        calls.append(([t.id for t in group], list(rewards)))
        return [np.full(len(t), 10.0 * len(calls) + k) for k, t in enumerate(group)]

    monkeypatch.setitem(sys.modules, "harts.rl.rtmc", types.SimpleNamespace(rtmc_advantages=fake_rtmc))
    adv = advantages_for("rtmc", rollouts, trajs)
    assert [ids for ids, _ in calls] == [[t.id for t in trajs[:2]], [t.id for t in trajs[2:]]]
    assert calls[0][1] == [r.reward for r in rollouts[:2]]
    assert [float(a[0]) for a in adv] == [10.0, 11.0, 20.0, 21.0]


def test_mixed_share_is_over_every_prompt_of_the_step():
    """A prompt TRACE gives no rollouts counts as one without mixed rewards: the share's
    denominator is the step's prompt count, whatever the allocation."""
    from harts.rl.loop import RLConfig, run

    cfg = RLConfig(env="switchboard-outcome", allocation="trace", steps=3, seed=0)
    for s in run(cfg).steps:
        mixed = s.mixed_share * cfg.prompts
        assert abs(mixed - round(mixed)) < 1e-9, (s.step, s.mixed_share)


def test_trace_leaves_more_prompts_mixed_than_uniform_on_the_same_policy():
    """On the toy pass/fail environment, at the same budget (8 prompts x (4 roots + 4
    continuations)), sampled from the same weights at every step (`compare_allocations`,
    the policy trained on the uniform allocation's rollouts), TRACE's rollouts leave more
    prompts with mixed rewards than uniform allocation's, summed over 4 seeds x 8 steps.
    Measured (float64; float32 gives the same shares): 186 vs 180 prompts of 256, TRACE
    ahead or level on every seed. float64 keeps the samples the same on any machine."""
    from harts.rl.loop import compare_allocations

    mixed = {"uniform": 0, "trace": 0}
    for seed in range(4):
        c = compare_allocations(RLConfig(env="switchboard-outcome", steps=8, seed=seed, dtype="float64"))
        assert c.train_on == "uniform" and all(len(v) == 8 for v in c.shares.values())
        for name in mixed:
            mixed[name] += round(sum(c.shares[name]) * c.config.prompts)
    assert mixed["trace"] > mixed["uniform"], mixed


def test_compare_allocations_refuses_training_on_an_allocation_it_does_not_run():
    from harts.rl.loop import compare_allocations

    with pytest.raises(LoopError, match="train_on"):
        compare_allocations(replace(SMALL, steps=1), ("uniform",), train_on="trace")


def test_rl_compare_prints_each_allocations_mixed_prompts(capsys):
    from harts.cli.main import main

    assert main(["rl", "compare", "--steps", "1", "--seeds", "2", "--prompts", "2", "--roots", "2",
                 "--expansions", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prompts"] == 4 and doc["budget_per_step"] == 6 and len(doc["per_seed"]) == 2
    for name in ("uniform", "trace"):
        assert doc["mixed_prompts"][name] == sum(r["mixed_prompts"][name] for r in doc["per_seed"])
        assert 0 <= doc["mixed_share"][name] <= 1
    assert main(["rl", "compare", "--seeds", "0"]) == 2
    assert "--seeds" in capsys.readouterr().err
