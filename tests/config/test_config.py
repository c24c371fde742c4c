"""The configuration package: every config checks its fields when built (the error names the
field), one registry mechanism fails loudly on unknown and duplicate names, the planners'
load models and the simulator's cost models have distinct names, and `harts.config` sits at
the bottom of the layers (it imports nothing from tree, plan, sim, exec, nor torch)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from enum import StrEnum

import pytest

from harts.config.costs import (
    CostModelName,
    LoadModelName,
    TokenCost,
    TokenPairCost,
    known_load_models,
    make_load_model,
)
from harts.config.optimizer import OptimizerConfig
from harts.config.parallel import ParallelConfig
from harts.config.plan import PlanConfig
from harts.config.registry import Registry
from harts.config.workload import PRESETS, WorkloadConfig, WorkloadPreset, preset

# ---- validation: each bad field fails with its name in the message ----------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"dp": 0}, "dp"), ({"pp": 0}, "pp"), ({"min_microbatches_per_stage": 0}, "min_microbatches_per_stage"),
     ({"microbatch_tokens": 0}, "microbatch_tokens"), ({"producer_retention": -0.1}, "producer_retention"),
     ({"producer_retention": float("nan")}, "producer_retention"), ({"time_limit": 0.0}, "time_limit"),
     ({"chunk_size": 0}, "chunk_size"), ({"search_evaluations": -1}, "search_evaluations"),
     ({"cost_model": "token-pair"}, "cost_model")],
)
def test_plan_config_names_the_bad_field(changes, field):
    with pytest.raises(ValueError, match=rf"PlanConfig\.{field} must"):
        PlanConfig(**changes)
    # dataclasses.replace builds a new instance, so it is checked too
    with pytest.raises(ValueError, match=rf"PlanConfig\.{field} must"):
        dataclasses.replace(PlanConfig(), **changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"dp": 0}, "dp"), ({"pp": 0}, "pp"), ({"ep": 0}, "ep"), ({"dp": 4, "ep": 3}, "ep=3")],
)
def test_parallel_config_names_the_bad_field(changes, field):
    with pytest.raises(ValueError, match=rf"parallel config: {field}"):
        ParallelConfig(**changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"num_groups": 0}, "num_groups"), ({"rollouts_per_group": 0}, "rollouts_per_group"),
     ({"branching": 1}, "branching"), ({"prompt_tokens": (9, 3)}, "prompt_tokens"),
     ({"turns_range": (0, 5)}, "turns_range"), ({"action_range": (5, 4)}, "action_range"),
     ({"obs_range": (0, 1)}, "obs_range"), ({"max_context": 100}, "max_context"),
     ({"microbatch_tokens": 0}, "microbatch_tokens"), ({"vocab_size": 3}, "vocab_size"),
     ({"branch_window": (0.0, 0.5)}, "branch_window")],
)
def test_workload_config_names_the_bad_field(changes, field):
    with pytest.raises(ValueError, match=rf"workload config: {field}"):
        WorkloadConfig(**changes)
    with pytest.raises(ValueError, match=rf"workload config: {field}"):
        preset("small-treestep", **changes)


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"lr": 0.0}, "lr"), ({"lr": float("nan")}, "lr"), ({"betas": (0.9, 1.0)}, "betas"),
     ({"betas": (0.9,)}, "betas"), ({"eps": 0.0}, "eps"), ({"weight_decay": -1e-3}, "weight_decay"),
     ({"grad_clip": 0.0}, "grad_clip")],
)
def test_optimizer_config_names_the_bad_field(changes, field):
    with pytest.raises(ValueError, match=rf"OptimizerConfig\.{field} must"):
        OptimizerConfig(**changes)


def test_optimizer_config_accepts_no_clipping():
    assert OptimizerConfig(grad_clip=None).grad_clip is None


@pytest.mark.parametrize(
    ("cls", "changes", "field"),
    [(TokenPairCost, {"pair_weight": -1e-6}, "pair_weight"), (TokenPairCost, {"token_weight": -1.0}, "token_weight"),
     (TokenPairCost, {"microbatch_overhead": -1.0}, "microbatch_overhead"),
     (TokenPairCost, {"forward_fraction": 1.5}, "forward_fraction"),
     (TokenCost, {"microbatch_overhead": -1.0}, "microbatch_overhead"),
     (TokenCost, {"forward_fraction": -0.1}, "forward_fraction")],
)
def test_load_models_name_the_bad_field(cls, changes, field):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field} must"):
        cls(**changes)


def test_defaults_are_valid():
    for cfg in (PlanConfig(), ParallelConfig(), WorkloadConfig(), OptimizerConfig(), TokenPairCost(), TokenCost()):
        assert dataclasses.replace(cfg) == cfg


# ---- the registry -----------------------------------------------------------------------


class _Colour(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


def test_registry_fails_loudly_and_lists_the_known_names():
    reg: Registry[_Colour, int] = Registry("colour", _Colour, KeyError, duplicate_error=ValueError)
    reg.register(_Colour.BLUE, 3)
    reg.register(_Colour.RED, 1)
    assert reg.known() == ["red", "blue"]  # the StrEnum's order, not registration order
    assert reg.items() == [(_Colour.RED, 1), (_Colour.BLUE, 3)]
    assert list(reg) == [_Colour.RED, _Colour.BLUE] and len(reg) == 2
    assert reg.get("blue") == 3 and reg.get(_Colour.RED) == 1
    assert "red" in reg and "green" not in reg
    with pytest.raises(KeyError, match="unknown colour 'green'; known: red, blue"):
        reg.get("green")  # a member, but not registered
    with pytest.raises(KeyError, match="unknown colour 'mauve'; known: red, blue"):
        reg.get("mauve")
    with pytest.raises(ValueError, match="colour 'red' registered twice"):
        reg.register(_Colour.RED, 10)
    assert reg.get("red") == 1
    with pytest.raises(TypeError, match="colour names are _Colour members"):
        reg.register("green", 2)


def test_every_workload_preset_is_registered_and_checked():
    assert [n.value for n in PRESETS] == [n.value for n in WorkloadPreset]
    for name, cfg in PRESETS.items():
        cfg.validate()
        assert preset(name) is cfg
    assert preset("swe-treestep-32").max_context == preset("swe-treestep-32").microbatch_tokens == 32768
    with pytest.raises(KeyError, match="unknown workload preset 'swe-treestep-4'; known: tiny-stepwise, "):
        preset("swe-treestep-4")
    with pytest.raises(ValueError, match="registered twice"):
        PRESETS.register(WorkloadPreset.TINY_STEPWISE, WorkloadConfig())


def test_load_and_cost_model_names_are_distinct():
    from harts.sim.costs import COST_MODELS

    assert not {n.value for n in LoadModelName} & {n.value for n in CostModelName}
    assert known_load_models() == [n.value for n in LoadModelName]
    assert COST_MODELS.known() == [n.value for n in CostModelName]
    assert make_load_model("tokens") == TokenCost()
    with pytest.raises(ValueError, match="unknown cost model 'roofline'; known: token-pair, tokens"):
        make_load_model("roofline")  # a simulator cost model, not a planning load model
    with pytest.raises(KeyError, match="unknown cost model 'tokens'; known: roofline, calibrated, executor"):
        COST_MODELS.get("tokens")


# ---- the bottom layer ---------------------------------------------------------------------


def test_config_imports_no_other_layer():
    code = (
        "import sys\n"
        "import harts.config.costs, harts.config.models, harts.config.optimizer, harts.config.parallel\n"
        "import harts.config.plan, harts.config.registry, harts.config.workload\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('harts.') or m == 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out, "no harts module imported"
    assert [m for m in out if not m.startswith("harts.config")] == []
