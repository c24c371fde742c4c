"""The walkthroughs of docs/ARCHITECTURE.md, done: a planner, an op's fast path and a model
family are added through their registries and used the way the text says; the files a
new parallelism dimension touches hold the hook points the text lists.

The registries are keyed by StrEnums, which a test cannot extend; where the walkthrough
adds a member, the test puts a registry over an extended copy of the StrEnum (every
member plus the new one, every entry registered again) in the registry's place for the
test's duration.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from enum import StrEnum
from pathlib import Path

import pytest
import torch

from harts.cli.main import main
from harts.config.kernels import Impl, KernelConfig
from harts.config.parallel import DIMS, ParallelConfig, parse_degrees
from harts.config.registry import Registry
from harts.exec import backend
from harts.exec.ops.conv import short_conv, window_from_parents
from harts.exec.ops.conv.naive import apply_activation
from harts.exec.ops.record import KernelRecord
from harts.exec.ops.registry import FastPath
from harts.testing import assert_close

HARTS = Path(__file__).resolve().parents[1] / "harts"


def _extended(enum: type[StrEnum], name: str, value: str) -> type[StrEnum]:
    return StrEnum(enum.__name__, {**{m.name: m.value for m in enum}, name: value})


def _registry_with(registry: Registry, keys: type[StrEnum], new_key: StrEnum, new_value) -> Registry:
    out = Registry(registry.family, keys, registry.error, registry.known_label, registry.duplicate_error)
    for key, value in registry.items():
        out.register(keys(key.value), value)
    out.register(new_key, new_value)
    return out


# ---- Add a planner ---------------------------------------------------------------------------


def test_add_a_planner_and_compare_it(monkeypatch, capsys):
    from harts.plan.planners import registry
    from tests.plan.test_toy_planner import plan_one_tree_each

    names = _extended(registry.PlannerName, "ONE_TREE_EACH", "one-tree-each")
    monkeypatch.setattr(registry, "PlannerName", names)
    monkeypatch.setattr(registry, "_PLANNERS",
                        _registry_with(registry._PLANNERS, names, names.ONE_TREE_EACH, plan_one_tree_each))

    assert main(["plan", "planners", "--json"]) == 0
    assert "one-tree-each" in json.loads(capsys.readouterr().out)["planners"]
    assert main(["plan", "compare", "--workload", "tiny-treestep", "--dp", "2", "--planners", "l1,one-tree-each",
                 "--json"]) == 0
    results = {r["planner"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    toy = results["one-tree-each"]
    assert toy["mode"] == "tree" and toy["executed_tokens"] <= toy["expanded_tokens"]
    # one microbatch per tree: as many as the workload has prompt groups
    from harts.tree.workload import preset

    assert toy["microbatches"] == preset("tiny-treestep").num_groups


# ---- Add an op (fast path) -------------------------------------------------------------------


class ToyImpl(StrEnum):
    COLUMNS = "columns"


def run_columns(x_TD, weight_DW, bias_D, *, window_TW, activation, kernels):
    """Short conv one window column at a time (never the [T, W, D] gather of the reference)."""
    T, D = x_TD.shape
    source_RD = torch.cat([x_TD, x_TD.new_zeros(1, D)])
    index_TW = torch.where(window_TW < 0, T, window_TW)
    y_TD = torch.zeros_like(x_TD)
    for j in range(weight_DW.shape[1]):
        y_TD = y_TD + source_RD[index_TW[:, j]] * weight_DW[:, j]
    if bias_D is not None:
        y_TD = y_TD + bias_D
    return apply_activation(y_TD, activation)


@pytest.fixture
def columns_path():
    """The toy path registered in the conv family (float64 on the CPU, before every other
    path), with its package 'installed' or not as the test sets it."""
    installed = {"now": True}
    path = FastPath(ToyImpl.COLUMNS, run_columns, devices=("cpu",), dtypes=(torch.float64,),
                    installed=lambda: installed["now"], priority=-1)
    backend.CONV.register(path)
    yield installed
    backend.CONV.unregister(ToyImpl.COLUMNS)


def _conv_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 5, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(5, 4, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=dtype, requires_grad=True)
    window = window_from_parents(torch.tensor([-1, 0, 1, 2, 1, 4, -1, 6, 7, 7, 9]), 4)
    return x, w, b, window


def _run(kernels: KernelConfig | None = None, dtype=torch.float64):
    kernels = kernels or KernelConfig()
    x, w, b, window = _conv_inputs(dtype)
    record = KernelRecord()
    y = backend.short_conv(x, w, b, window_TW=window, kernels=kernels, record=record)
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)).sum(), (x, w, b))
    x, w, b, window = _conv_inputs(dtype)
    ref = short_conv(x, w, b, window_TW=window, activation="silu")
    ref_grads = torch.autograd.grad((ref * torch.linspace(-1, 1, ref.numel(), dtype=dtype).view_as(ref)).sum(),
                                    (x, w, b))
    return record.to_dict()["ran"]["conv"], (y, *grads), (ref, *ref_grads)


def test_add_a_fast_path_it_runs_where_it_is_available(columns_path):
    assert backend.conv_impl(torch.device("cpu"), KernelConfig(), torch.float64) is ToyImpl.COLUMNS
    ran, got, want = _run()
    assert ran == ["columns"]
    for name, g, w in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        assert_close(name, g, w, 1e-12)


@pytest.mark.parametrize("situation", ["not installed", "float32", "force_reference"])
def test_add_a_fast_path_elsewhere_the_reference_runs_bit_for_bit(columns_path, situation):
    columns_path["now"] = situation != "not installed"
    kernels = KernelConfig(force_reference=situation == "force_reference")
    ran, got, want = _run(kernels, torch.float32 if situation == "float32" else torch.float64)
    assert ran == [Impl.REFERENCE]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_fast_path_registers_once(columns_path):
    with pytest.raises(ValueError, match="registered twice"):
        backend.CONV.register(FastPath(ToyImpl.COLUMNS, run_columns))
    with pytest.raises(TypeError, match="StrEnum"):
        backend.CONV.register(FastPath("columns2", run_columns))  # type: ignore[arg-type]


# ---- Add a model family ----------------------------------------------------------------------

TOY_TYPE = "toy_next"


def _toy_adapter():
    """Qwen3-Next's shapes under another model type, every tensor named with a "toy." prefix."""
    from harts.models.hf import HFAdapter, qwen3_next

    def to_config(hf):
        return qwen3_next.to_config({**hf, "model_type": qwen3_next.MODEL_TYPE})

    def to_harts(tensors, config):
        return qwen3_next.to_harts({k.removeprefix("toy."): v for k, v in tensors.items()}, config)

    def to_hf(state, config, hf):
        hf = {**hf, "model_type": qwen3_next.MODEL_TYPE}
        return {"toy." + k: v for k, v in qwen3_next.to_hf(state, config, hf).items()}

    return HFAdapter(TOY_TYPE, to_config, to_harts, to_hf)


def test_add_a_model_family_and_load_its_checkpoint(monkeypatch, tmp_path, capsys):
    import harts.models.hf as hf_registry
    from harts.config import models
    from harts.exec.model.model import build_model
    from harts.models import load
    from harts.models.hf.io import write_checkpoint
    from tests.cli.test_model_path_errors import QWEN3_NEXT

    types = _extended(hf_registry.HFModelType, "TOY_NEXT", TOY_TYPE)
    monkeypatch.setattr(hf_registry, "HFModelType", types)
    monkeypatch.setattr(hf_registry, "_ADAPTERS", _registry_with(hf_registry._ADAPTERS, types, types.TOY_NEXT,
                                                                  _toy_adapter()))
    assert TOY_TYPE in hf_registry.supported_model_types()

    # the family's registered shape (a ModelName member), as the config registry holds it
    adapter = hf_registry.get_adapter(TOY_TYPE)
    hf = {**QWEN3_NEXT, "model_type": TOY_TYPE}
    config = adapter.to_config(hf).replace(name="toy-next")
    names = _extended(models.ModelName, "TOY_NEXT", "toy-next")
    monkeypatch.setattr(models, "ModelName", names)
    monkeypatch.setattr(models, "_REGISTRY", _registry_with(models._REGISTRY, names, names.TOY_NEXT, config))
    assert models.get_model_config("toy-next") == config

    # a tiny checkpoint of the family, written as its adapter names the tensors
    model = build_model(config, seed=0, dtype=torch.float32)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    ckpt = write_checkpoint(tmp_path / "toy", hf, adapter.to_hf(state, config, hf))
    assert all(k.startswith("toy.") for k in adapter.to_hf(state, config, hf))

    loaded = load(ckpt)
    assert loaded.adapter.model_type == TOY_TYPE
    assert loaded.config == config.replace(name="toy")
    for k, t in loaded.model.state_dict().items():
        assert torch.equal(t, state[k]), k
    assert main(["model", "params", "--model-path", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


# ---- Add a parallelism -----------------------------------------------------------------------


def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _strings(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_add_a_parallelism_config_and_flag():
    # harts/config/parallel.py: a field per dimension, named in DIMS, parsed from --parallel
    assert tuple(f.name for f in dataclasses.fields(ParallelConfig)) == DIMS
    assert parse_degrees(",".join(f"{d}=1" for d in DIMS)) == dict.fromkeys(DIMS, 1)


def test_add_a_parallelism_mesh(monkeypatch):
    # harts/distributed/mesh.py: the mesh's named dimensions and the run's description
    from harts.distributed import mesh

    named = _strings(_function(HARTS / "distributed" / "mesh.py", "init_mesh"))
    assert set(DIMS) <= named
    monkeypatch.setattr(mesh.dist, "get_backend", lambda: "gloo")
    described = mesh.DistMesh(ParallelConfig(dp=2, ep=2), None, None, torch.device("cpu")).describe()
    assert set(DIMS) <= set(described["dims"])
    assert "check_launch" in {n.name for n in ast.walk(ast.parse((HARTS / "distributed" / "mesh.py").read_text()))
                              if isinstance(n, ast.FunctionDef)}


def test_add_a_parallelism_apply_functions_in_order():
    # harts/distributed/parallelize.py: one apply_* per parallelism, called by parallelize in order
    body = _function(HARTS / "distributed" / "parallelize.py", "parallelize")
    calls = [n.func.id for n in sorted((n for n in ast.walk(body) if isinstance(n, ast.Call)),
                                       key=lambda n: (n.lineno, n.col_offset))
             if isinstance(n.func, ast.Name) and n.func.id.startswith("apply_")]
    order = ["apply_pp", "apply_tp", "apply_ep", "apply_fsdp"]
    assert [c for c in calls if c in order] == order


# the degrees the simulator's cost model prices; tp is not modelled there
SIM_PRICED = ("dp", "pp", "ep")


def test_add_a_parallelism_the_simulators_cost_model():
    # harts/sim/ops.py (StageCounter) through harts/sim/costs.py: memory and step-end work
    # of a stage under each degree
    from harts.config.models import get_model_config
    from harts.sim.costs import make_cost_model
    from harts.sim.hardware import load_hardware

    model, hardware = get_model_config("tiny"), load_hardware("h200")

    def priced(par: ParallelConfig) -> tuple[float, float, float]:
        cost = make_cost_model("roofline", model, par, hardware)
        return cost.static_bytes(0), cost.grad_sync(0), cost.optimizer(0)

    base = priced(ParallelConfig(dp=2))
    changed = {d for d, par in (("dp", ParallelConfig(dp=4)), ("pp", ParallelConfig(dp=2, pp=2)),
                                ("ep", ParallelConfig(dp=2, ep=2)), ("tp", ParallelConfig(dp=2, tp=2)))
               if priced(par) != base}
    assert changed == set(SIM_PRICED)
