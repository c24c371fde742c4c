"""Experiment files (experiments/*.toml, `harts experiment run FILE`): every file in the
folder names a registered study, a config it has and valid parameters; a small file runs
end to end; what a file does not know is refused naming it, exit code 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harts.cli.main import main
from harts.experiments.files import ExperimentFileError, load_experiment
from harts.experiments.registry import get_study, known_studies
from harts.experiments.steps import Case

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
FILES = sorted(EXPERIMENTS.glob("*.toml"))

SMALL = """
reproduces = "Table 4: two-level scheduling (tiny)"
study = "planners"
config = "tiny"

[parameters]
cases = [{model = "tiny", gpus = 8, scheme = "treestep"}]
planners = ["l1", "l1l2"]
steps = 1
save_plans = false
"""


def _numbers(text: str) -> set[str]:
    """The tables and figures a text names: {"Table 7", "Figure 5"} for "Table 7 / Figure 5"."""
    return {f"{kind} {n}" for kind, n in re.findall(r"(Table|Figure) (\d+)", text)}


def test_the_folder_holds_a_file_per_study():
    assert {load_experiment(f).study for f in FILES} == set(known_studies())


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_every_file_names_a_study_and_valid_parameters(path):
    exp = load_experiment(path)
    study = get_study(exp.study)
    assert exp.config_name in study.configs
    # every parameter the file gives is a field of the study's config, set to the file's value
    assert exp.parameters
    base = study.config(exp.config_name)
    assert type(exp.config) is type(base)
    for key in exp.parameters:
        assert hasattr(exp.config, key)
    # the table or figure the file reproduces is the one its study reproduces
    assert exp.reproduces.strip()
    assert _numbers(exp.reproduces) == _numbers(study.title)


def test_a_file_replaces_the_named_configs_fields(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    exp = load_experiment(path)
    tiny = get_study("planners").config("tiny")
    assert exp.config.cases == (Case("tiny", 8, "treestep"),)
    assert exp.config.planners == ("l1", "l1l2") and exp.config.save_plans is False
    assert exp.config.time_limit == tiny.time_limit and exp.config.num_groups == tiny.num_groups


def test_a_small_file_runs_end_to_end(tmp_path, capsys):
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    assert main(["experiment", "run", str(path), "--no-log", "--json", "-q"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["study"] == "planners" and out["file"] == str(path) and out["config_name"] == "small"
    assert out["config"]["planners"] == ["l1", "l1l2"]
    assert {row["planner"] for row in out["table"]["rows"]} == {"HARTS L1", "HARTS L1+L2"}
    assert "reproduces Table 4: two-level scheduling (tiny)" in out["notes"][0]


@pytest.mark.parametrize("text, key", [
    ('reproduces = "x"\nstudy = "planners"\nextra = 1\n', "extra"),
    ('reproduces = "x"\nstudy = "planners"\n[parameters]\nplaners = ["l1"]\n', "planers"),
    ('reproduces = "x"\nstudy = "planners"\n[parameters]\n'
     'cases = [{model = "tiny", gpus = 8, scheme = "treestep", gpu = 2}]\n', "gpu"),
    ('reproduces = "x"\nstudy = "pp-schedules"\n[parameters]\ncase = {model = "tiny", gpus = 8}\n', "scheme"),
    ('reproduces = "x"\nstudy = "planners"\n[parameters]\nsteps = "3"\n', "steps"),
    ('reproduces = "x"\nstudy = "planners"\n[parameters]\nplanners = "l1"\n', "planners"),
    ('reproduces = "x"\nstudy = "planner"\n', "planner"),
    ('reproduces = "x"\nstudy = "planners"\nconfig = "huge"\n', "huge"),
    ('study = "planners"\n', "reproduces"),
])
def test_what_a_file_does_not_know_is_refused_naming_it(tmp_path, capsys, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ExperimentFileError, match=re.escape(repr(key)) + "|" + re.escape(key)):
        load_experiment(path)
    assert main(["experiment", "run", str(path), "--no-log", "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["file"] == str(path) and key in err["error"]


def test_unknown_keys_are_located(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('reproduces = "x"\nstudy = "planners"\n\n[parameters]\nsteps = 1\nplaners = ["l1"]\n')
    with pytest.raises(ExperimentFileError) as err:
        load_experiment(path)
    assert (err.value.line, err.value.field) == (6, "parameters.planers")


def test_run_takes_exactly_one_file(tmp_path, capsys):
    assert main(["experiment", "run", "--no-log"]) == 2
    assert "experiment file" in capsys.readouterr().err
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    assert main(["experiment", "run", str(path), "--config", "tiny", "--no-log"]) == 2
    assert "--config" in capsys.readouterr().err
    assert main(["experiment", "planners", str(path), "--no-log"]) == 2
    assert "only 'harts experiment run' takes a file" in capsys.readouterr().err
    assert main(["experiment", "run", str(tmp_path / "missing.toml"), "--no-log"]) == 2
    assert "missing.toml" in capsys.readouterr().err
