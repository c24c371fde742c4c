"""`harts model ...`: registered model configs and their analytic parameter counts."""

from __future__ import annotations

import argparse

from harts.cli.common import UserError, format_table, print_json
from harts.cli.model_source import add_model_args, model_config


def register(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="model configurations")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    params = model_sub.add_parser(
        "params", help="total / active parameter counts of each config, next to the paper's Table 1"
    )
    add_model_args(params, None, "one config (default: all)")
    params.add_argument("--json", action="store_true", help="machine-readable output")
    params.set_defaults(func=cmd_params)


def cmd_params(args: argparse.Namespace) -> int:
    from harts.config.models import (
        TABLE1_PARAMS_B,
        ConfigError,
        ModelName,
        get_model_config,
        known_models,
        layer_ratio,
    )
    from harts.config.param_counts import parameter_counts

    if args.model_path:  # one checkpoint directory's config.json
        configs = [model_config(args)]
    else:
        try:
            configs = [get_model_config(n) for n in (known_models() if args.model is None else [args.model])]
        except ConfigError as err:
            raise UserError(str(err)) from None
    records = []
    for config in configs:
        name = config.name
        counts = parameter_counts(config)
        paper = TABLE1_PARAMS_B.get(ModelName(name)) if name in set(known_models()) else None
        records.append({
            "model": name,
            "total": counts.total,
            "active": counts.active,
            "table1_total": None if paper is None else int(paper[0] * 1e9),
            "table1_active": None if paper is None else int(paper[1] * 1e9),
            "layers": config.num_layers,
            "layer_ratio": layer_ratio(config),  # by the model's own kinds: "KDA:MLA 3:1", "GDN:attn 3:1"
            "layer_kinds": {k.value: n for k in dict.fromkeys(config.layer_kinds)
                            if (n := config.num_layers_of(k))},
            "experts_topk": f"{config.num_experts}/{config.top_k}",
            "by_component": counts.by_component,
        })
    if args.json:
        print_json(records)
        return 0

    def billions(n: int | None) -> str:
        if n is None:
            return "-"
        return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"

    def diff(ours: int, paper: int | None) -> str:
        return "-" if paper is None else f"{100 * (ours / paper - 1):+.1f}%"

    rows = [
        (r["model"], r["layers"], r["layer_ratio"], r["experts_topk"],
         billions(r["total"]), billions(r["table1_total"]), diff(r["total"], r["table1_total"]),
         billions(r["active"]), billions(r["table1_active"]), diff(r["active"], r["table1_active"]))
        for r in records
    ]
    headers = ["model", "layers", "layer kinds", "experts/top-k", "total", "Table 1", "diff",
               "active", "Table 1", "diff"]
    print(format_table(headers, rows))
    return 0
