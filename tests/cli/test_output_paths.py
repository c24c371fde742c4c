"""One rule for every file a command writes: the folder must exist, the target must not be
a directory (one-line error, exit code 2, before any work), and writes are atomic."""

from __future__ import annotations

import pytest

from harts.cli.common import UserError, atomic_output, check_output_path, write_output
from harts.cli.main import main


def _writers(target: str) -> list[list[str]]:
    """Every command that writes a file, with `target` as its output."""
    return [
        ["workload", "generate", "--workload", "tiny-stepwise", "--out", target],
        ["plan", "--planner", "l1", "--workload", "tiny-treestep", "--out", target],
        ["plan", "make", "--planner", "l1", "--workload", "tiny-treestep", "--out", target],
        ["sim", "--workload", "tiny-treestep", "--model", "tiny", "--gpus", "1", "--gantt", target],
        ["sim", "--workload", "tiny-treestep", "--model", "tiny", "--gpus", "1", "--trace", target],
        ["sim", "--workload", "tiny-treestep", "--model", "tiny", "--gpus", "1", "--schedule-out", target],
        ["sim", "sweep", "--workload", "tiny-treestep", "--model", "tiny", "--gpus", "1", "--gantt", target],
        ["sim", "fit", "--profile", "unused.json", "--out", target],
        ["sim", "rollout", "--policy", "heddle", "--gpus", "8", "--gantt", target],
        # a server URI: no local store to check, so the output path is the first thing looked at
        ["report", "--tracking-uri", "http://127.0.0.1:9", "--out", target],
        ["bench", "--out", target],
    ]


def _flag(argv: list[str]) -> str:
    return argv[-2]


@pytest.mark.parametrize("argv", _writers("PLACEHOLDER"), ids=lambda a: " ".join(a[:2]) + " " + a[-2])
def test_missing_folder_and_directory_target_are_refused(argv, tmp_path, capsys):
    missing = str(tmp_path / "missing" / "out.file")
    assert main([missing if a == "PLACEHOLDER" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{_flag(argv)} {missing}" in err and "does not exist" in err
    assert main([str(tmp_path) if a == "PLACEHOLDER" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a directory" in err
    assert [p.name for p in tmp_path.iterdir()] == []  # nothing created, nothing left behind


def test_a_write_that_fails_leaves_nothing_and_keeps_the_old_file(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_output(target, "--out") as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer failed")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]
    write_output(target, "--out", "new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_generate_failing_midway_leaves_nothing(tmp_path, monkeypatch, capsys):
    import harts.tree.io

    def boom(trajs, fh):
        fh.write("partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(harts.tree.io, "write_jsonl", boom)
    out = tmp_path / "w.jsonl"
    assert main(["workload", "generate", "--workload", "tiny-stepwise", "--out", str(out)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_temporary_file_keeps_the_suffix(tmp_path):
    with atomic_output(tmp_path / "g.png", "--gantt") as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp.name != "g.png"
        tmp.write_bytes(b"x")
    assert (tmp_path / "g.png").read_bytes() == b"x"


def test_a_parent_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="is not a folder"):
        check_output_path(tmp_path / "f" / "x.json", "--out")


def test_every_write_prints_its_path(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--planner", "l1", "--workload", "tiny-treestep", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    gantt = tmp_path / "s.png"
    assert main(["sim", "sweep", "--workload", "tiny-treestep", "--model", "tiny", "--gpus", "1",
                 "--planners", "l1", "--schedules", "consumer-1f1b", "--gantt", str(gantt)]) == 0
    assert f"wrote {gantt}" in capsys.readouterr().out and gantt.exists()


def test_sim_sweep_writes_the_one_gantt_file_it_is_given(tmp_path, capsys):
    """A panel per workload and schedule, in the named file and no other."""
    import json

    from PIL import Image

    gantt = tmp_path / "sweep.png"
    one = tmp_path / "one" / "sweep.png"
    one.parent.mkdir()
    common = ["sim", "sweep", "--workload", "tiny-treestep", "--model", "tiny", "--gpus", "4", "--pp", "2",
              "--planners", "l1l2", "--json"]
    assert main([*common, "--schedules", "non-overlap,consumer-1f1b", "--gantt", str(gantt)]) == 0
    out = capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "sweep.png"]
    assert out.err == f"wrote {gantt}\n"
    assert [r["gantt"] for r in json.loads(out.out)["schedules"]] == [str(gantt)] * 2
    assert main([*common, "--schedules", "consumer-1f1b", "--gantt", str(one)]) == 0
    capsys.readouterr()
    with Image.open(gantt) as two_panels, Image.open(one) as one_panel:
        assert two_panels.width == one_panel.width and two_panels.height > 1.6 * one_panel.height


def test_bench_without_a_gpu_refuses_cleanly(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench"]) == 2
    assert capsys.readouterr().err.strip() == "harts: error: harts bench needs a CUDA device"


def test_written_files_get_the_mode_a_plain_open_gives(tmp_path):
    import os

    mask = os.umask(0o022)
    try:
        out = write_output(tmp_path / "plan.json", "--out", "{}")
        assert out.stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(mask)
