"""The CPU thread policy of a `harts` process (`harts.config.env.thread_settings`): the
CPUs shared among the processes on the host, as tests/conftest.py shares them among the
suite's workers; OMP_NUM_THREADS kept; HARTS_THREADS wins; OpenMP's idle threads sleep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harts.cli.main import main
from harts.config.env import cpu_share, thread_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("environ, cpus, total, want", [
    # a quiet default: torch keeps its own count (no more than the CPUs); idle threads sleep
    ({}, 2, 2, (2, {"OMP_WAIT_POLICY": "PASSIVE"})),
    # a process restricted to fewer CPUs than the machine has (taskset, a cgroup cpuset)
    ({}, 4, 64, (4, {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"})),
    # torchrun's processes on one host share its CPUs
    ({"LOCAL_WORLD_SIZE": "4"}, 16, 16, (4, {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4",
                                            "OMP_WAIT_POLICY": "PASSIVE"})),
    ({"LOCAL_WORLD_SIZE": "4"}, 2, 2, (1, {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                          "OMP_WAIT_POLICY": "PASSIVE"})),
    # the user's OMP_NUM_THREADS and wait policy are kept (torchrun sets OMP_NUM_THREADS=1 itself)
    ({"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}, 2, 2, (3, {})),
    ({"MKL_NUM_THREADS": "2"}, 4, 8, (4, {"OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "PASSIVE"})),
    # an explicit HARTS_THREADS wins over everything
    ({"HARTS_THREADS": "1", "OMP_NUM_THREADS": "8", "LOCAL_WORLD_SIZE": "2"}, 16, 16,
     (1, {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"})),
    ({"HARTS_THREADS": " 6 "}, 2, 2, (6, {"OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "6",
                                          "OMP_WAIT_POLICY": "PASSIVE"})),
])
def test_thread_settings(environ, cpus, total, want):
    assert thread_settings(environ, cpus=cpus, total_cpus=total) == want


def test_the_share_is_the_suites():
    assert [cpu_share(2, n) for n in (1, 2, 3)] == [2, 1, 1]
    assert cpu_share(16, 4) == 4 and cpu_share(1, 0) == 1


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_malformed_harts_threads_is_refused(bad, monkeypatch, capsys):
    with pytest.raises(ValueError, match="HARTS_THREADS"):
        thread_settings({"HARTS_THREADS": bad}, cpus=2, total_cpus=2)
    monkeypatch.setenv("HARTS_THREADS", bad)
    assert main(["workload", "presets", "--json"]) == 2
    assert "HARTS_THREADS must be a whole number >= 1" in capsys.readouterr().out


_PROBE = ("import sys; from harts.cli.main import main; rc = main(['workload', 'presets', '--json']); "
          "import os, torch; print(torch.get_num_threads(), os.environ.get('OMP_WAIT_POLICY'), "
          "file=sys.stderr); sys.exit(rc)")


def _probe(**env) -> list[str]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("HARTS_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}
    base["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    run = subprocess.run([sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stderr.split()


def test_the_cli_applies_the_policy_before_torch_loads():
    """In a fresh process: the explicit override wins over OMP_NUM_THREADS, and the wait policy
    is set where the user set none."""
    assert _probe(HARTS_THREADS="1", OMP_NUM_THREADS="2") == ["1", "PASSIVE"]
    assert _probe(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="ACTIVE") == ["1", "ACTIVE"]
