"""The README's "Inside verl / TRL" section, run as written: its TRL block (where TRL is
installed: the main environment) and its verl block (where verl is: scripts/verl_env.sh),
each in a fresh process from a folder holding `tiny-qwen3-next`, a tiny Qwen3-Next built
with transformers' classes, saved with `save_pretrained` beside its word-level tokenizer.
Its expert widths are multiples of 4 floats: transformers' default grouped-GEMM experts
need 16-byte strides on the CPU. The bash block's extras must be pyproject's.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SECTION = "Inside verl / TRL"


def _blocks(lang: str) -> list[str]:
    start = README.index(f"## {SECTION}\n")
    end = README.find("\n## ", start + 1)
    return re.findall(rf"```{lang}\n(.*?)```", README[start:end], flags=re.S)


def _tiny_checkpoint(folder: Path) -> None:
    from tests.integrations.tiny_models import VOCAB, build, tokenizer

    model = build("qwen3_next", torch.float32, moe_intermediate_size=12, shared_expert_intermediate_size=16)
    model.save_pretrained(folder / "tiny-qwen3-next")
    tokenizer(VOCAB["qwen3_next"]).save_pretrained(folder / "tiny-qwen3-next")


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_the_section_names_pyprojects_extras():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (block,) = _blocks("bash")
    named = re.findall(r"pip install 'harts\[(\w+)\]'", block)
    assert named == ["trl", "verl"]
    assert all(name in extras for name in named)


def test_trl_block_runs_as_written(tmp_path):
    pytest.importorskip("trl")
    _tiny_checkpoint(tmp_path)
    trl_block = _blocks("python")[0]
    assert "HartsGRPOTrainer" in trl_block
    run = _run(trl_block, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    compression = eval(run.stdout.strip().splitlines()[-1])  # the printed list of floats
    # a group's completions share its 12-token prompt: well over one token per row
    assert compression and min(compression) > 1.5


def test_verl_block_runs_as_written(tmp_path):
    pytest.importorskip("verl")
    _tiny_checkpoint(tmp_path)
    verl_block = _blocks("python")[1]
    assert 'backend="harts"' in verl_block
    check = ("\nimport harts.integrations.verl as h\nassert isinstance(engine, h.HartsEngine)\n"
             "print(sorted(dict(engine.get_per_tensor_param()[0])) == sorted(engine.loaded.source_dtypes))\n")
    run = _run(verl_block + check, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "True"
