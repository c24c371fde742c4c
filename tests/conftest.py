"""Hypothesis profiles: `quick` for local runs (default), `ci` when CI=true."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "quick", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "quick"))


def pytest_ignore_collect(collection_path, config):
    """tests/cuda imports the GPU kernels (and so triton) when it is collected; a run that does
    not select the `cuda` marker does not collect it, so the TRITON_INTERPRET=1 tests of
    tests/exec/gpu still find triton unimported and run interpreted."""
    if collection_path.name != "cuda" or collection_path.parent.name != "tests":
        return None
    expr = (config.getoption("markexpr") or "").replace(" ", "")
    selected = "cuda" in expr and "notcuda" not in expr
    return None if selected else True
