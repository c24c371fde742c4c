"""--tree-attention / --baseline-attention set the backend's switches; misuse is a clear error."""

from __future__ import annotations

import argparse

import pytest

from harts.cli.common import add_attention_args, apply_attention_args
from harts.cli.main import main
from harts.exec import backend


def test_flags_set_and_clear_the_backend_switches(monkeypatch):
    # registered with monkeypatch, so whatever the flags set is undone after the test
    monkeypatch.setenv(backend.TREE_ATTENTION_ENV, "")
    monkeypatch.setenv(backend.BASELINE_ATTENTION_ENV, "")
    p = argparse.ArgumentParser()
    add_attention_args(p)
    apply_attention_args(p.parse_args(["--tree-attention", "cudnn", "--baseline-attention", "graph"]))
    import os

    assert os.environ[backend.TREE_ATTENTION_ENV] == "cudnn"
    assert backend.expanded_graph_attention()
    apply_attention_args(p.parse_args(["--tree-attention", "auto", "--baseline-attention", "cudnn"]))
    assert backend.TREE_ATTENTION_ENV not in os.environ
    assert not backend.expanded_graph_attention() and backend.baseline_attention() == ""
    with pytest.raises(SystemExit):
        p.parse_args(["--tree-attention", "grpah"])


def test_verify_refuses_attention_switches_on_the_cpu(capsys):
    # on the CPU the equivalence check runs the references: the GPU switches would be ignored
    assert main(["verify", "--baseline-attention", "graph"]) == 2
    assert "--device cuda" in capsys.readouterr().err
