"""`harts verify`: tree vs expanded on the same inputs, with the no-replay ablation.

The step check ends with a verdict: the tree step passes when its worst relative log-prob
error and its worst relative gradient error (and, with a planner, the worst gradient error
against the same step as one microbatch) are within the tolerance, `--tolerance` or the
dtype's default (`DEFAULT_TOLERANCE`); the exit code is 0 on a pass and 1 on a fail, so a
script can gate on it.
"""

from __future__ import annotations

import argparse

from harts.cli.common import (
    UserError,
    add_attention_args,
    format_table,
    kernel_config,
    print_json,
)
from harts.cli.data import check_vocab, load_trajectories
from harts.cli.model_source import add_model_args, load_checkpoint, model_config

# relative tolerances of the verdict by dtype: float64 is equality up to summation order;
# float32 bounds rounding differences (about 25x the errors of the tiny configs on CPU; on
# a GPU kernels round differently: set --tolerance for a gate). bfloat16 has no default:
# its errors are read against the baseline's own rerun and repacking, and the worst
# parameter's relative gradient error reaches 0.3 on tiny-treestep; --tolerance gives a gate.
DEFAULT_TOLERANCE = {"float64": 1e-10, "float32": 1e-3}

_EPILOG = ("exit code: 0 when the tree step equals the expanded one within the tolerance (the last line says PASS), "
           "1 when it does not (FAIL), 2 for bad input or options. bfloat16 without --tolerance, --divergence "
           "and --fidelity are reports without a verdict: exit code 0.")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a tree step against the trajectory-expanded reference",
                       description="Run one training step in tree and in expanded mode from the same weights and "
                       "compare log-probs, losses and every gradient.", epilog=_EPILOG)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--input", metavar="FILE.jsonl", help="rollout JSONL file")
    src.add_argument("--workload", metavar="PRESET", help="generated workload preset (default tiny-treestep)")
    add_model_args(p, "tiny-cpu", "model config (CPU-sized)")
    p.add_argument("--dtype", choices=["float64", "float32", "bfloat16"], default=None,
                   help="float64 (default), float32 or bfloat16 (then also the baseline against a rerun "
                   "and a repacking of itself; the default of --divergence and --fidelity)")
    p.add_argument("--divergence", metavar="A:B", nargs="?", const="expanded:replay", default=None,
                   help="instead: where run B's bits part from run A's, op by op (modes expanded, replay, "
                   "node; default expanded:replay), one forward over whole trees per microbatch")
    p.add_argument("--fidelity", action="store_true",
                   help="instead: the bf16 fidelity report (Table 7 / Figure 5 analogues): full-vocabulary "
                   "logit cosine, symmetric KL, target-NLL and loss differences of tree replay, no replay, "
                   "a baseline rerun and a repacked baseline, each against the expanded baseline, by fork depth")
    p.add_argument("--device", default="cpu", help="where to run (cpu, cuda)")
    p.add_argument("--norm-float32", action="store_true",
                   help="with --divergence: the model's RMSNorms in float32 inside (ModelConfig.norm_float32)")
    p.add_argument("--seed", type=int, default=0, help="model init (and workload) seed")
    p.add_argument("--microbatch-tokens", type=int, default=1 << 20,
                   help="token budget per microbatch")
    p.add_argument("--planner", default=None, metavar="NAME",
                   help="execute this step planner's plan (trees split across microbatches, sharing "
                   "windows); default: whole trees per microbatch")
    p.add_argument("--old-logprobs", choices=["recompute", "input"], default="recompute",
                   help="recompute: on-policy ratios of 1 (every target carries gradient)")
    p.add_argument("--tolerance", type=float, default=None, metavar="REL",
                   help="relative tolerance of the verdict (default by dtype: "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TOLERANCE.items()) + "; bfloat16: none)")
    p.add_argument("--parallel", default=None, metavar="SPEC",
                   help="instead: the distributed step (dp=N,pp=N,ep=N,tp=N; worker processes started here, "
                   "gloo on CPU, NCCL with --device cuda) against the single-process expanded step")
    p.add_argument("--schedule", default="consumer-1f1b", choices=["non-overlap", "overlap-bwd-first", "consumer-1f1b"],
                   help="with --parallel pp>1: the pipeline schedule (the simulator's, lowered to the pipelining runtime)")
    p.add_argument("--json", action="store_true", help="machine-readable output (with 'passed' and 'tolerance')")
    add_attention_args(p)  # with --divergence --device cuda
    p.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    trajectories = load_trajectories(args)
    check_vocab(trajectories, model_config(args))
    if args.microbatch_tokens < 1:
        raise UserError("--microbatch-tokens must be >= 1")
    if args.tolerance is not None and not args.tolerance >= 0:
        raise UserError(f"--tolerance must be >= 0, got {args.tolerance}", field="--tolerance")
    import torch

    if args.divergence is not None and args.fidelity:
        raise UserError("--divergence and --fidelity are separate reports: pick one")
    if args.model_path and (args.divergence is not None or args.fidelity):
        raise UserError("--model-path runs the step check; --divergence and --fidelity take --model", field="--model-path")
    if args.divergence is not None:
        return cmd_divergence(args, trajectories)
    if args.parallel is not None:
        return cmd_parallel(args, trajectories)
    if args.fidelity:
        return cmd_fidelity(args, trajectories)
    if args.norm_float32:
        raise UserError("--norm-float32 is for --divergence")
    if (args.tree_attention or args.baseline_attention) and args.device == "cpu":
        # on the CPU every op runs its reference: the switches would be silently ignored
        raise UserError("the attention switches pick CUDA kernels: add --device cuda (or use --divergence / --fidelity)")
    from harts.verify.equivalence import verify_step

    dtype = _device_and_dtype(args, "", default=torch.float64)
    kernels = kernel_config(args)
    if args.planner is not None:
        from harts.plan.planners import known_planners

        if args.planner not in known_planners():
            raise UserError(f"unknown planner {args.planner!r}; known: {', '.join(known_planners())}")
    model = args.model if not args.model_path else load_checkpoint(args, dtype, args.device).model
    try:
        report = verify_step(trajectories, model=model, dtype=dtype, seed=args.seed,
                             microbatch_tokens=args.microbatch_tokens, planner=args.planner,
                             recompute_old_logprobs=args.old_logprobs == "recompute", device=args.device,
                             baseline_variation=dtype == torch.bfloat16, kernels=kernels)
    except ValueError as err:
        # planners refuse budgets that a trajectory does not fit, with advice
        raise UserError(str(err)) from None
    tolerance = DEFAULT_TOLERANCE.get(report["dtype"]) if args.tolerance is None else args.tolerance
    passed, verdict = _verdict(report, tolerance)
    report.update(tolerance=tolerance, passed=passed, verdict=verdict)
    report["kernels"] = kernels.to_dict()
    if args.json:
        print_json(report)
        return 0 if passed is not False else 1
    print(f"{report['num_trajectories']} trajectories, {report['num_targets']} targets, "
          f"{report['expanded_tokens']} expanded -> {report['compact_tokens']} compact tokens, "
          f"{report['microbatches']} microbatch(es), {report['sharing_windows']} sharing window(s), "
          f"{report['dtype']} on {args.device}" + (f", planner {report['planner']}" if report["planner"] else ""))
    nr = report["no_replay"]
    # in bf16, the baseline against itself (rerun; repacked) is the scale to read the tree against
    extra = [(label, report[key]) for label, key in (("baseline rerun", "expanded_rerun"),
                                                     ("baseline repacked", "expanded_repacked"))
             if key in report]
    blank = lambda r, key: "-" if r is None else r[key]  # noqa: E731
    linear = report.get("linear_attention") or "linear-attention"  # the rows' layer kind: KDA, GDN
    rows = [
        (f"{linear} rounds (most in a microbatch)", report["rounds"], nr["rounds"], *("-" for _ in extra)),
        ("replay tokens", report["replay_tokens"], nr["replay_tokens"], *("-" for _ in extra)),
    ]
    for key in ("max_rel_logprob_err", "rms_rel_logprob_err", "max_rel_entropy_err", "max_rel_grad_err",
                "rms_rel_grad_err", "max_rel_expert_load_err"):
        rows.append((key.replace("_", " "), report[key], nr[key], *(blank(r, key) for _, r in extra)))
    rows.append(("loss abs err", report["loss_abs_err"]["loss"], nr["loss_abs_err"]["loss"],
                 *("-" if r is None else r["loss_abs_err"]["loss"] for _, r in extra)))
    kda = report["kda_layer"]
    checked = report.get("kda_layer_kind") or linear  # the first linear-attention layer's kind
    if kda:
        rows.append((f"{checked} layer bit-identical", str(kda["replay"]["bit_identical"]), str(kda["node"]["bit_identical"]),
                     *("-" for _ in extra)))
        rows.append((f"{checked} layer max abs err", kda["replay"]["max_abs_err"], kda["node"]["max_abs_err"],
                     *("-" for _ in extra)))
    print(format_table(["vs expanded", "tree (replay)", "no replay", *(label for label, _ in extra)], rows))
    if any(r is None for _, r in extra):
        print("baseline repacked: not run (the MoE aux loss is per microbatch here, so repacking changes it; "
              "a --planner runs the global scope)")
    print(verdict)
    return 0 if passed is not False else 1


def _verdict(report: dict, tolerance: float | None) -> tuple[bool | None, str]:
    """(passed, the verdict line): every checked error <= `tolerance` (NaN fails); without
    a tolerance (bfloat16's default) passed is None and the line says so."""
    checks = [("max_rel_logprob_err", report["max_rel_logprob_err"]),
              ("max_rel_grad_err", report["max_rel_grad_err"])]
    one = report.get("vs_single_microbatch")
    if one is not None:
        checks.append(("max_rel_grad_err vs one microbatch", one["max_rel_grad_err"]))
    values = ", ".join(f"{name} {value:.3g}" for name, value in checks)
    if tolerance is None:
        return None, (f"NO VERDICT: {report['dtype']} has no default tolerance (give --tolerance); read the "
                      f"tree against the baseline's own rerun/repacking ({values})")
    passed = all(value <= tolerance for _, value in checks)
    word = "PASS" if passed else "FAIL"
    relation = "within" if passed else "NOT within"
    return passed, f"{word}: tree == expanded {relation} {tolerance:g} relative ({values})"


def _device_and_dtype(args: argparse.Namespace, flag: str, default=None):
    """The run's dtype (`default`, else bf16) after checking --device; `flag` (the
    report's) refuses --planner, "" accepts it."""
    import torch

    if flag and args.planner is not None:
        raise UserError(f"{flag} runs whole trees per microbatch; --planner does not apply")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        raise UserError(f"--device must be cpu or cuda[:N]; got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here")
    return {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
            None: default or torch.bfloat16}[args.dtype]


def cmd_fidelity(args: argparse.Namespace, trajectories: list) -> int:
    """`harts verify --fidelity`: `harts.verify.fidelity.fidelity` as a table or JSON."""
    import dataclasses

    from harts.config.models import get_model_config
    from harts.verify.fidelity import fidelity

    dtype = _device_and_dtype(args, "--fidelity")
    kernels = kernel_config(args)
    cfg = get_model_config(args.model)
    if args.norm_float32:
        cfg = dataclasses.replace(cfg, norm_float32=True)
    report = fidelity(trajectories, model=cfg, dtype=dtype, device=args.device, seed=args.seed,
                      microbatch_tokens=args.microbatch_tokens, kernels=kernels)
    report.update(device=args.device, kernels=kernels.to_dict())
    if args.json:
        print_json(report)
        return 0
    print(f"{report['trajectories']} trajectories, {report['model']}, {report['dtype']} on {args.device}; "
          "each run against the expanded baseline (logits of every target, full vocabulary)")
    names = (("baseline rerun", "expanded_rerun"), ("baseline repacked", "expanded_repacked"),
             ("tree (replay)", "tree_replay"), ("no replay", "tree_no_replay"))
    rows = []
    for label, key in names:
        r = report[f"{key}_vs_expanded"]
        rows.append((label, f"{r['cosine']:.8f}", f"{r['cosine_min']:.8f}", r["sym_kl"], r["nll_diff_mean"],
                     r["nll_diff_max"], r["loss_diff"]))
    print(format_table(["run", "cosine", "min cosine", "sym KL", "NLL diff", "max NLL diff", "loss diff"], rows))
    depths = sorted({d for _, key in names[2:] for d in report[f"{key}_vs_expanded"]["by_handoff_depth"]}, key=int)
    rows = []
    for d in depths:
        row = [d]
        for _, key in names[2:]:
            r = report[f"{key}_vs_expanded"]["by_handoff_depth"].get(d, {})
            row += [r.get("positions", 0), f"{r.get('cosine', float('nan')):.8f}", r.get("sym_kl", float("nan"))]
        rows.append(row[:2] + row[2:4] + row[5:7])
    print(format_table(["fork depth", "positions", "replay cosine", "replay sym KL", "no-replay cosine",
                        "no-replay sym KL"], rows))
    return 0


def cmd_divergence(args: argparse.Namespace, trajectories: list) -> int:
    """`harts verify --divergence A:B`: `harts.verify.divergence.compare_runs`."""

    from harts.config.models import get_model_config
    from harts.exec.model.model import build_model
    from harts.plan.partition import tree_partition
    from harts.verify.divergence import MODES, compare_runs
    from harts.verify.divergence import format_table as divergence_table

    modes = args.divergence.split(":")
    if len(modes) != 2 or any(m not in MODES for m in modes):
        raise UserError(f"--divergence takes A:B with A and B among {', '.join(MODES)}; got {args.divergence!r}")
    dtype = _device_and_dtype(args, "--divergence")
    kernels = kernel_config(args)
    cfg = get_model_config(args.model)
    if args.norm_float32:
        import dataclasses

        cfg = dataclasses.replace(cfg, norm_float32=True)
    net = build_model(cfg, seed=args.seed, dtype=dtype, device=args.device)
    partition = tree_partition(trajectories, args.microbatch_tokens)
    report = compare_runs(net, trajectories, partition, modes[0], modes[1], kernels=kernels)
    report.update(model=args.model, dtype=str(dtype).removeprefix("torch."), device=args.device,
                  kernels=kernels.to_dict())
    if args.json:
        print_json(report)
    else:
        print(divergence_table(report))
    return 0



def cmd_parallel(args: argparse.Namespace, trajectories: list) -> int:
    """`harts verify --parallel SPEC`: `harts.verify.distributed.verify_distributed`, with
    the step check's verdict; launch errors are one line, exit code 2, before any worker starts."""
    import torch

    from harts.distributed.mesh import LaunchError, parse_parallel

    if args.fidelity:
        raise UserError("--parallel and --fidelity are separate reports: pick one")
    dtype = _device_and_dtype(args, "", default=torch.float64)
    try:
        parallel = parse_parallel(args.parallel)
        config = model_config(args)  # --model, or --model-path's config.json
    except LaunchError as err:
        raise UserError(str(err)) from None
    model = config
    if getattr(args, "model_path", None):  # the checkpoint's weights, read once here
        model = load_checkpoint(args, dtype, "cpu").model
    from harts.verify.distributed import verify_distributed

    try:
        report = verify_distributed(trajectories, parallel=parallel, model=model, dtype=dtype, seed=args.seed,
                                    microbatch_tokens=args.microbatch_tokens, planner=args.planner or "l1l2",
                                    device=args.device, recompute_old_logprobs=args.old_logprobs == "recompute",
                                    kernels=kernel_config(args), schedule=args.schedule)
    except ValueError as err:  # LaunchError included; planners refusing a budget
        raise UserError(str(err)) from None
    tolerance = DEFAULT_TOLERANCE.get(report["dtype"]) if args.tolerance is None else args.tolerance
    passed, verdict = _verdict(report, tolerance)
    verdict = verdict.replace("tree == expanded", f"distributed ({report['parallel']}) == expanded")
    report.update(tolerance=tolerance, passed=passed, verdict=verdict)
    if args.json:
        print_json(report)
    else:
        print(f"{report['num_trajectories']} trajectories, {report['microbatches']} microbatch(es), "
              f"{report['sharing_windows']} sharing window(s), world size {report['world_size']} "
              f"({report['parallel']}, applied: {', '.join(report['applied']) or 'none'}), {report['dtype']} on "
              f"{args.device}" + (f", schedule {report['schedule']} (executed == simulated: "
                                  f"{report['executed_is_simulated']})" if "schedule" in report else ""))
        rows = [(k.replace("_", " "), report[k]) for k in ("max_rel_logprob_err", "rms_rel_logprob_err",
                "max_rel_entropy_err", "max_rel_grad_err", "rms_rel_grad_err", "max_rel_expert_load_err")]
        rows.append(("loss abs err", report["loss_abs_err"]["loss"]))
        print(format_table(["vs expanded", "distributed"], rows))
        print(verdict)
    return 0 if passed is not False else 1
