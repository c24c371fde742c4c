"""The one module of harts that reads or writes process environment variables.

Everything else takes its settings as arguments. The variables below are an optional way
to build the default configuration (`KernelConfig.from_env`, read once when a config is
built, never per call), plus the two mlflow variables the tracking code needs and the
revision a result's provenance names when the tree is a copy without its own git.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# kernel selection (harts.config.kernels.KernelConfig fields they build)
FORCE_REFERENCE = "HARTS_FORCE_REFERENCE"  # force_reference: "1"/"true" runs the references everywhere
TREE_ATTENTION = "HARTS_TREE_ATTENTION"  # tree_attention: graph | cudnn | varlen | flex ("" = auto)
BASELINE_ATTENTION = "HARTS_BASELINE_ATTENTION"  # baseline_attention: cudnn | flash | graph ("" = cudnn)
CONV = "HARTS_CONV"  # conv: triton | reference ("" = auto)
CONV_BWD_TILES = "HARTS_CONV_BWD_TILES"  # conv_bwd_tiles: "BD,BT_g,NSUB,warps_g,BT_dx,warps_dx"
FWD_H = "HARTS_FWD_H"  # kda_fwd_h: "fla" | "BV,warps,stages" ("" = auto)
KERNEL_VARIABLES = (FORCE_REFERENCE, TREE_ATTENTION, BASELINE_ATTENTION, CONV, CONV_BWD_TILES, FWD_H)

TRACKING_URI = "MLFLOW_TRACKING_URI"
SUPPRESS_URL_PRINTING = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


def kernel_settings() -> dict[str, str]:
    """The kernel-selection variables that are set to something other than blanks,
    stripped, keyed by variable name."""
    out = {}
    for name in KERNEL_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            out[name] = value
    return out


# a result's git revision where the tree's git metadata is absent or not its own (a copy
# on another machine): harts.exec.bench.provenance
GIT_REV = "HARTS_GIT_REV"


def git_revision_override() -> str | None:
    """$HARTS_GIT_REV, or None where unset or empty."""
    return os.environ.get(GIT_REV) or None


def tracking_uri() -> str | None:
    """$MLFLOW_TRACKING_URI, or None where unset or empty."""
    return os.environ.get(TRACKING_URI) or None


@contextlib.contextmanager
def mlflow_url_printing_suppressed() -> Iterator[None]:
    """Set MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=true for the block, then restore it."""
    saved = os.environ.get(SUPPRESS_URL_PRINTING)
    os.environ[SUPPRESS_URL_PRINTING] = "true"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(SUPPRESS_URL_PRINTING, None)
        else:
            os.environ[SUPPRESS_URL_PRINTING] = saved
