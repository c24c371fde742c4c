"""Checkpoint directories on disk: `config.json` plus safetensors weights, read and written.

Reading takes `model.safetensors`, or the shards a `model.safetensors.index.json` lists.
A pickle checkpoint (`pytorch_model.bin`) is refused unless the caller opts in with
`allow_pickle=True`, and is then read with `torch.load(weights_only=True)`: unpickling an
untrusted file can run code. Every problem is one `CheckpointError` line naming the file
(and the tensor where there is one): a missing config or shard, unreadable or truncated
safetensors, a tensor listed in the index but absent from its shard, a tensor stored twice.

Writing puts safetensors files (one, or shards of at most `shard_bytes` with an index)
and the given `config.json` into a temporary directory beside the target, then renames
it into place; a failure removes the temporary directory, so nothing half-written is
left. An existing target is replaced only when it is a checkpoint directory itself (it
holds a config.json) or empty.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3
# files of a checkpoint directory that hold weights or the config (written anew on save);
# anything else (tokenizer, generation_config.json, ...) is copied along
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or written; one line naming the file.
    `path`: that file (or directory), where there is one (the CLI reports it as `file`)."""

    def __init__(self, message: str, path: str | os.PathLike[str] | None = None):
        super().__init__(message)
        self.path = None if path is None else os.fspath(path)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory's contents: its config.json, its tensors by name and the
    file each came from."""

    path: Path
    hf_config: dict
    tensors: dict[str, Tensor]
    files: dict[str, str]  # tensor name -> file name within `path`
    weights: str  # the file that lists the weights: model.safetensors, or the index


def read_config(path: str | os.PathLike[str]) -> dict:
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory (config.json + safetensors)", path=root)
    cfg = root / CONFIG
    if not cfg.is_file():
        raise CheckpointError(f"{cfg}: missing (a checkpoint directory needs its config.json)", path=cfg)
    try:
        hf = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{cfg}: not readable JSON ({err})", path=cfg) from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{cfg}: must hold a JSON object", path=cfg)
    return hf


def _read_safetensors(file: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    if not file.is_file():
        raise CheckpointError(f"{file}: missing", path=file)
    try:
        out = {}
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has keys(), no iteration
                out[name] = fh.get_tensor(name)
        return out
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any unreadable file is the user's input error
        detail = " ".join(str(err).split()) or type(err).__name__
        raise CheckpointError(f"{file}: not a readable safetensors file, truncated or corrupt ({detail})", path=file) from None


def _read_pickle(file: Path) -> dict[str, Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"{file}: not a readable torch weights file ({type(err).__name__}: "
                              f"{' '.join(str(err).split())[:200]})", path=file) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise CheckpointError(f"{file}: expected a dict of tensor name -> tensor", path=file)
    return state


def _read_index(root: Path, index_name: str, reader) -> tuple[dict[str, Tensor], dict[str, str]]:
    index = root / index_name
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index}: not a readable index with a 'weight_map' ({err})", path=index) from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names", path=index)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if Path(shard).name != shard:
            raise CheckpointError(f"{index}: tensor {name!r} points outside the directory ({shard!r})", path=index)
        by_shard.setdefault(shard, []).append(name)
    tensors: dict[str, Tensor] = {}
    files: dict[str, str] = {}
    for shard, names in by_shard.items():
        if not (root / shard).is_file():
            raise CheckpointError(f"{root / shard}: missing shard (the index lists tensor {names[0]!r} in it)", path=root / shard)
        got = reader(root / shard)
        for name in names:
            if name not in got:
                raise CheckpointError(f"{root / shard}: tensor {name!r} is missing (the index lists it here)", path=root / shard)
        for name, t in got.items():
            if weight_map.get(name) != shard:
                raise CheckpointError(f"{root / shard}: tensor {name!r} is not listed for this file in {index_name}", path=root / shard)
            tensors[name] = t
            files[name] = shard
    return tensors, files


def read_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> Checkpoint:
    root = Path(path)
    hf = read_config(root)
    if (root / INDEX).is_file():
        tensors, files = _read_index(root, INDEX, _read_safetensors)
        weights = INDEX
    elif (root / SAFETENSORS).is_file():
        tensors = _read_safetensors(root / SAFETENSORS)
        files = dict.fromkeys(tensors, SAFETENSORS)
        weights = SAFETENSORS
    elif (root / PICKLE).is_file() or (root / PICKLE_INDEX).is_file():
        name = PICKLE if (root / PICKLE).is_file() else PICKLE_INDEX
        if not allow_pickle:
            raise CheckpointError(f"{root / name}: a pickle checkpoint; unpickling an untrusted file can run code. "
                                  "Convert it to safetensors, or opt in with allow_pickle=True (--allow-pickle)", path=root / name)
        if name == PICKLE:
            tensors = _read_pickle(root / PICKLE)
            files = dict.fromkeys(tensors, PICKLE)
        else:
            tensors, files = _read_index(root, PICKLE_INDEX, _read_pickle)
        weights = name
    else:
        raise CheckpointError(f"{root}: no {SAFETENSORS} or {INDEX} (weights) in the checkpoint directory", path=root)
    return Checkpoint(root, hf, tensors, files, weights)


def _save_file(tensors: dict[str, Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def write_checkpoint(out_dir: str | os.PathLike[str], hf_config: dict, tensors: dict[str, Tensor], *,
                     shard_bytes: int = DEFAULT_SHARD_BYTES, copy_from: str | os.PathLike[str] | None = None) -> Path:
    """Write `tensors` (names sorted) and `hf_config` as a checkpoint directory at `out_dir`
    (atomically, see the module docstring). `copy_from`: a source checkpoint directory whose
    other files (tokenizer, generation config) are copied along."""
    target = Path(out_dir)
    parent = target.parent
    if not parent.is_dir():
        raise CheckpointError(f"{target}: folder {parent} does not exist (create it first)", path=target)
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target}: exists and is not a directory", path=target)
    if target.is_dir() and any(target.iterdir()) and not (target / CONFIG).is_file():
        raise CheckpointError(f"{target}: exists, is not empty and is not a checkpoint directory; not replacing it", path=target)
    if shard_bytes < 1:
        raise CheckpointError(f"shard size must be >= 1 byte, got {shard_bytes}")
    try:
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{target.name}.", suffix=".tmp"))
    except OSError as err:
        raise CheckpointError(f"{target}: cannot write there ({err.strerror})", path=target) from None
    try:
        names = sorted(tensors)
        shards: list[list[str]] = [[]]
        size = 0
        for name in names:
            n = tensors[name].numel() * tensors[name].element_size()
            if shards[-1] and size + n > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += n
        if len(shards) == 1:
            _save_file({k: tensors[k] for k in names}, tmp / SAFETENSORS)
        else:
            weight_map = {}
            for i, group in enumerate(shards, start=1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                _save_file({k: tensors[k] for k in group}, tmp / file)
                weight_map |= dict.fromkeys(group, file)
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n", encoding="utf-8")
        (tmp / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        if copy_from is not None:
            src = Path(copy_from)
            for f in sorted(src.iterdir()) if src.is_dir() else []:
                if f.is_file() and f.name not in (CONFIG, INDEX, PICKLE_INDEX) and not f.name.endswith(_WEIGHT_SUFFIXES):
                    shutil.copy2(f, tmp / f.name)
        for f in tmp.iterdir():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o777 & ~_umask())
        if target.is_dir():
            old = Path(tempfile.mkdtemp(dir=parent, prefix=f".{target.name}.", suffix=".old"))
            os.replace(target, old / "x")
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{target}: cannot write ({err.strerror or err})", path=target) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
