"""Kernel selection as data: which implementation each op family runs (no torch).

A `KernelConfig` is built once (by the caller, from CLI flags, or from the environment
with `KernelConfig.from_env`), handed to a trainer, which hands it to every mixing
context its microbatches run on; the ops read their choice from it, never from process
state. `Impl` names what an op ran, for the record a context keeps (`harts.exec.ops.record`).

Each choice is a request: `auto` picks the fastest path that can run; a path that cannot
run for a call (CPU tensors, float64, a missing library, a failed self-check) falls back
to one that can, and says so per call (a warning naming the op, the requested and the
executed path). `force_reference` runs the references everywhere: the A/B switch for
equivalence and speed comparisons.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Impl(StrEnum):
    """What an op ran."""

    REFERENCE = "reference"
    FLA = "fla"  # fla-core chunk_kda (+ harts' boundary-state kernel for replay handoffs)
    FLEX = "flex"  # FlexAttention with a block mask from DFS intervals
    VARLEN = "varlen"  # ancestor attention as one varlen flash call over root-to-row paths
    CUDNN = "cudnn"  # ancestor attention as cuDNN calls per query segment merged by log-sum-exp
    GRAPH = "graph"  # cuDNN graph: forward one bottom-right call over root-to-row paths, backward the split
    GROUPED = "grouped"  # MoE experts as grouped matrix products (torch grouped_mm)
    TRITON = "triton"  # our fused Triton kernels (short conv)
    FUSED = "fused"  # torch's fused RMSNorm kernel (F.rms_norm) for the norms
    SDPA = "sdpa"  # torch's scaled_dot_product_attention (cuDNN where it takes the shape)
    FLASH = "flash"  # torch's SDPA with values padded to the qk dim (flash kernel)


class TreeAttention(StrEnum):
    """Tree mode's ancestor attention on CUDA in bf16/fp16 (fp32 takes flex)."""

    AUTO = "auto"  # graph where its self-check passes, else cudnn for long segments, else varlen
    GRAPH = "graph"  # cuDNN graph API: one bottom-right call forward, the split backward
    CUDNN = "cudnn"  # cuDNN calls per query segment merged by log-sum-exp
    VARLEN = "varlen"  # one varlen flash call over root-to-row paths
    FLEX = "flex"  # FlexAttention over a block mask from the DFS intervals


class BaselineAttention(StrEnum):
    """The expanded baseline's causal attention on CUDA."""

    CUDNN = "cudnn"  # torch's cuDNN SDPA per sequence
    FLASH = "flash"  # the flash kernel with values padded to the qk dim
    GRAPH = "graph"  # one cuDNN graph call per microbatch: the tree's forward kernel, row bits equal


class ConvKernel(StrEnum):
    """The short convolution."""

    AUTO = "auto"  # triton on CUDA, the reference elsewhere
    TRITON = "triton"  # the fused Triton kernels (CUDA only)
    REFERENCE = "reference"  # the gather-form reference


class NormKernel(StrEnum):
    """RMSNorm and the L2 norm of KDA's queries and keys."""

    AUTO = "auto"  # torch's fused RMSNorm kernel on CUDA (bf16, fp16, fp32), the reference elsewhere
    REFERENCE = "reference"  # one elementwise op at a time (harts.exec.ops.norm.naive)


class Compile(StrEnum):
    """Which torch.compile backend runs the model's compiled regions (`harts.exec.compiled`:
    the MoE routing and load-balance statistics, the KDA forget gate, the SwiGLU products
    of the dense FFN, the shared and the routed experts, the gated norm's gate)."""

    OFF = "off"  # eager
    INDUCTOR = "inductor"  # fused generated kernels: fewer launches per layer
    AOT_EAGER = "aot_eager"  # traced and run as aten ops, nothing generated (checks the tracing)


_CHOICES = {"tree_attention": TreeAttention, "baseline_attention": BaselineAttention, "conv": ConvKernel,
            "norm": NormKernel, "compile": Compile}


def parse_ints(text: str, count: int, name: str) -> tuple[int, ...]:
    """"a,b,c" -> (a, b, c): `count` positive integers, or ValueError naming `name`."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != count or any(v <= 0 for v in values):
        raise ValueError(f"{name}={text!r}: expected {count} positive integers separated by commas")
    return values


@dataclass(frozen=True)
class KernelConfig:
    """Which kernel each op family runs, and the thresholds the automatic choices use."""

    tree_attention: TreeAttention = TreeAttention.AUTO
    baseline_attention: BaselineAttention = BaselineAttention.CUDNN
    conv: ConvKernel = ConvKernel.AUTO
    norm: NormKernel = NormKernel.AUTO
    compile: Compile = Compile.OFF
    force_reference: bool = False
    # the fused conv backward's tiles (BD, BT_g, NSUB, warps_g, BT_dx, warps_dx); None: the
    # measured default (`harts.exec.ops.conv.triton`)
    conv_bwd_tiles: tuple[int, int, int, int, int, int] | None = None
    # fla's forward state kernel launch: "auto" (our config for rounds of few long
    # sequences, fla's elsewhere), "fla" (always fla's own), or "BV,warps,stages"
    kda_fwd_h: str = "auto"
    # "auto" keeps fla's launch where a round runs more than this many programs per SM at
    # BV 32 (harts.exec.ops.kda.fla.fwd_h_config)
    kda_fwd_h_programs_per_sm: float = 1.5
    # rows per query segment from which the per-segment cuDNN split beats one varlen call
    cudnn_split_min_rows_per_segment: int = 2048
    # segments longer than this take the dense per-segment cuDNN backward on the graph path
    graph_backward_max_rows: int = 8192
    # bytes of workspace up to which the graph path's backward runs deterministically (2
    # bytes per padded score, held for the call): at 4 GiB one 12k-row consumer of a 16k
    # window plan held 3.13 GiB of it at the step's peak, which put that step's peak 14% over
    # the expanded step's (benchmarks/results/windows/2026-12-06-2b27bb3-memtrace-h100-swe-tree4.json);
    # above it the backward runs without the flag, as torch's causal SDPA backward does. At
    # 256 MiB that step's peak went from 13.98 to 12.65 GiB with its time unchanged (0.788 ->
    # 0.787 s; benchmarks/results/step/2026-12-06-e54a58e-graph-workspace-h100.json)
    graph_deterministic_workspace_max: int = 256 * 2 ** 20
    # queries over a whole context read by row ranges (a piece of a chain of windows, or
    # segments under one shared prompt), the shorter side of that rectangle this many rows
    # or more: its backward as causal squares (harts.exec.ops.attention.triangles), where
    # cuDNN's non-causal backward costs 1.7x per pair; 0: always one call. In-process A/B of
    # a 64k chain at a 16k budget on two H100s: window step 1.308 -> 1.297 s and 1.426 ->
    # 1.341 s (benchmarks/results/chains/2026-12-07-099b971-chain64k-squares-ab-h100-a.json, -b.json)
    rectangle_triangles_min_rows: int = 8192
    # a chain of windows' outer stashes (those of every producer up a reader's chain but its
    # nearest) stay on the device, nearest first, while their attention rows sum to at most
    # this many microbatch budgets; the farther ones' keys and values wait in host memory,
    # copied in for each read (`harts.exec.stash.StashPart`), so what a chain keeps on the
    # device stops growing with its length. Below five budgets of trajectory no stash moves
    chain_stash_device_budgets: float = 4.0

    def __post_init__(self) -> None:
        for name, enum in _CHOICES.items():
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, enum(value))
            except ValueError:
                known = ", ".join(e.value for e in enum)
                raise ValueError(f"{name}={value!r}: expected one of {known}") from None
        if not isinstance(self.force_reference, bool):
            raise ValueError(f"force_reference={self.force_reference!r}: expected a bool")
        if self.conv_bwd_tiles is not None:
            tiles = self.conv_bwd_tiles
            if isinstance(tiles, str):
                tiles = parse_ints(tiles, 6, "conv_bwd_tiles")
            tiles = tuple(tiles)
            if len(tiles) != 6 or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in tiles):
                raise ValueError(f"conv_bwd_tiles={self.conv_bwd_tiles!r}: expected 6 positive integers")
            object.__setattr__(self, "conv_bwd_tiles", tiles)
        if not isinstance(self.kda_fwd_h, str):
            raise ValueError(f"kda_fwd_h={self.kda_fwd_h!r}: expected 'auto', 'fla' or 'BV,warps,stages'")
        if self.kda_fwd_h not in ("auto", "fla"):
            try:
                parse_ints(self.kda_fwd_h, 3, "kda_fwd_h")
            except ValueError:
                raise ValueError(f"kda_fwd_h={self.kda_fwd_h!r}: expected 'auto', 'fla' or 'BV,warps,stages'") from None
        for name in ("cudnn_split_min_rows_per_segment", "graph_backward_max_rows",
                     "graph_deterministic_workspace_max", "rectangle_triangles_min_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r}: expected a non-negative integer")
        budgets = self.chain_stash_device_budgets
        if not isinstance(budgets, int | float) or isinstance(budgets, bool) or not budgets >= 0:
            raise ValueError(f"chain_stash_device_budgets={budgets!r}: expected a number of budgets >= 0")
        if not isinstance(self.kda_fwd_h_programs_per_sm, int | float) or self.kda_fwd_h_programs_per_sm <= 0:
            raise ValueError(f"kda_fwd_h_programs_per_sm={self.kda_fwd_h_programs_per_sm!r}: expected a positive number")

    @property
    def kda_fwd_h_launch(self) -> str | tuple[int, int, int]:
        """kda_fwd_h parsed: "auto", "fla" or (BV, warps, stages)."""
        if self.kda_fwd_h in ("auto", "fla"):
            return self.kda_fwd_h
        return parse_ints(self.kda_fwd_h, 3, "kda_fwd_h")  # type: ignore[return-value]

    def replace(self, **changes: Any) -> KernelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, for the record of a run."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, StrEnum) else (
                list(value) if isinstance(value, tuple) else value)
        return out

    @classmethod
    def from_env(cls, **overrides: Any) -> KernelConfig:
        """The config the HARTS_* variables describe (`harts.config.env`; unset ones keep
        their defaults), with `overrides` on top. An invalid value raises ValueError naming
        the variable."""
        from harts.config import env

        settings = env.kernel_settings()
        kwargs: dict[str, Any] = {}
        if env.FORCE_REFERENCE in settings:
            kwargs["force_reference"] = settings[env.FORCE_REFERENCE] not in ("0", "false", "False")
        for var, field in ((env.TREE_ATTENTION, "tree_attention"), (env.BASELINE_ATTENTION, "baseline_attention"),
                           (env.CONV, "conv"), (env.NORM, "norm"), (env.FWD_H, "kda_fwd_h"),
                           (env.COMPILE, "compile")):
            if var in settings:
                kwargs[field] = settings[var]
        if env.CONV_BWD_TILES in settings:
            kwargs["conv_bwd_tiles"] = parse_ints(settings[env.CONV_BWD_TILES], 6, env.CONV_BWD_TILES)
        if env.RECTANGLE_TRIANGLES in settings:
            raw = settings[env.RECTANGLE_TRIANGLES]
            if not raw.isdigit():
                raise ValueError(f"{env.RECTANGLE_TRIANGLES}={raw!r}: expected a whole number of rows >= 0")
            kwargs["rectangle_triangles_min_rows"] = int(raw)
        if env.CHAIN_STASH_BUDGETS in settings:
            raw = settings[env.CHAIN_STASH_BUDGETS]
            try:
                kwargs["chain_stash_device_budgets"] = float(raw)
            except ValueError:
                raise ValueError(f"{env.CHAIN_STASH_BUDGETS}={raw!r}: expected a number of budgets >= 0") from None
        try:
            config = cls(**kwargs)
        except ValueError as err:
            var = {"tree_attention": env.TREE_ATTENTION, "baseline_attention": env.BASELINE_ATTENTION,
                   "conv": env.CONV, "norm": env.NORM, "kda_fwd_h": env.FWD_H, "compile": env.COMPILE,
                   "chain_stash_device_budgets": env.CHAIN_STASH_BUDGETS}
            field = str(err).split("=", 1)[0]
            raise ValueError(f"{var.get(field, field)}: {err}") from None
        return config.replace(**overrides) if overrides else config
