"""Real-model shapes on the GPU: `harts bench --model-path` on checkpoints with the released
models' layer shapes and a few layers, and the chunked LM head's peak memory.

    python3 benchmarks/gpu/checkpoints.py [--families kimi_linear qwen3_next] [--layers 4]
        [--skip-lm-head] [--lm-head-rows 131072] --out DIR

Per family, a checkpoint directory is written (random weights from HARTS's initialiser,
bf16) whose config.json is transformers' own config class at its defaults, which are the
released model's (Kimi-Linear-48B-A3B; Qwen3-Next-80B-A3B), with `num_hidden_layers`
cut to `--layers` and the layer pattern cut to match (Kimi: layer 1 dense, KDA, KDA,
MLA; Qwen3-Next: three Gated DeltaNet and one gated attention layer). The cut configs are
stored in benchmarks/gpu/configs/ (`--dump-configs` rewrites them). Then
`python3 -m harts bench --model-path DIR --schemes treestep --baseline packed --out
DIR/bench.json` runs in its own process and its runs (tree vs packed expanded speedup,
the ideal it reports) are collected.

LM head: hidden rows [rows, d_model] and a head [vocab, d_model] in bf16 (Kimi's 2304 x
163,840 by default), the log-probs of one label per row, forward and backward, once
chunked (`PolicyLossConfig`'s default chunk budget, `lm_head_chunk_rows`) and once
unchunked (one [rows, vocab] log-softmax); peak allocated memory above the inputs and
seconds for each, an out-of-memory recorded as such.

Writes DIR/checkpoints.json with provenance (git revision, command, versions, GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from harts.bench.provenance import provenance


def hf_config(family: str, layers: int) -> dict:
    """transformers' config of the released model, cut to `layers` layers."""
    if family == "kimi_linear":
        from transformers import KimiLinearConfig

        d = KimiLinearConfig().to_dict()
        kinds = ["linear_attention"] * (layers - 1) + ["full_attention"]
        d.update(num_hidden_layers=layers, layer_types=kinds,
                 mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
        lac = d.get("linear_attn_config")
        if isinstance(lac, dict):  # older transformers name the layer kinds here (1-based)
            lac.update(kda_layers=[i + 1 for i in range(layers - 1)], full_attn_layers=[layers])
        d["model_type"] = "kimi_linear"
        return d
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig

        d = Qwen3NextConfig().to_dict()
        d.update(num_hidden_layers=layers,
                 layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)])
        d["model_type"] = "qwen3_next"
        return d
    raise ValueError(f"unknown family {family!r}")


CONFIGS = Path(__file__).resolve().parent / "configs"


def stored_config(family: str, layers: int) -> dict:
    """The cut config as stored beside this script (written by `--dump-configs` with the
    transformers of the development machine), so that the device's transformers version
    does not change the shapes; `hf_config` where none is stored."""
    f = CONFIGS / f"{family}-{layers}l.json"
    return json.loads(f.read_text()) if f.is_file() else hf_config(family, layers)


def write_random_checkpoint(family: str, layers: int, out: Path) -> dict:
    from harts.exec.model.model import build_model
    from harts.models.hf import get_adapter
    from harts.models.hf.io import write_checkpoint

    hf = stored_config(family, layers)
    adapter = get_adapter(hf["model_type"])
    cfg = adapter.to_config(hf)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net = build_model(cfg, seed=0, dtype=torch.bfloat16, device=device)
    state = {k: v.detach() for k, v in net.state_dict().items()}
    tensors = {k: v.to("cpu").contiguous() for k, v in adapter.to_hf(state, cfg, hf).items()}
    params = sum(p.numel() for p in net.parameters())
    del net, state
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    write_checkpoint(out, hf, tensors)
    return {"family": family, "layers": layers, "path": str(out), "parameters": int(params),
            "layer_kinds": [k.value for k in cfg.layer_kinds], "seconds_to_write": time.perf_counter() - t0}


def lm_head_case(rows: int, vocab: int, d_model: int, chunked: bool) -> dict:
    from harts.exec.loss import PolicyLossConfig, lm_head_chunk_rows, target_logprobs

    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(rows, d_model, device="cuda", generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    head = (torch.randn(vocab, d_model, device="cuda", generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    row = torch.arange(rows, device="cuda")
    label = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    chunk = lm_head_chunk_rows(rows, vocab, PolicyLossConfig().lm_head_chunk_elements) if chunked else None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = {"rows": rows, "vocab": vocab, "d_model": d_model, "chunked": chunked, "chunk_rows": chunk}
    try:
        t0 = time.perf_counter()
        lp, _ = target_logprobs(hidden, head, row, label, unique=(row, row), chunk_rows=chunk)
        lp.float().sum().backward()
        torch.cuda.synchronize()
        out.update(seconds=time.perf_counter() - t0, peak_above_inputs_bytes=int(torch.cuda.max_memory_allocated() - base))
    except torch.OutOfMemoryError as err:
        out.update(out_of_memory=True, peak_above_inputs_bytes=int(torch.cuda.max_memory_allocated() - base),
                   error=str(err).splitlines()[0][:300])
    del hidden, head, row, label
    torch.cuda.empty_cache()
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="*", default=["kimi_linear", "qwen3_next"],
                    help="checkpoint families to write and bench (none: the LM head alone)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ckpt-root", default="/tmp/harts-ckpt", help="where the checkpoint directories go")
    ap.add_argument("--skip-lm-head", action="store_true")
    ap.add_argument("--lm-head-rows", type=int, default=131072)
    ap.add_argument("--lm-head-vocab", type=int, default=163840)
    ap.add_argument("--lm-head-dim", type=int, default=2304)
    ap.add_argument("--bench-args", default="--schemes treestep --baseline packed --steps 2",
                    help="arguments for harts bench (one string)")
    ap.add_argument("--write-only", action="store_true", help="write the checkpoints, run no benchmark")
    ap.add_argument("--no-autotune", action="store_true", help="each Triton kernel's first config that fits (noautotune.py)")
    ap.add_argument("--keep", action="store_true", help="keep each checkpoint directory after its benchmark")
    ap.add_argument("--dump-configs", action="store_true",
                    help=f"write the cut configs from this transformers into {CONFIGS} and stop")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if args.dump_configs:
        CONFIGS.mkdir(exist_ok=True)
        for fam in args.families:
            d = hf_config(fam, args.layers)
            (CONFIGS / f"{fam}-{args.layers}l.json").write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(args.ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    result = {"provenance": provenance([sys.argv[0], *argv]), "checkpoints": {}, "lm_head": []}

    def save():
        (out_dir / "checkpoints.json").write_text(json.dumps(result, indent=1, default=str))

    if not args.skip_lm_head and torch.cuda.is_available():
        for chunked in (True, False):
            r = lm_head_case(args.lm_head_rows, args.lm_head_vocab, args.lm_head_dim, chunked)
            result["lm_head"].append(r)
            print(f"[lm head {'chunked' if chunked else 'unchunked'}] {args.lm_head_rows} x {args.lm_head_vocab}: "
                  + ("out of memory" if r.get("out_of_memory") else f"{r['seconds']:.2f}s")
                  + f", peak +{r['peak_above_inputs_bytes']/2**30:.1f} GiB", flush=True)
            save()
    for fam in args.families:
        entry = result["checkpoints"].setdefault(fam, {})
        path = root / f"{fam}-{args.layers}l"
        try:
            entry.update(write_random_checkpoint(fam, args.layers, path))
            print(f"[{fam}] wrote {path}: {entry['parameters']/1e9:.2f}B parameters, "
                  f"{entry['seconds_to_write']:.0f}s", flush=True)
            if args.write_only:
                continue
            bench_json = out_dir / f"bench-{fam}.json"
            runner = [str(Path(__file__).resolve().parent / "noautotune.py")] if args.no_autotune else ["-m", "harts"]
            cmd = [sys.executable, *runner, "bench", "--model-path", str(path), *args.bench_args.split(),
                   "--out", str(bench_json)]
            entry["bench_command"] = " ".join(cmd[1:])
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
            entry["bench_seconds"] = time.perf_counter() - t0
            entry["bench_rc"] = proc.returncode
            print(proc.stdout[-4000:], proc.stderr[-3000:], sep="\n", flush=True)
            if bench_json.is_file():
                entry["bench"] = json.loads(bench_json.read_text())
            if not args.keep:
                shutil.rmtree(path, ignore_errors=True)  # tens of GB each
        except Exception as err:  # noqa: BLE001 - record and go on with the next family
            entry["error"] = f"{type(err).__name__}: {err}"
            entry["trace"] = traceback.format_exc()[-3000:]
            print(f"[{fam}] ERROR {entry['error']}", flush=True)
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
