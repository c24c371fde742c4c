"""The paper's numbers (seeds/papers.txt, Tables 3-7 and Figure 4), as data, in one place."""

from __future__ import annotations

# Table 3: within-microbatch prefix compression on SWE-bench, (model, GPUs, scheme) -> x
TABLE3_COMPRESSION: dict[tuple[str, int, str], float] = {
    ("tiny", 8, "treestep"): 3.91,
    ("flash", 32, "stepwise"): 7.58,
    ("flash", 32, "treestep"): 6.65,
    ("flash", 64, "stepwise"): 7.57,
    ("flash", 64, "treestep"): 6.56,
}

# Table 4: two-level scheduling; planner -> (compression x, balance fraction, seconds/step)
TABLE4_PLANNERS: dict[str, tuple[float, float, float]] = {
    "ortools-ffd": (5.535, 0.9411, 3.1705),
    "l1": (5.588, 0.9862, 0.5097),
    "l1l2": (7.543, 0.9759, 0.8891),
}

# Table 5: DP load-balance distributions; dp -> {planner: (slots, balance P5, step-total min)}
TABLE5_DP_BALANCE: dict[int, dict[str, tuple[int, float, float]]] = {
    2: {"l1l2": (599, 0.9665, 0.9840), "ortools-ffd": (614, 0.8791, 0.9635)},
    4: {"l1l2": (301, 0.9440, 0.9820), "ortools-ffd": (319, 0.7962, 0.9508)},
    8: {"l1l2": (152, 0.9361, 0.9596), "ortools-ffd": (166, 0.7291, 0.9145)},
}

# Table 6: PP scheduling ablation on Tiny/8 Tree-Step, k tokens/s
TABLE6_PP: dict[str, float] = {
    "non-overlap": 167.7,
    "overlap-bwd-first": 190.4,
    "consumer-1f1b": 208.5,
}

# Table 7: full-model fidelity on Tiny (bf16 GPU). Row DP8/TP1/PP1/EP8:
TABLE7_FIDELITY: dict[str, float] = {
    "self_rerun_cosine": 0.99978662,
    "harts_cosine": 0.99977463,
    "harts_recompute_cosine": 0.99977816,
    "abs_loss_diff": 9.66e-5,
}
TABLE7_ALL_ROWS: dict[str, tuple[float, float, float, float]] = {
    "DP8/TP1/PP1/EP8": (0.99978662, 0.99977463, 0.99977816, 9.66e-5),
    "DP4/TP2/SP/PP1/EP8": (0.99975827, 0.99974703, 0.99974416, 6.02e-6),
    "DP2/TP2/SP/PP2/EP4": (0.99972408, 0.99971610, 0.99971732, 1.33e-4),
}

# Figure 4 / abstract: update-throughput speedup over the expanded baseline on SWE-bench,
# across both sampling schemes, Tiny and Flash, 8-64 GPUs (per-bar values are not in the text)
FIGURE4_SPEEDUP_RANGE: tuple[float, float] = (4.77, 10.45)

PAPER_LABEL = "paper"
