"""Studies that reproduce the HARTS paper's tables and figures, tracked in mlflow.

A study is a function from a config dataclass to a `StudyResult` (metrics, a table with
the paper's numbers next to ours, plots, saved plans and schedules). Studies use the
library's public APIs and never add branches to it. Each lives in
``harts/experiments/<study>/`` and registers itself under a `StudyName`; run one with
``harts experiment NAME`` (or `harts.experiments.registry.run_study`), and see the latest run of
every study with ``harts report``. The paper's tables and figures are experiment files, one
per table or figure in the repository's experiments/ folder (the study, its config and
parameters as TOML, `harts.experiments.files`), run with ``harts experiment run FILE``.

This package imports nothing heavy: torch and mlflow load inside the studies that need
them.
"""

from harts.experiments.registry import StudyName, get_study, known_studies, run_study

__all__ = ["StudyName", "get_study", "known_studies", "run_study"]
