"""The switchboard environment: deterministic episodes, the call grammar, rewards and the
step structure its turns record."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harts.rl.env import (
    BOS,
    END,
    FAIL,
    OK,
    STATE_BASE,
    TOOL_NAMES,
    EnvConfig,
    EnvError,
    get_env_config,
    known_envs,
    make_env,
)

ENV = make_env("switchboard")


def _right_tokens(env, state):
    tool, args = env.correct_call(state)
    return (TOOL_NAMES.index(tool), args["slot"])  # ids below K and A spell themselves


def test_registry_knows_the_environments_and_refuses_unknown_names():
    assert known_envs()[0] == "switchboard"
    with pytest.raises(EnvError, match="unknown environment 'nope'.*switchboard"):
        get_env_config("nope")


def test_reset_is_deterministic_and_seeds_differ():
    a, b = ENV.reset(7), ENV.reset(7)
    assert a == b
    assert a[0][0] == BOS and a[0][1] == STATE_BASE + a[1].observation
    chains = {ENV.reset(s)[1].chain for s in range(40)}
    assert len(chains) > 4


def test_right_calls_clear_the_chain_and_end_with_reward_one():
    prompt, state = ENV.reset(3)
    start = len(prompt)
    for _ in range(ENV.config.depth):
        out = ENV.step(state, _right_tokens(ENV, state), start)
        assert out.observation[0] == OK
        state, start = out.state, start + 4
    assert out.done and out.reward == 1.0 and out.observation[1] == END
    assert [t.outcome for t in out.state.history] == ["ok"] * ENV.config.depth


def test_wrong_calls_repeat_the_state_and_the_reward_is_the_cleared_share():
    prompt, state = ENV.reset(5)
    tool, args = _right_tokens(ENV, state)
    wrong = ((tool + 1) % ENV.config.num_tools, args)
    out = ENV.step(state, wrong, 2)
    assert out.observation == (FAIL, STATE_BASE + state.observation) and not out.done
    out = ENV.step(out.state, _right_tokens(ENV, out.state), 6)
    out = ENV.step(out.state, wrong if out.state.observation == state.observation else
                   ((_right_tokens(ENV, out.state)[0] + 1) % 2, 0), 10)
    assert out.done and out.reward == pytest.approx(1 / ENV.config.depth)
    with pytest.raises(EnvError, match="finished episode"):
        ENV.step(out.state, (0, 0), 14)


@given(st.integers(0, 15), st.integers(0, 15))
def test_the_call_grammar_is_total_and_normalises_by_class(a, b):
    call = ENV.parse((a, b))
    assert call.tool == TOOL_NAMES[a % ENV.config.num_tools]
    assert call.args == {"slot": b % ENV.config.num_args}
    # another spelling of the same call (ids in the same classes) parses to the same call
    a2, b2 = (a + ENV.config.num_tools) % 16, (b + ENV.config.num_args) % 16
    assert (ENV.parse((a2, b2)).tool, ENV.parse((a2, b2)).args) == (call.tool, call.args)


def test_parse_refuses_tokens_outside_the_vocabulary():
    with pytest.raises(EnvError, match="outside the vocabulary"):
        ENV.parse((16, 0))
    with pytest.raises(EnvError, match="a call is 2 tokens"):
        ENV.parse((1,))


def test_turn_ranges_point_at_the_call_tokens():
    prompt, state = ENV.reset(11)
    tokens = list(prompt)
    while True:
        call = (9, 4)
        out = ENV.step(state, call, len(tokens))
        tokens += list(call) + list(out.observation)
        state = out.state
        if out.done:
            break
    for t in state.history:
        assert tuple(tokens[t.start:t.end]) == (9, 4)
        assert t.to_dict()["tool"] == TOOL_NAMES[9 % 2]


@pytest.mark.parametrize("name", ["switchboard", "switchboard-outcome"])
def test_random_reward_matches_a_uniform_policy_simulation(name):
    env = make_env(name)
    rng = np.random.default_rng(0)
    n, total = 4000, 0.0
    for seed in range(n):
        _, state = env.reset(seed)
        while True:
            out = env.step(state, tuple(int(x) for x in rng.integers(0, 16, 2)), 0)
            state = out.state
            if out.done:
                total += out.reward
                break
    exact = env.random_reward()
    assert 0.2 < exact < 0.6  # mixed rewards from the first step
    assert abs(total / n - exact) < 4 * 0.5 / np.sqrt(n)


def test_config_validation_names_the_field():
    with pytest.raises(EnvError, match="max_turns"):
        EnvConfig("x", depth=3, max_turns=2).validate()
    with pytest.raises(EnvError, match="vocab_size"):
        EnvConfig("x", vocab_size=6, num_states=4).validate()


def test_outcome_rewards_are_pass_fail_and_chain_lengths_vary_by_prompt():
    env = make_env("switchboard-outcome")
    lengths = {len(env.reset(seed)[1].chain) for seed in range(64)}
    assert lengths == set(env.config.depth_choices)
    for seed in range(16):
        _, state = env.reset(seed)
        depth = len(state.chain)
        # the right calls clear the chain: reward 1; wrong calls only: reward 0
        right = state
        for _ in range(depth):
            tool, args = env.correct_call(right)
            out = env.step(right, (TOOL_NAMES.index(tool), args["slot"]), 0)
            right = out.state
        assert out.done and out.reward == 1.0
        wrong = state
        while True:
            tool, args = env.correct_call(wrong)
            out = env.step(wrong, ((TOOL_NAMES.index(tool) + 1) % env.config.num_tools, args["slot"]), 0)
            wrong = out.state
            if out.done:
                break
        assert out.reward == 0.0 and wrong.cleared == 0
        f = env.prompt_features(seed)
        assert len(f) == env.config.num_states + len(env.config.depth_choices) and sum(f) == 2.0
        assert f[env.config.num_states + env.config.depth_choices.index(depth)] == 1.0


def test_reward_kind_and_depth_choices_are_checked():
    with pytest.raises(EnvError, match="reward"):
        EnvConfig("x", reward="share").validate()
    with pytest.raises(EnvError, match="max_turns"):
        EnvConfig("x", depth_choices=(1, 5), max_turns=4).validate()
    with pytest.raises(EnvError, match="depth_choices"):
        EnvConfig("x", depth_choices=(0, 2), max_turns=4).validate()
