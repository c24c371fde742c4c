"""The study registry: one `StrEnum` of names, one module per study, loaded on demand.

Importing this module is cheap (no study is imported); `get_study` imports the study's
module, which registers its `Study` once (in a `harts.config.registry.Registry`). An unknown name, a module that registers under
another name, or a second registration of a name fails loudly.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from harts.config.registry import Registry

if TYPE_CHECKING:
    from harts.experiments.common import Progress, StudyResult


class StudyName(StrEnum):
    COMPRESSION = "compression"
    PLANNERS = "planners"
    DP_BALANCE = "dp-balance"
    PP_SCHEDULES = "pp-schedules"
    FIDELITY = "fidelity"
    THROUGHPUT = "throughput"
    ROLLOUT = "rollout"


_MODULES: dict[StudyName, str] = {
    StudyName.COMPRESSION: "harts.experiments.compression",
    StudyName.PLANNERS: "harts.experiments.planners",
    StudyName.DP_BALANCE: "harts.experiments.dp_balance",
    StudyName.PP_SCHEDULES: "harts.experiments.pp_schedules",
    StudyName.FIDELITY: "harts.experiments.fidelity",
    StudyName.THROUGHPUT: "harts.experiments.throughput",
    StudyName.ROLLOUT: "harts.experiments.rollout",
}

CONFIG_NAMES = ("tiny", "default")


@dataclass(frozen=True)
class Study:
    name: StudyName
    title: str  # what it reproduces, e.g. "Table 4: two-level scheduling"
    run: Callable[[Any, Progress], StudyResult]
    configs: dict[str, Any] = field(default_factory=dict)  # "tiny" (tests), "default" (CPU, minutes)

    def config(self, name: str) -> Any:
        if name not in self.configs:
            raise ValueError(f"study {self.name.value}: unknown config {name!r}; known: {', '.join(self.configs)}")
        return self.configs[name]


_STUDIES: Registry[StudyName, Study] = Registry("study", StudyName, ValueError, "known studies")


def register_study(study: Study) -> Study:
    missing = [c for c in CONFIG_NAMES if c not in study.configs]
    if missing and isinstance(study.name, StudyName):
        raise ValueError(f"study {study.name.value!r} lacks configs {missing}")
    return _STUDIES.register(study.name, study)


def known_studies() -> list[str]:
    return [n.value for n in StudyName]


def get_study(name: str) -> Study:
    try:
        key = StudyName(name)
    except ValueError:
        raise ValueError(f"unknown study {name!r}; known studies: {', '.join(known_studies())}") from None
    if key not in _STUDIES:
        importlib.import_module(_MODULES[key])
        if key not in _STUDIES:
            raise RuntimeError(f"module {_MODULES[key]} did not register study {key.value!r}")
    return _STUDIES.get(key)


def run_study(name: str, config: str | Any = "default", progress: Progress | None = None,
              config_name: str | None = None) -> StudyResult:
    """Run study `name` with a named config ("tiny", "default") or a config object
    (recorded as `config_name`, "custom" unless given)."""
    from dataclasses import replace

    from harts.experiments.common import Progress

    study = get_study(name)
    config_name = config if isinstance(config, str) else (config_name or "custom")
    cfg = study.config(config) if isinstance(config, str) else config
    progress = progress or Progress()
    t0 = time.perf_counter()
    result = study.run(cfg, progress)
    return replace(result, study=study.name.value, title=study.title, config_name=config_name,
                   config=cfg, seconds=time.perf_counter() - t0)
