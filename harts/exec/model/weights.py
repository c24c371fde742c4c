"""Weights in a file: `torch.save` of a flat {name: tensor} dict, loaded with checks.

Loading is strict: every missing, unexpected or mis-shaped key is an error that names the
keys, so a checkpoint for another config never half-loads. Values are cast to each
parameter's dtype and device; `torch.load(weights_only=True)` never runs pickled code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class WeightLoadError(ValueError):
    """A weights file that does not fit the model; the message lists the offending keys."""


def save_state_dict_file(model: nn.Module, path: str | Path) -> None:
    state = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    torch.save(state, Path(path))


def _listing(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def load_state_dict_file(model: nn.Module, path: str | Path) -> None:
    path = Path(path)
    if not path.is_file():
        raise WeightLoadError(f"{path}: no such weights file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the user's input error
        raise WeightLoadError(f"{path}: not a torch.save weights file ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise WeightLoadError(f"{path}: expected a dict of parameter name -> tensor")
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    misshaped = sorted(
        f"{k} (file {tuple(state[k].shape)}, model {tuple(own[k].shape)})"
        for k in set(own) & set(state)
        if state[k].shape != own[k].shape
    )
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected: {_listing(unexpected)}")
    if misshaped:
        problems.append(f"{len(misshaped)} mis-shaped: {_listing(misshaped)}")
    if problems:
        raise WeightLoadError(f"{path}: weights do not fit the model; " + "; ".join(problems))
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise WeightLoadError(f"{path}: non-finite values in {_listing(sorted(bad))}")
    with torch.no_grad():
        for name, target in own.items():
            target.copy_(state[name].to(dtype=target.dtype))
