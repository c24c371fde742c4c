"""--tree-attention / --baseline-attention build the run's KernelConfig; misuse is a clear error."""

from __future__ import annotations

import argparse
import os

import pytest

from harts.cli.common import UserError, add_attention_args, kernel_config
from harts.cli.main import main
from harts.config import env


def test_flags_build_the_kernel_config_without_touching_the_environment(monkeypatch):
    monkeypatch.delenv(env.TREE_ATTENTION, raising=False)
    monkeypatch.delenv(env.BASELINE_ATTENTION, raising=False)
    p = argparse.ArgumentParser()
    add_attention_args(p)
    before = dict(os.environ)
    k = kernel_config(p.parse_args(["--tree-attention", "cudnn", "--baseline-attention", "graph"]))
    assert (k.tree_attention, k.baseline_attention) == ("cudnn", "graph")
    assert dict(os.environ) == before
    k = kernel_config(p.parse_args(["--tree-attention", "auto", "--baseline-attention", "cudnn"]))
    assert (k.tree_attention, k.baseline_attention) == ("auto", "cudnn")
    with pytest.raises(SystemExit):
        p.parse_args(["--tree-attention", "grpah"])


def test_the_environment_builds_the_default_and_flags_override_it(monkeypatch):
    p = argparse.ArgumentParser()
    add_attention_args(p)
    monkeypatch.setenv(env.TREE_ATTENTION, "varlen")
    monkeypatch.setenv(env.BASELINE_ATTENTION, "flash")
    k = kernel_config(p.parse_args(["--baseline-attention", "graph"]))
    assert (k.tree_attention, k.baseline_attention) == ("varlen", "graph")
    monkeypatch.setenv(env.TREE_ATTENTION, "grpah")
    with pytest.raises(UserError, match="HARTS_TREE_ATTENTION"):
        kernel_config(p.parse_args([]))


def test_verify_refuses_attention_switches_on_the_cpu(capsys):
    # on the CPU the equivalence check runs the references: the GPU switches would be ignored
    assert main(["verify", "--baseline-attention", "graph"]) == 2
    assert "--device cuda" in capsys.readouterr().err


def test_compile_flag_sets_the_compiled_regions_over_the_environment(monkeypatch):
    p = argparse.ArgumentParser()
    add_attention_args(p)
    monkeypatch.delenv(env.COMPILE, raising=False)
    assert kernel_config(p.parse_args([])).compile == "off"
    assert kernel_config(p.parse_args(["--compile", "inductor"])).compile == "inductor"
    monkeypatch.setenv(env.COMPILE, "inductor")
    assert kernel_config(p.parse_args([])).compile == "inductor"
    assert kernel_config(p.parse_args(["--compile", "off"])).compile == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--compile", "max-autotune"])
