"""Checkpoint and resume (`harts.distributed.checkpoint`, `harts train --checkpoint-dir/--resume`).

- A `harts train` run killed with SIGKILL right after a checkpoint and resumed with `--resume`
  computes the following steps and final weights bit-identically to an uninterrupted run.
- A checkpoint saved by two gloo processes under FSDP2 (`fully_shard`, dp=2) loads into one
  process (dp=1), and the next step there equals the dp=2 run's next step within 1e-12.
- A truncated or corrupted checkpoint is refused with one line naming the file; a crash while
  a checkpoint is written leaves the previous one loadable and `latest` unchanged.

Child processes run with one thread, a free port each, and a timeout on every wait; on any
failure every child still running is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from harts.cli.main import main
from harts.config.models import get_model_config
from harts.config.optimizer import OptimizerConfig
from harts.distributed.checkpoint import (
    CheckpointError,
    DataPosition,
    TrainState,
    latest_checkpoint,
    load_checkpoint,
    read_train_state,
    save_checkpoint,
)
from harts.exec.model import build_model
from harts.exec.trainer import ExpandedTrainer
from harts.tree.io import save_jsonl
from harts.tree.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # seconds any child process may run


def _small_config():
    return get_model_config("tiny-cpu").replace(
        name="test-checkpoint", vocab_size=48, d_model=24, kda_num_heads=2, kda_head_dim=8,
        kda_head_v_dim=8, chunk_size=16, mla_num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, dense_ffn_dim=24, num_experts=4, top_k=2,
        expert_ffn_dim=12, init_std=0.2,
    )


def _trajectories(vocab: int, lengths=(14, 9, 21, 12), seed: int = 0) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = np.r_[np.zeros(4, int), np.ones(n - 4, int)]
        out.append(Trajectory.make(id=f"t{i}", group=f"g{i % 2}", tokens=rng.integers(0, vocab, n), loss_mask=mask,
                                   advantage=float(rng.normal()), old_logprobs=-rng.uniform(1.0, 6.0, n)))
    return out


def _trainer(seed: int = 0) -> ExpandedTrainer:
    model = build_model(_small_config(), seed=seed, dtype=torch.float64)
    return ExpandedTrainer(model, OptimizerConfig(lr=1e-2, grad_clip=1.0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # faulthandler: a worker that dies on a signal prints its Python stacks into the failure
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


class _Children:
    """Started child processes; `close` kills whichever still run (a failing test hangs nothing)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        return proc

    def finish(self, proc: subprocess.Popen) -> tuple[int, str, str]:
        out, err = proc.communicate(timeout=TIMEOUT)
        return proc.returncode, out, err

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.fixture
def children():
    c = _Children()
    try:
        yield c
    finally:
        c.close()


def _params(trainer: ExpandedTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# ---- single process: SIGKILL after a checkpoint, --resume, bit-identical continuation

# runs `harts train` and SIGKILLs its own process as soon as the checkpoint of step KILL_AFTER
# is complete (nothing flushed, nothing cleaned up: the process just stops)
_KILLER = textwrap.dedent("""
    import os, signal, sys
    import harts.distributed.checkpoint as ckpt
    from harts.cli.main import main
    kill_after = int(sys.argv[1])
    save = ckpt.save_checkpoint
    def save_then_die(directory, state, *args, **kwargs):
        path = save(directory, state, *args, **kwargs)
        if state.step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return path
    ckpt.save_checkpoint = save_then_die
    sys.exit(main(sys.argv[2:]))
""")


def test_sigkill_after_checkpoint_then_resume_is_bit_identical(tmp_path, children):
    config = get_model_config("tiny-cpu")
    data = tmp_path / "rollouts.jsonl"
    save_jsonl(_trajectories(config.vocab_size, lengths=(10, 7, 12)), data)
    common = ["train", "--input", str(data), "--dtype", "float64", "--steps", "3", "--lr", "1e-2", "--json"]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full = children.start([sys.executable, "-m", "harts", *common, "--checkpoint-dir", str(full_dir)])
    cut = children.start([sys.executable, "-c", _KILLER, "2", *common, "--checkpoint-dir", str(cut_dir),
                          "--checkpoint-every", "2"])
    rc, _, err = children.finish(cut)
    assert rc == -signal.SIGKILL, err
    assert latest_checkpoint(cut_dir).name == "step-000002"
    assert not (cut_dir / "step-000003").exists()

    resumed = children.start([sys.executable, "-m", "harts", *common, "--checkpoint-dir", str(cut_dir),
                              "--checkpoint-every", "2", "--resume"])
    rc, out, err = children.finish(resumed)
    assert rc == 0, err
    resumed_steps = json.loads(out)["steps"]
    rc, out, err = children.finish(full)
    assert rc == 0, err
    full_steps = json.loads(out)["steps"]

    assert [s["step"] for s in resumed_steps] == [3]
    keys = ("loss", "pg_loss", "kl", "entropy", "aux_loss", "clip_frac", "ppo_kl", "grad_norm")
    assert {k: resumed_steps[0][k] for k in keys} == {k: full_steps[2][k] for k in keys}

    # the final weights and optimizer state, loaded from each run's last checkpoint, are equal
    states = []
    for d in (full_dir, cut_dir):
        model = build_model(config, seed=1, dtype=torch.float64)
        trainer = ExpandedTrainer(model)
        state = load_checkpoint(latest_checkpoint(d), model, trainer.optimizer, restore_rng=False)
        assert state.step == 3 and state.data.next_batch == 3
        states.append((model.state_dict(), trainer.optimizer.state_dict()["state"]))
    (m_full, o_full), (m_cut, o_cut) = states
    assert m_full.keys() == m_cut.keys()
    for k in m_full:
        assert torch.equal(m_full[k], m_cut[k]), k
    for i in o_full:
        for k in o_full[i]:
            assert torch.equal(o_full[i][k], o_cut[i][k]), (i, k)


# ---- torchrun, two gloo ranks: one SIGKILLed after a checkpoint, `torchrun ... --resume`

# the torchrun worker script: `harts train`, rank 1 SIGKILLing itself once the checkpoint of
# step KILL_AFTER is complete (its peer is then stopped by torchrun's agent)
_RANK_KILLER = _KILLER.replace("if state.step == kill_after:",
                               'if state.step == kill_after and os.environ.get("RANK") == "1":')


@pytest.mark.parametrize("nproc, parallel", [(2, ["dp=2"]), (2, ["pp=2", "--old-logprobs", "input"]),
                                             (4, ["dp=2,pp=2", "--old-logprobs", "input"])],
                         ids=["dp2", "pp2", "dp2pp2"])
def test_torchrun_rank_killed_after_a_checkpoint_resumes_bit_identically(tmp_path, children, nproc, parallel):
    """dp2pp2: two replicas of a two-stage pipeline, each stage sharded by FSDP2 over the
    replicas (its checkpoint the shards of every stage)."""
    config = get_model_config("tiny-cpu")
    data = tmp_path / "rollouts.jsonl"
    save_jsonl(_trajectories(config.vocab_size, lengths=(10, 7, 12)), data)
    killer = tmp_path / "killer.py"
    killer.write_text(_RANK_KILLER)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    common = ["train", "--mode", "tree", "--input", str(data), "--dtype", "float64", "--device", "cpu",
              "--steps", "3", "--lr", "1e-2", "--json", "--checkpoint-every", "1", "--parallel", *parallel]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    rc, out, err = children.finish(children.start([*torchrun, "-m", "harts", *common, "--checkpoint-dir", str(full_dir)]))
    assert rc == 0, err
    full_steps = json.loads(out)["steps"]
    rc, _, err = children.finish(children.start([*torchrun, str(killer), "1", *common, "--checkpoint-dir", str(cut_dir)]))
    assert rc != 0 and "SIGKILL" in err, err
    assert latest_checkpoint(cut_dir).name == "step-000001"
    assert not (cut_dir / "step-000002").exists()

    rc, out, err = children.finish(children.start([*torchrun, "-m", "harts", *common, "--checkpoint-dir", str(cut_dir),
                                                   "--resume"]))
    assert rc == 0, err
    resumed_steps = json.loads(out)["steps"]
    keys = ("loss", "pg_loss", "kl", "entropy", "aux_loss", "clip_frac", "ppo_kl", "grad_norm")
    assert [s["step"] for s in resumed_steps] == [2, 3]
    for resumed, full in zip(resumed_steps, full_steps[1:], strict=True):
        assert {k: resumed[k] for k in keys} == {k: full[k] for k in keys}

    # the last checkpoints of both runs hold the same weights (the stages' and the shards'
    # names are the whole model's: one process loads them)
    weights = []
    for d in (full_dir, cut_dir):
        model = build_model(config, seed=1, dtype=torch.float64)
        state = load_checkpoint(latest_checkpoint(d), model, None, restore_rng=False)
        assert state.step == 3
        weights.append(model.state_dict())
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k


def _error(capsys) -> str:
    return json.loads(capsys.readouterr().out)["error"]


def test_resume_refuses_other_settings_and_an_existing_run_without_resume(tmp_path, capsys):
    trainer = _trainer()
    meta = {"model": "tiny-cpu", "mode": "expanded", "planner": None, "dtype": "float64",
            "microbatch_tokens": 4096, "lr": 1e-2, "grad_clip": 1.0, "agg_mode": "token-mean",
            "kl_coef": 0.0, "old_logprobs": "recompute"}
    data = tmp_path / "rollouts.jsonl"
    save_jsonl(_trajectories(512, lengths=(6, 5)), data)
    from harts.config.train import DataSource, TrainConfig
    from harts.train import data_source

    source = data_source(TrainConfig(data=DataSource(input=str(data))))
    save_checkpoint(tmp_path / "ck", TrainState(1, DataPosition(source, 1), meta), trainer.model, trainer.optimizer)
    base = ["train", "--input", str(data), "--dtype", "float64", "--steps", "2", "--lr", "1e-2", "--json",
            "--checkpoint-dir", str(tmp_path / "ck")]
    assert main(base) == 2
    assert "already holds checkpoints" in _error(capsys)
    assert main([*base, "--resume", "--dtype", "float32"]) == 2  # argparse: the last --dtype wins
    assert "--dtype float64; this run has float32" in _error(capsys)
    other = tmp_path / "other.jsonl"
    save_jsonl(_trajectories(512, lengths=(6, 6)), other)
    assert main([*base, "--resume", "--input", str(other)]) == 2
    assert "was written for data file:sha256=" in _error(capsys)
    assert main([*base[:-2], "--resume"]) == 2
    assert "--resume needs --checkpoint-dir" in _error(capsys)
    assert main(["train", "--json", "--checkpoint-every", "2"]) == 2
    assert "--checkpoint-every needs --checkpoint-dir" in _error(capsys)


# ---- RNG states and the data position round-trip


def test_rng_states_and_train_state_round_trip(tmp_path):
    import random

    trainer = _trainer()
    trainer.step(_trajectories(48), 4096)
    state = TrainState(step=7, data=DataPosition("workload:x:seed=3", next_batch=7), meta={"lr": 0.01})
    torch.manual_seed(11)
    np.random.seed(12)
    random.seed(13)
    path = save_checkpoint(tmp_path, state, trainer.model, trainer.optimizer)
    after_save = (torch.rand(4), np.random.rand(3), [random.random() for _ in range(3)])
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    other = _trainer(seed=5)
    loaded = load_checkpoint(path, other.model, other.optimizer)
    after_load = (torch.rand(4), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(after_save[0], after_load[0])
    assert np.array_equal(after_save[1], after_load[1])
    assert after_save[2] == after_load[2]
    assert loaded == TrainState(step=7, data=state.data, meta={"lr": 0.01}, world_size=1)
    for (k, a), b in zip(trainer.model.state_dict().items(), other.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


# ---- refused checkpoints


def _snapshot_dir(tmp_path) -> tuple[ExpandedTrainer, Path]:
    trainer = _trainer()
    trainer.step(_trajectories(48), 4096)
    path = save_checkpoint(tmp_path / "ck", TrainState(1, DataPosition("d", 1)), trainer.model, trainer.optimizer)
    return trainer, path


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_byte(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


@pytest.mark.parametrize("name, damage, says", [
    ("__0_0.distcp", _truncate, "truncated"),
    (".metadata", _truncate, "truncated"),
    ("__0_0.distcp", _flip_byte, "SHA-256"),
    ("rng-rank00000.json", Path.unlink, "missing"),
    ("manifest.json", _truncate, "corrupt"),
    ("manifest.json", Path.unlink, "missing"),
])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, name, damage, says):
    _, path = _snapshot_dir(tmp_path)
    damage(path / name)
    other = _trainer(seed=3)
    before = _params(other)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, other.model, other.optimizer)
    message = str(err.value)
    assert "\n" not in message and str(path / name) in message and says in message
    after = _params(other)  # refused before anything was loaded
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_harts_train_resume_refuses_a_truncated_checkpoint(tmp_path, capsys):
    data = tmp_path / "rollouts.jsonl"
    save_jsonl(_trajectories(512, lengths=(6, 5)), data)
    args = ["train", "--input", str(data), "--dtype", "float64", "--json", "--checkpoint-dir", str(tmp_path / "ck")]
    assert main([*args, "--steps", "1"]) == 0
    target = tmp_path / "ck" / "step-000001" / "__0_0.distcp"
    _truncate(target)
    capsys.readouterr()
    assert main([*args, "--steps", "2", "--resume"]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert str(target) in error and "truncated" in error and "\n" not in error


# ---- a crash while writing leaves the previous checkpoint


def _fail_in_dcp_writer(monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs

    write_item = fs._write_item
    calls = []

    def write_some_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) > 20:  # part of the data file written, then the disk "fails"
            raise OSError("simulated write failure")
        return write_item(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", write_some_then_fail)


def _fail_before_manifest(monkeypatch):
    import harts.distributed.checkpoint as ckpt

    def fail(*_args, **_kwargs):
        raise OSError("simulated crash before the manifest")

    monkeypatch.setattr(ckpt, "_write_manifest", fail)


def _fail_updating_latest(monkeypatch):
    import harts.distributed.checkpoint as ckpt

    def fail(*_args, **_kwargs):
        raise OSError("simulated crash after the rename, before latest")

    monkeypatch.setattr(ckpt, "_write_atomic", fail)


@pytest.mark.parametrize("crash", [_fail_in_dcp_writer, _fail_before_manifest, _fail_updating_latest])
def test_a_crash_while_writing_leaves_the_previous_checkpoint(tmp_path, monkeypatch, crash):
    trainer, first = _snapshot_dir(tmp_path)
    saved = _params(trainer)
    directory = first.parent
    trainer.step(_trajectories(48), 4096)
    with monkeypatch.context() as m:
        crash(m)
        with pytest.raises(CheckpointError):
            save_checkpoint(directory, TrainState(2, DataPosition("d", 2)), trainer.model, trainer.optimizer)
    assert (directory / "latest").read_text() == "step-000001\n"
    assert latest_checkpoint(directory) == first
    other = _trainer(seed=3)
    assert load_checkpoint(first, other.model, other.optimizer).step == 1
    loaded = _params(other)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    # the next save of that step succeeds over whatever the crash left
    again = save_checkpoint(directory, TrainState(2, DataPosition("d", 2)), trainer.model, trainer.optimizer)
    assert latest_checkpoint(directory) == again and read_train_state(again).step == 2
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step-000001", "step-000002"]


# ---- FSDP2 under gloo: a rank killed after a checkpoint; saved with dp=2, loaded with dp=1


def _shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """FSDP2 over the mesh: each block, then the root (the wrapping the distributed runner uses)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _dp_worker(rank: int, world: int, port: int, directory: str, steps: int, out: str, kill_after: int = 0) -> None:
    """One rank of a dp=`world` run of `steps` steps with a checkpoint after each, resuming
    from `directory`'s latest if there is one; rank 1 SIGKILLs itself once the checkpoint of
    step `kill_after` is complete. Rank 0 writes each step's numbers and the final weights.
    Every rank trains on the whole batch, so FSDP's averaged gradient is the batch's and a
    dp=2 step is the single-process step (up to the order of the sharded norm's sums)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from harts.distributed.checkpoint import CheckpointConfig, Checkpointer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        model = build_model(_small_config(), seed=0, dtype=torch.float64)
        _shard(model, init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)))
        trainer = ExpandedTrainer(model, OptimizerConfig(lr=1e-2, grad_clip=1.0))  # over the sharded parameters
        checkpoints = Checkpointer(CheckpointConfig(Path(directory), every=1), model, trainer.optimizer)
        resumed = checkpoints.resume()
        start = 0 if resumed is None else resumed.step
        batch = _trajectories(48)
        record = {}
        for step in range(start + 1, steps + 1):
            result = trainer.step(batch, 4096)
            record[step] = {**result.losses, "grad_norm": result.grad_norm}
            checkpoints.after_step(TrainState(step, DataPosition("d", step)))
            if step == kill_after and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            torch.save({"start": start, "steps": record, "params": full}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _start_dp2(children: _Children, directory: Path, steps: int, out: Path, kill_after: int = 0):
    port = _free_port()
    # a finished rank ends as harts' own workers do, without interpreter finalization (why:
    # harts/distributed/teardown.py); a rank that raises still exits 1 with its traceback
    return [children.start([sys.executable, "-c", "from tests.distributed.test_checkpoint import _dp_worker; "
                            "from harts.distributed.teardown import exit_without_finalization; "
                            f"_dp_worker({r}, 2, {port}, {str(directory)!r}, {steps}, {str(out)!r}, {kill_after}); "
                            "exit_without_finalization(0)"])
            for r in range(2)]


def _finish_all(children: _Children, procs) -> None:
    for p in procs:
        rc, _, err = children.finish(p)
        assert rc == 0, err


@pytest.fixture(scope="module")
def dp2_reference(tmp_path_factory):
    """An uninterrupted dp=2 run of 3 steps, checkpointing after each: (its directory, its record)."""
    base = tmp_path_factory.mktemp("dp2")
    c = _Children()
    try:
        _finish_all(c, _start_dp2(c, base / "ck", 3, base / "out.pt"))
    finally:
        c.close()
    return base / "ck", torch.load(base / "out.pt", weights_only=True)


def test_dp2_rank_killed_after_a_checkpoint_resumes_bit_identically(tmp_path, children, dp2_reference):
    _, reference = dp2_reference
    directory, out = tmp_path / "ck", tmp_path / "out.pt"
    rank0, rank1 = _start_dp2(children, directory, 3, out, kill_after=1)
    rc, _, err = children.finish(rank1)
    assert rc == -signal.SIGKILL, err
    rank0.kill()  # its peer is gone: the run is over (gloo would fail it at the next collective)
    children.finish(rank0)
    assert latest_checkpoint(directory).name == "step-000001" and not out.exists()

    _finish_all(children, _start_dp2(children, directory, 3, out))
    resumed = torch.load(out, weights_only=True)
    assert resumed["start"] == 1 and sorted(resumed["steps"]) == [2, 3]
    for step in (2, 3):
        assert resumed["steps"][step] == reference["steps"][step], step
    assert resumed["params"].keys() == reference["params"].keys()
    for k, v in resumed["params"].items():
        assert torch.equal(v, reference["params"][k]), k


def test_fsdp_dp2_checkpoint_loads_under_dp1_and_the_next_step_agrees(dp2_reference):
    directory, reference = dp2_reference
    path = directory / "step-000001"
    assert read_train_state(path).world_size == 2
    trainer = _trainer(seed=9)  # other initial weights: everything must come from the checkpoint
    assert load_checkpoint(path, trainer.model, trainer.optimizer).step == 1
    result = trainer.step(_trajectories(48), 4096)

    ref = reference["steps"][2]
    for k in ("loss", "pg_loss", "entropy", "aux_loss", "grad_norm"):
        value = result.grad_norm if k == "grad_norm" else result.losses[k]
        assert abs(value - ref[k]) <= 1e-12 * max(1.0, abs(ref[k])), (k, value, ref[k])
    # after step 2 the weights equal the dp=2 run's after its step 2: its step-2 checkpoint
    params = trainer.model.state_dict()
    saved = _trainer(seed=4)
    load_checkpoint(directory / "step-000002", saved.model, saved.optimizer, restore_rng=False)
    assert params.keys() == saved.model.state_dict().keys()
    for k, want in saved.model.state_dict().items():
        err = float((params[k] - want).abs().max())
        assert err <= 1e-12 * max(1.0, float(want.abs().max())), (k, err)


def test_keep_prunes_older_checkpoints_but_never_the_new_one(tmp_path):
    trainer = _trainer()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, TrainState(step, DataPosition("d", step)), trainer.model, trainer.optimizer, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002", "step-000003"]
    assert latest_checkpoint(tmp_path).name == "step-000003"
