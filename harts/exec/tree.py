"""Exact execution over a rollout tree's compact layout: the tree `MixingContext`.

Legend: L local rows of a microbatch (context rows + computed rows), C computed rows,
H heads, K/V/D/E feature dims, W conv window, S KDA sequences.

The model runs token-wise work once per *computed* row; this context supplies the three
places where rows see each other, each restricted to a row's own root path:

- full attention: the computed rows attend the local rows with the DFS interval mask
  `k <= q <= end[k]` (ancestor-or-self). On CPU a dense boolean mask
  (`harts.exec.ops.attention.naive`); a GPU fast path (`harts.exec.ops.attention.tree`)
  plugs in behind `attention` with the same contract.
- short convolution: a row's window is its previous W-1 rows along its path, gathered
  through parent pointers (so windows cross forks correctly).
- KDA: the rounds of a `KDASchedule`. Each round is ONE packed varlen chunkwise call.
  A sequence gathers its replay rows (ancestor tokens [a, s_v1), state only) and its own
  rows; only its own rows' outputs are kept. Its initial state is zeros, a boundary state
  that an earlier round's call returned (still in the autograd graph, so gradients flow
  back into the producing call), or an *external* state handed in from another
  microbatch. Every computed row's output is written by exactly one sequence. A round
  returns only the chunk-boundary states that are read — by later rounds, and by the
  consumers of a recording producer (`record_states`) — as a `chunk_state_index`, so the
  GPU path gathers and back-propagates a handful of K x V states, not one per chunk.

A microbatch's rows form a `LocalLayout`: its computed rows plus the *context* rows it
reads from a producer microbatch (sharing windows, harts.exec.window). Context rows are
never recomputed: their mixing inputs (attention keys/values, conv inputs, KDA inputs of
replayed rows) and the KDA states at the consumer's chunk-aligned starts come from a
`Stash` the producer recorded (`harts.exec.stash`; in a chain of windows, the stashes of
every producer up the chain, each holding the rows it computed, `ChainStash`). With no
context rows (`TreeContext(forest)`) this is the single-microbatch tree path.

Two KDA schedules: `replay` (the minimum-call plan of harts.plan.kda_calls: sequences
start at chunk-aligned positions, so each trajectory's chunk grid is reproduced and
handoffs are bit-exact) and `node` (the no-replay ablation: every node is its own
sequence, starting mid-chunk at its fork from its parent's final state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from harts.config.kernels import Impl, KernelConfig
from harts.exec.ops.attention import naive as naive_attention
from harts.exec.ops.gather import RowGather, RowPlace
from harts.exec.ops.record import KernelRecord, report, report_fallback
from harts.exec.stash import ChainStash, Stash, StashNeeds, locate, stash_category
from harts.exec.transfer import to_device
from harts.exec.tree_layout import (
    EXTERNAL_STATE,
    ZERO_STATE,
    KDASchedule,
    LocalLayout,
    chunk_state_of,
    node_schedule,
    replay_schedule,
)
from harts.tree.forest import RolloutForest


def consumer_needs(layout: LocalLayout, schedule: KDASchedule, conv_window: int) -> StashNeeds:
    """The producer rows a consumer with this layout and KDA schedule reads."""
    ctx = ~layout.computed
    roots = np.flatnonzero(layout.computed & (layout.parent >= 0) & ctx[np.maximum(layout.parent, 0)])
    conv = set()
    for r in roots.tolist():
        p = int(layout.parent[r])
        for _ in range(conv_window - 1):
            if p < 0:
                break
            conv.add(p)
            p = int(layout.parent[p])
    gathered = np.unique(np.concatenate([r.gather_rows for r in schedule.rounds])) if schedule.rounds else np.zeros(0, np.int64)
    kda = gathered[ctx[gathered]]
    rows = layout.rows
    return StashNeeds(
        attention=rows[ctx],
        conv=rows[np.asarray(sorted(conv), np.int64)],
        kda=rows[kda],
        states=[(int(rows[row]), a) for a, row in schedule.external],
    )


class TreeContext:
    """`MixingContext` over a microbatch's local layout (by default: a whole forest)."""

    allows_token_dropping = False
    # whether the model's blocks checkpoint over this context when the model recomputes
    # (`run_blocks`); a window producer that stores what it saves sets it False
    recompute = True

    def __init__(self, forest: RolloutForest, *, chunk_size: int = 64, kda_mode: str = "replay",
                 device: torch.device | str = "cpu", layout: LocalLayout | None = None,
                 row_weight: np.ndarray | None = None, stash: Stash | None = None,
                 record: bool = False, schedule: KDASchedule | None = None,
                 record_states: Sequence[tuple[int, int]] | None = None,
                 kernels: KernelConfig | None = None, kernel_record: KernelRecord | None = None,
                 stash_needs: StashNeeds | None = None, record_needs: StashNeeds | None = None):
        """`record`: record a `Stash` for consumers; `record_states` lists the states they
        will read, as (global row at depth a-1, a) (StashNeeds.states), so that only those
        (and those later rounds start from) are requested from the KDA calls. With `record`
        and no `record_states`, every chunk-boundary state is kept. `record_needs` (with
        `record`): everything the consumers read (their `StashNeeds` union), so that inputs
        are cut to it as they are recorded; its states are the `record_states`. `kernels`:
        which kernels the calls run (default: `KernelConfig.from_env()`, built here);
        `kernel_record`: where what they ran is recorded (default: a record of this
        context's own).

        A consumer's context is built from its producer's `stash`, or ahead of the
        producer's run from `stash_needs` (the rows that stash keeps: the window's
        `StashNeeds`), with the stash bound before the forward (`bind`)."""
        if kda_mode not in ("replay", "node"):
            raise ValueError(f"kda_mode must be 'replay' or 'node', got {kda_mode!r}")
        layout = layout if layout is not None else LocalLayout.full(forest)
        if kda_mode == "node" and not layout.computed.all():
            raise ValueError("the no-replay ablation runs on whole forests only")
        if not layout.computed.all() and stash is None and stash_needs is None:
            raise ValueError("a layout with context rows needs its producer's stash (or the rows it keeps)")
        if record_needs is not None:
            if record_states is not None:
                raise ValueError("give record_states or record_needs, not both")
            record_states = record_needs.states
        self.forest = forest
        self.layout = layout
        self.chunk_size = chunk_size
        self.kernels = kernels if kernels is not None else KernelConfig.from_env()
        self.kernel_record = kernel_record if kernel_record is not None else KernelRecord()
        dev = torch.device(device)
        self.device = dev
        comp = layout.computed_index
        self._computed = to_device(comp, dev)
        self.num_rows = int(comp.size)
        weight = forest.row_occurrence[layout.rows[comp]] if row_weight is None else row_weight
        self.row_weight = to_device(weight, dev, torch.float64)
        self.position_ids = to_device(layout.position[comp], dev, torch.int64)
        end = to_device(layout.end, dev, torch.int64)
        q_idx = self._computed
        from harts.exec import backend

        # GPU: the fast paths of harts.exec.ops.attention.tree (None = dense reference)
        self._fast_attention = backend.tree_attention(q_idx, end, dev, parent_L=layout.parent, q_local_host=comp,
                                                      kernels=self.kernels, record=self.kernel_record)
        if self._fast_attention is not None:
            self._fast_attention.prepare()
        self._reference_reason = backend.reference_attention_reason(dev, self.kernels)
        # [C, L]: key k is an ancestor-or-self of computed query q
        self.attn_mask = None if self._fast_attention is not None else naive_attention.ancestor_mask(q_idx, end)
        self.stash = None
        # an empty stash whose gathers every recording shares (`start_recording`); it
        # records the computed rows only, also in a piece of a chain of windows (its
        # readers find the rows above it in its producers' stashes, `ChainStash`)
        self._record_template = Stash(layout.rows[comp], comp, record_needs, dev) if record else None
        self.record = self._record_template
        self._places: dict[str, RowPlace] | None = None
        self._kept_rows: dict[str, np.ndarray] = {}
        self._take_computed: RowGather | None = None
        if stash is not None or stash_needs is not None:
            # per kind of input: the local rows over [stashed rows | computed rows], context
            # rows the stash does not keep zero (never read by a computed row); the stashed
            # rows of a chain's producers are theirs one after another (`StashNeeds.chain`)
            ctx_idx = layout.context_index
            kept_rows = stash.input_rows if stash is not None else {
                cat: getattr(stash_needs, cat) for cat in ("attention", "conv", "kda")}
            self._kept_rows = kept_rows
            self._places = {}
            for cat, kept in kept_rows.items():
                ok, at = locate(kept, layout.rows[ctx_idx])
                self._places[cat] = RowPlace(layout.num_rows, comp, ctx_idx[ok], at[ok], kept.size, dev)
            # the conv runs over every local row; the computed rows' outputs read back
            self._take_computed = RowGather(comp, layout.num_rows, dev)
            if stash is not None:
                self.bind(stash)
        if schedule is not None:
            self.schedule = schedule
        elif kda_mode == "replay":
            self.schedule = replay_schedule(layout, chunk_size)
        else:
            self.schedule = node_schedule(forest, chunk_size)
        self.chunk_state_index = self._chunk_states_read(record, record_states)
        if self.record is not None:
            self.record.schedule = self.schedule
            self.record.chunk_state_index = self.chunk_state_index
        self._rounds = []
        at = 0  # where each round's rows start in the rounds' concatenated inputs
        kept = []  # kept positions in the rounds' concatenated outputs, round after round
        for r in self.schedule.rounds:
            # init_index into the compact list of states its round returns
            init_index = [i if pr < 0 or self.chunk_state_index[pr] is None
                          else int(np.searchsorted(self.chunk_state_index[pr], i))
                          for pr, i in zip(r.init_round.tolist(), r.init_index.tolist(), strict=True)]
            n = int(r.gather_rows.size)
            self._rounds.append(((at, at + n), (to_device(r.cu_seqlens, dev), torch.as_tensor(r.cu_seqlens)),
                                 r.init_round.tolist(), init_index))
            kept.append(at + np.asarray(r.keep, dtype=np.int64))
            at += n
        # one gather of every round's inputs (replayed rows repeated) and one read of the
        # kept outputs back in computed order (written rows are local), each with a
        # gather-form backward (`RowGather`)
        rows_in = np.concatenate([r.gather_rows for r in self.schedule.rounds]) if self.schedule.rounds \
            else np.zeros(0, np.int64)
        self._kda_in = RowGather(rows_in, layout.num_rows, dev)
        pos_in_computed = np.full(layout.num_rows, -1, dtype=np.int64)
        pos_in_computed[comp] = np.arange(comp.size)
        written = pos_in_computed[self.schedule.written_rows]
        if not np.array_equal(np.sort(written), np.arange(comp.size)):
            raise AssertionError("KDA schedule must write every computed row exactly once")
        unpermute = np.empty(comp.size, dtype=np.int64)
        unpermute[written] = np.arange(comp.size)
        kept_all = np.concatenate(kept) if kept else np.zeros(0, np.int64)
        self._kda_out = RowGather(kept_all[unpermute], at, dev)
        self._windows: dict[int, Tensor] = {}
        self._round_windows: dict[int, Tensor] = {}
        self._consumer_pieces: dict[int, tuple[RowGather, Tensor, RowGather, RowPlace]] = {}

    def _chunk_states_read(self, record: bool, record_states: Sequence[tuple[int, int]] | None
                           ) -> list[np.ndarray | None]:
        """Per round, the sorted indices (into its full list of chunk-boundary states) of the
        states that are read: by later rounds, and by the consumers of a recording producer.
        None = all (recording with no `record_states` given; node-wise final handoffs)."""
        rounds = self.schedule.rounds
        if self.schedule.handoff != "chunk" or (record and record_states is None):
            return [None] * len(rounds)
        read: list[set[int]] = [set() for _ in rounds]
        for rnd in rounds:
            for r, i in zip(rnd.init_round.tolist(), rnd.init_index.tolist(), strict=True):
                if r >= 0:
                    read[r].add(i)
        if record:
            rows = self.layout.rows
            for row, a in record_states or ():
                local = int(np.searchsorted(rows, row))
                if local >= rows.size or rows[local] != row or not self.layout.computed[local]:
                    raise ValueError(f"record_states: row {row} is not computed here")
                r, i = chunk_state_of(self.schedule, local, a)
                read[r].add(i)
        return [np.asarray(sorted(s), np.int64) for s in read]

    def bind(self, stash: Stash | ChainStash) -> None:
        """The producer's stash (its leaves) this consumer reads; its kept rows must be the
        ones the context was built for."""
        if self._places is None:
            raise ValueError("this context reads no producer rows")
        for cat, place in self._places.items():
            kept = stash.input_rows.get(cat)
            if kept is not None and kept.size != place.num_src:
                raise ValueError(f"the stash keeps {kept.size} {cat} rows; this context was built for {place.num_src}")
        self.stash = stash

    def start_recording(self) -> Stash:
        """A fresh `Stash` for this producer's next forward (a context prepared ahead runs
        once per pass: the MoE statistics pass, then the training pass)."""
        if self._record_template is None:
            raise ValueError("this context does not record")
        self.record = self._record_template.fresh()
        self.record.schedule = self.schedule
        self.record.chunk_state_index = self.chunk_state_index
        return self.record

    def release_record(self) -> None:
        """Drop what the last recording holds (after the producer's backward), keeping
        the context a recording one."""
        if self._record_template is not None:
            self.record = self._record_template

    @property
    def kda_rounds(self) -> int:
        return self.schedule.num_rounds

    @property
    def replay_tokens(self) -> int:
        return self.schedule.replay_tokens

    def _local(self, key: tuple[int, str], *own: Tensor) -> tuple[Tensor, ...]:
        """Mixing inputs over all local rows: the producer's for context rows, ours after."""
        if self.record is not None:
            self.record.record_input(key, own)
        if self._places is None:
            return own
        if self.stash is None:
            raise ValueError("a consumer's context runs with its producer's stash bound (TreeContext.bind)")
        return self._places[stash_category(key[1])](self.stash.input_parts(key), own)

    def attention(self, layer: int, q_THD: Tensor, k_THD: Tensor, v_THE: Tensor, scale: float) -> Tensor:
        k_LHD, v_LHE = self._local((layer, "attention"), k_THD, v_THE)
        if self._fast_attention is not None:
            return self._fast_attention(q_THD, k_LHD, v_LHE, scale)
        if self._reference_reason is not None:
            report_fallback(self.kernel_record, "tree_attention", self.kernels.tree_attention, Impl.REFERENCE,
                            self._reference_reason)
        else:
            report(self.kernel_record, "tree_attention", Impl.REFERENCE)
        return naive_attention.tree_attention(q_THD, k_LHD, v_LHE, scale, self.attn_mask)

    def short_conv(self, layer: int, name: str, x_TD: Tensor, weight_DW: Tensor, bias_D: Tensor | None) -> Tensor:
        from harts.exec.backend import short_conv

        (x_LD,) = self._local((layer, f"conv:{name}"), x_TD)
        W = weight_DW.shape[1]
        # gather form: every row's sum runs in the same order whatever the layout, so a
        # row's output has the same bits as the token's in its trajectory (a dense conv1d
        # would round differently at different lengths: docs/LOG.md)
        y_LD = short_conv(x_LD, weight_DW, bias_D, window_TW=self._window(W), activation="silu",
                          kernels=self.kernels, record=self.kernel_record)
        return y_LD if self._take_computed is None else self._take_computed(y_LD)[0]

    def kda(self, layer: int, q_THK: Tensor, k_THK: Tensor, v_THV: Tensor, g_THK: Tensor,
            beta_TH: Tensor, scale: float) -> Tensor:
        q, k, v, g, beta = self._local((layer, "kda"), q_THK, k_THK, v_THV, g_THK, beta_TH)
        return self._kda_rounds(layer, *self._kda_in(q, k, v, g, beta), scale)

    def kda_mixing(self, layer: int, q_TD: Tensor, k_TD: Tensor, v_TD: Tensor,
                   convs: tuple[Tensor, Tensor, Tensor], gate_TR: Tensor, gate: Callable[[Tensor], Tensor],
                   beta_TH: Tensor, scale: float) -> Tensor:
        """The KDA layer's mixing from its projections (`harts.exec.model.kda.kda_mixing`'s
        contract) with nothing wide gathered into the rounds' order (rows of the rounds,
        replayed rows repeated): each short conv reads its window of the computed rows and
        writes its output straight in the rounds' order (its backward sums a repeated row's
        readers through the inverse window), and the forget gate is computed from its
        gathered low-rank features (rank R, against H x K for g). Before, the five KDA inputs
        were gathered (q, k, v and g 2048 wide each on the H200 model) and their gradients
        gathered back. A conv output's bits do not depend on the row order (each row sums its
        own window in a fixed order), so q, k, v are the ones `kda` would gather.

        Sharing windows take the same path. A producer records its conv inputs in computed
        order and its KDA inputs cut straight from the rounds' order (`Stash.record_rounds`).
        A consumer convolves only the rounds' computed entries, over its own rows and the
        stashed conv inputs above its roots (no conv over its context rows), and places the
        producer's stashed KDA inputs of replayed context rows beside them: no tensor over
        all local rows is built. A context that both reads a stash and records one (a piece
        in the middle of a chain of windows) records as a producer does: its conv inputs in
        computed order, its KDA inputs cut from the rounds' order, with no conv or placement
        over its context rows."""
        from harts.exec.backend import short_conv
        from harts.exec.model.layers import l2_norm_of

        W = convs[0].shape[1]
        if self._places is not None and self.stash is None:
            raise ValueError("a consumer's context runs with its producer's stash bound (TreeContext.bind)")
        if self.record is not None:
            for name, x in zip("qkv", (q_TD, k_TD, v_TD), strict=True):
                self.record.record_input((layer, f"conv:{name}"), (x,))
        if self._places is None:
            window = self._round_window(W)
            f, beta = self._kda_in(gate_TR, beta_TH)
            xs = (q_TD, k_TD, v_TD)
        else:
            own_in, window, ctx_in, place = self._consumer_rounds(W)
            f, beta = own_in(gate_TR, beta_TH)
            # each conv over [stashed conv rows | computed rows]
            xs = tuple(torch.cat([*self.stash.input_parts((layer, f"conv:{name}"))[0], x])
                       for name, x in zip("qkv", (q_TD, k_TD, v_TD), strict=True))
        g = gate(f)
        R, H, K = g.shape
        q, k, v = (short_conv(x, w, None, window_TW=window, activation="silu", kernels=self.kernels,
                              record=self.kernel_record)
                   for x, w in zip(xs, convs, strict=True))
        q, k, v = l2_norm_of(q.view(R, H, K), self), l2_norm_of(k.view(R, H, K), self), v.view(R, H, -1)
        if self._places is not None:
            q, k, v, g, beta = place(ctx_in(*self.stash.inputs[(layer, "kda")]), (q, k, v, g, beta))
        if self.record is not None:
            self.record.record_rounds((layer, "kda"), (q, k, v, g, beta), self._kda_out.index_host, self.device)
        return self._kda_rounds(layer, q, k, v, g, beta, scale)

    def _consumer_rounds(self, W: int) -> tuple[RowGather, Tensor, RowGather, RowPlace]:
        """A consumer's pieces of the rounds' inputs (built once per conv width): the gather
        of its computed entries' gate features and beta from computed order, their conv
        windows over [stashed conv rows | computed rows], and the placement of those entries
        beside the stashed KDA inputs of the replayed context rows (every entry is one or
        the other, so nothing is zero-filled)."""
        if W in self._consumer_pieces:
            return self._consumer_pieces[W]
        layout, dev = self.layout, self.device
        rows_in = self._kda_in.index_host
        own = layout.computed[rows_in]
        at_own, at_ctx = np.flatnonzero(own), np.flatnonzero(~own)
        comp = layout.computed_index
        pos_in_computed = np.full(layout.num_rows, -1, dtype=np.int64)
        pos_in_computed[comp] = np.arange(comp.size)
        own_in = RowGather(pos_in_computed[rows_in[at_own]], comp.size, dev)
        kept_kda = self._kept_rows["kda"]
        ctx_rows = layout.rows[rows_in[at_ctx]]
        found, at_kept = locate(kept_kda, ctx_rows)
        if not found.all():
            raise ValueError("the stash does not keep the KDA inputs of every context row the rounds replay")
        # a context row replayed by several sequences occurs more than once: its stashed
        # inputs are gathered per occurrence first (few rows), then placed
        ctx_in = RowGather(at_kept, kept_kda.size, dev)
        place = RowPlace(rows_in.size, at_own, at_ctx, np.arange(at_ctx.size), at_ctx.size, dev)
        # conv source rows: the stashed conv inputs (their context rows), then the computed rows
        kept_conv = self._kept_rows["conv"]
        src_of_local = np.full(layout.num_rows, -1, dtype=np.int64)
        ctx_idx = layout.context_index
        ok, at = locate(kept_conv, layout.rows[ctx_idx])
        src_of_local[ctx_idx[ok]] = at[ok]
        src_of_local[comp] = kept_conv.size + np.arange(comp.size)
        from harts.exec.ops.conv import window_from_parents

        window = window_from_parents(torch.as_tensor(layout.parent), W).numpy()[rows_in[at_own]]
        mapped = np.where(window >= 0, src_of_local[np.maximum(window, 0)], -1)
        if ((window >= 0) & (mapped < 0)).any():
            raise ValueError("a computed row's conv window reaches a context row the stash does not keep")
        self._consumer_pieces[W] = (own_in, to_device(mapped, dev, torch.int64), ctx_in, place)
        return self._consumer_pieces[W]

    def prepare_kda(self, conv_window: int) -> None:
        """Build now what the fused KDA path (`kda_mixing`) would build at its first layer
        — index tensors, conv windows, the producer's cut of its rounds' inputs — so that a
        context prepared ahead of its step does this host work and these uploads off the
        step's critical path."""
        if self._places is not None:
            self._consumer_rounds(conv_window)
        else:
            self._round_window(conv_window)
        if self._record_template is not None and self._record_template.needs is not None:
            self._record_template.rounds_cut("kda", self._kda_out.index_host, self._kda_out.num_rows, self.device)

    def _round_window(self, W: int) -> Tensor:
        """[R, W]: the conv window of each row of the KDA rounds' inputs (rows of the local
        layout; a replayed row's window is its own row's)."""
        if W not in self._round_windows:
            window = self._window(W)
            self._round_windows[W] = window if self._kda_in.identity else window[self._kda_in.index]
        return self._round_windows[W]

    def _window(self, W: int) -> Tensor:
        """[L, W]: each local row's conv window along its path (built once per width, on
        the host from the layout's parents and copied without a stream synchronisation:
        `window_from_parents` checks its input, which on a device tensor waits for the GPU)."""
        if W not in self._windows:
            from harts.exec.ops.conv import window_from_parents

            window = window_from_parents(torch.as_tensor(self.layout.parent, dtype=torch.int64), W)
            self._windows[W] = to_device(window, self.device)
        return self._windows[W]

    def _kda_rounds(self, layer: int, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    scale: float) -> Tensor:
        """The KDA calls, one per round, on inputs already in the rounds' order; the output
        read back in computed order."""
        from harts.exec.backend import chunk_kda

        H, K, V = q.shape[1], q.shape[2], v.shape[2]
        external = [self.stash.state_at(layer, int(self.layout.rows[row]), a)
                    for a, row in self.schedule.external] if self.schedule.external else []
        handed: list[Tensor] = []  # per round: the states later rounds may start from
        outputs: list[Tensor] = []
        chunk = self.schedule.handoff == "chunk"
        # one split per tensor, not a slice per round: a slice's backward zero-fills a
        # gradient the size of the whole input and adds it to the others' (5 tensors x
        # rounds x layers of them: 30 ms of a 1.32 s H200 tree step,
        # benchmarks/results/profile/2026-11-29-edc4f35-opsites.json); the split's
        # backward is one cat
        sizes = [b - a for (a, b), *_ in self._rounds]
        parts = list(zip(*(x.split(sizes) for x in (q, k, v, g, beta)), strict=True)) if len(sizes) > 1 \
            else [(q, k, v, g, beta)]
        for ((_, cu, init_round, init_index), state_index), (q_r, k_r, v_r, g_r, beta_r) in zip(
                zip(self._rounds, self.chunk_state_index, strict=True), parts, strict=True):
            if all(r == ZERO_STATE for r in init_round):
                h0 = None
            else:
                states = [external[i] if r == EXTERNAL_STATE else handed[r][i]
                          for r, i in zip(init_round, init_index, strict=True) if r != ZERO_STATE]
                zero = states[0].new_zeros(H, K, V)
                it = iter(states)
                h0 = torch.stack([zero if r == ZERO_STATE else next(it) for r in init_round])
            out = chunk_kda(
                q_r, k_r, v_r, g_r, beta_r,
                scale=scale, initial_state=h0, cu_seqlens=cu[0], cu_seqlens_cpu=cu[1], chunk_size=self.chunk_size,
                output_final_state=not chunk, output_chunk_states=chunk,
                chunk_state_index=state_index, kernels=self.kernels, record=self.kernel_record,
            )
            handed.append(out.chunk_states if chunk else out.final_state)
            outputs.append(out.o)
        if self.record is not None:
            self.record.record_kda(layer, handed)
        (o,) = self._kda_out(torch.cat(outputs, dim=0) if len(outputs) != 1 else outputs[0])
        return o
