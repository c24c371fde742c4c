"""`TrainConfig`: a whole run as data. Built or read from TOML it checks every field and
names the bad one by its dotted path; TOML round-trips (defaults, every section set, the
"none" of optional values); unknown keys are refused naming the key."""

from __future__ import annotations

import pytest

from harts.config.kernels import KernelConfig
from harts.config.loss import PolicyLossConfig
from harts.config.models import ConfigError
from harts.config.optimizer import OptimizerConfig
from harts.config.train import (
    SCHEDULES,
    CheckpointSettings,
    DataSource,
    ModelSource,
    PlanSource,
    Precision,
    TrainConfig,
    TrainParallel,
)


def _round_trip(config: TrainConfig, tmp_path) -> TrainConfig:
    path = tmp_path / "run.toml"
    path.write_text(config.to_toml())
    return TrainConfig.from_toml(path)


def test_defaults_round_trip(tmp_path):
    assert _round_trip(TrainConfig(), tmp_path) == TrainConfig()
    assert TrainConfig.from_dict(TrainConfig().to_dict()) == TrainConfig()


def test_every_section_round_trips(tmp_path):
    config = TrainConfig(
        mode="tree", steps=7, seed=3, old_logprobs="input", aux_scope="global",
        model=ModelSource(path="ckpt/kimi", allow_pickle=True, recompute=True),
        data=DataSource(input="rollouts.jsonl"),
        plan=PlanSource(file="plan.json", microbatch_tokens=512, window_floors="h100"),
        parallel=TrainParallel(pp=2, schedule="overlap-bwd-first", sequence_parallel=False),
        optimizer=OptimizerConfig(lr=3e-5, betas=(0.8, 0.9), weight_decay=0.1, grad_clip=None),
        loss=PolicyLossConfig(clip_ratio_c=3.0, kl_coef=0.05, agg_mode="seq-mean-token-sum",
                              lm_head_chunk_elements=None),
        kernels=KernelConfig(conv="reference", conv_bwd_tiles=(64, 32, 2, 4, 32, 4), force_reference=True),
        checkpoint=CheckpointSettings(dir="ck", every=2, resume=True),
        precision=Precision(dtype="float64", device="cpu"),
    )
    back = _round_trip(config, tmp_path)
    assert back == config
    assert back.model.name is None and back.data.workload is None and back.parallel.dp is None
    text = config.to_toml()
    assert 'grad_clip = "none"' in text and "[parallel]" in text and "dp =" not in text


def test_toml_as_written_by_hand(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('mode = "tree"\nsteps = 2\n\n[data]\ninput = "r.jsonl"\n\n[optimizer]\nlr = 1\n'
                    '\n[parallel]\ndp = 2\n')
    config = TrainConfig.from_toml(path)
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.parallel == TrainParallel(dp=2) and config.planner == "l1l2"  # a distributed run's default
    assert config.data == DataSource(input="r.jsonl") and config.kernels is None
    assert config.parallel.resolve(2).spec() == "dp=2,pp=1,ep=1,tp=1"
    assert TrainParallel(pp=2).resolve(4).dp == 2  # an unset dp fills the ranks pp x tp leave


@pytest.mark.parametrize("text, field, words", [
    ("stepz = 2\n", "stepz", "unknown key `stepz`"),
    ("[optimizer]\nlearning_rate = 1e-3\n", "optimizer.learning_rate", "unknown key `optimizer.learning_rate`"),
    ("[pipeline]\nschedule = 'x'\n", "pipeline", "unknown key `pipeline`"),
    ("steps = 0\n", "steps", "`steps` must be >= 1"),
    ("steps = 2.5\n", "steps", "expected an integer"),
    ("model = 'tiny-cpu'\n", "model", "is a table"),
    ("[optimizer]\nlr = -1.0\n", "optimizer.lr", "lr must be > 0"),
    ("[loss]\nagg_mode = 'mean'\n", "loss.agg_mode", "unknown 'mean'"),
    ("[checkpoint]\nevery = 2\n", "checkpoint.every", "needs `checkpoint.dir`"),
    ("[plan]\nfile = 'p.json'\n", "plan.file", "needs `parallel`"),
    ("[plan]\nplanner = 'l1l2'\n", "plan.planner", "needs `mode` tree"),
    ("[parallel]\ndp = 2\n", "mode", "set `mode` tree"),
    ("mode = 'tree'\n[parallel]\npp = 2\n", "old_logprobs", "needs `old_logprobs` input"),
    ("mode = 'tree'\nold_logprobs = 'input'\n[parallel]\npp = 2\ntp = 2\n", "parallel.pp", "data parallelism only"),
    ("[parallel]\ndp = 2\nep = 3\n", "parallel.ep", "must divide"),
    ("[parallel]\nschedule = 'gpipe'\n", "parallel.schedule", "not one of"),
    ("[precision]\ndtype = 'float16'\n", "precision.dtype", "not one of"),
    ("[kernels]\nconv = 'cuda'\n", "kernels.conv", "expected one of"),
    ("[model]\nname = 'tiny-cpu'\npath = 'x'\n", "model.path", "exclusive"),
    ("[model]\nname = 'tiny'\npath = 'x'\n", "model.path", "exclusive"),
    ("[checkpoint]\nsave = 'out'\n", "checkpoint.save", "needs `model.path`"),
    ("mode = 'fast'\n", "mode", "not one of"),
    ("[loss]\nkl_coef = -1\n", "loss.kl_coef", ">= 0"),
    ("steps = [\n", "", "not TOML"),
])
def test_a_bad_file_is_refused_naming_the_field(tmp_path, text, field, words):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_toml(path)
    assert err.value.field == field and words in str(err.value) and "\n" not in str(err.value)


def test_built_configs_are_checked_too():
    with pytest.raises(ConfigError, match="`checkpoint.resume` needs `checkpoint.dir`") as err:
        CheckpointSettings(resume=True)
    assert err.value.field == "checkpoint.resume"
    with pytest.raises(ConfigError, match="expected true or false"):
        ModelSource(recompute="yes")  # type: ignore[arg-type]
    assert ModelSource(path="x").name is None  # a path replaces the default name


def test_override_sets_dotted_paths():
    base = TrainConfig()
    config = base.override({"mode": "tree", "optimizer.lr": 1e-3, "parallel.dp": 2, "kernels.conv": "reference"})
    assert (config.mode, config.optimizer.lr, config.parallel.dp) == ("tree", 1e-3, 2)
    assert config.kernels.conv == "reference" and config.optimizer.grad_clip == base.optimizer.grad_clip
    with pytest.raises(ConfigError, match="unknown key `optimizer.momentum`"):
        base.override({"optimizer.momentum": 0.9})


def test_schedules_are_the_simulators():
    from harts.plan.schedule import ScheduleName

    assert set(SCHEDULES) == {s.value for s in ScheduleName}


def test_window_floors_plan_the_step_with_the_profiles_floors():
    """`plan.window_floors` (a hardware profile) makes the run's l1l2 plan the library's
    with window_floors for the model on that profile; an empty value or an unknown profile
    is refused naming the field."""
    from harts.config.models import get_model_config
    from harts.config.plan import PlanConfig
    from harts.plan.planners import make_plan
    from harts.sim.executor import window_floors
    from harts.sim.hardware import load_hardware
    from harts.train.errors import TrainError
    from harts.train.run import _plan
    from harts.tree import build_forest, shapes

    mc = get_model_config("tiny-h200")
    trajs = shapes.draw("bushy", 3, 8192, vocab_size=mc.vocab_size)
    config = TrainConfig(mode="tree", plan=PlanSource(planner="l1l2", microbatch_tokens=8192, window_floors="h100"))
    got = _plan(config, trajs, mc)
    floors = dict(zip(("microbatch_floor", "consumer_floor", "consumer_row_cost"),
                      window_floors(mc, load_hardware("h100"), 8192), strict=True))
    want = make_plan(build_forest(trajs), "l1l2", PlanConfig(microbatch_tokens=8192, chunk_size=mc.chunk_size,
                                                             **floors))
    assert [m.to_dict() for m in got.microbatches] == [m.to_dict() for m in want.microbatches]
    with pytest.raises(ConfigError, match="plan.window_floors"):
        PlanSource(window_floors="")
    with pytest.raises(TrainError, match="unknown hardware profile") as err:
        _plan(TrainConfig(mode="tree", plan=PlanSource(planner="l1l2", window_floors="nosuch")), trajs, mc)
    assert err.value.field == "plan.window_floors"


def test_window_floors_auto_takes_the_profile_of_the_cuda_device(monkeypatch):
    """"auto" (the default) plans with the shipped profile of the CUDA device trained on
    (an H100: h100's floors) and with rows alone on the CPU or an unknown GPU, as "off" does."""
    import torch

    from harts.config.models import get_model_config
    from harts.train.run import _device_profile, _plan
    from harts.tree import shapes

    assert PlanSource().window_floors == "auto"
    mc = get_model_config("tiny-h200")
    trajs = shapes.draw("bushy", 3, 8192, vocab_size=mc.vocab_size)

    def plan(floors, device=None):
        config = TrainConfig(mode="tree", plan=PlanSource(planner="l1l2", microbatch_tokens=8192, window_floors=floors),
                             precision=Precision(device=device))
        return [m.to_dict() for m in _plan(config, trajs, mc).microbatches]

    assert _device_profile("cpu") is None
    rows_alone = plan("off", "cpu")
    assert plan("auto", "cpu") == rows_alone == plan(None, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, want in (("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert _device_profile("cuda") == want
        assert plan("auto", "cuda") == (rows_alone if want is None else plan(want, "cuda"))
    # on this instance the h100 floors drop the windows (L1's plan is the cheaper)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert plan("auto", "cuda") != rows_alone
