"""Table 5: DP load-balance distributions at DP 2/4/8 (slots, balance P5, step-total minimum)."""

from harts.experiments.dp_balance.study import STUDY, DPBalanceConfig, run

__all__ = ["STUDY", "DPBalanceConfig", "run"]
