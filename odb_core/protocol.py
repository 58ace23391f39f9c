"""The per-rank DGAP protocol state machine (sans-IO).

One `RankMachine` per rank takes events and returns decisions. It never does I/O:
adapters pull samples, move the all-gather vector and yield batches; the model
checker, the simulator and the tests drive the very same class.

Phases and the one local action each allows (h11-style: anything else raises
ProtocolError at once):

    FILLING  --observe / exhaust-->  FILLING   while the rank needs a sample
    FILLING  --form-->               FILLING   window full, or source dry
    FILLING  --contribute-->         WAITING   ready batches, or dry and empty
    WAITING  --observe / exhaust-->  WAITING   prefetch into the window while the
                                               collective is in flight
    WAITING  --all_gather-->         FILLING | DONE
    DONE     (terminal for the epoch)

A FILLING rank has exactly one enabled action kind, and prefetching while
WAITING only adds to the window, which the next `form` reads in full; so the
batches a rank forms are a function of its own arrival order. All cross-rank
agreement goes through the one collective per round, whose result every rank
reduces with the same pure `decide_round`.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from odb_core.assign import Pricing, initial_slices
from odb_core.batch import Batch
from odb_core.collective import Contribution, RoundDecision, decide_round
from odb_core.config import Mode, OversizePolicy, ProtocolConfig
from odb_core.cost import BatchStats
from odb_core.errors import (
    DuplicateSampleError,
    ODBPeerError,
    OversizeSampleError,
    ProtocolError,
)
from odb_core.formers import FORMERS, FormResult, carried_first, fullest_batch
from odb_core.sample import Sample
from odb_core.step import StepInfo


class RankPhase(str, enum.Enum):
    # str mixin: C-level hashing, since phases sit inside every checked state.
    FILLING = "filling"
    WAITING = "waiting"
    DONE = "done"


class RankAction(str, enum.Enum):
    """Local actions of one rank; names match the actions of spec/DGAP.tla."""

    OBSERVE = "Observe"
    EXHAUST = "Exhaust"
    FORM = "Form"
    FORM_EARLY = "FormEarly"
    """Optional (`ProtocolConfig.early_form`): the driver takes it instead of
    OBSERVE when the next sample is not there yet (`RankMachine.fill(pull,
    early)`). spec/DGAP.tla's `FormEarly`, behind its constant `EarlyForm`."""
    CONTRIBUTE = "Contribute"


_NOTHING: frozenset[RankAction] = frozenset()
_NEEDS_SAMPLE = frozenset({RankAction.OBSERVE, RankAction.EXHAUST})
_FORM = frozenset({RankAction.FORM})
_NEEDS_SAMPLE_OR_EARLY = _NEEDS_SAMPLE | {RankAction.FORM_EARLY}
_CONTRIBUTE = frozenset({RankAction.CONTRIBUTE})
_FORM_EARLY = frozenset({RankAction.FORM_EARLY})


class RoundResult(NamedTuple):
    """`steps`: the round's decided steps, in order, with provisional window fields
    (see StepInfo; `WindowBuffer` finalises them). `done`: the epoch closed."""

    steps: tuple[StepInfo, ...]
    done: bool
    carried: tuple[Sample, ...]


class WindowRecord(NamedTuple):
    """A closed optimizer window as one rank saw it: the step count at its end, its
    global loss tokens, and this rank's loss tokens in it (spec: `windows`)."""

    end: int
    loss: int
    local: int


class RankSnapshot(NamedTuple):
    """Hashable protocol state of one rank; mirrors the per-rank variables of the spec."""

    phase: RankPhase
    exhausted: bool
    buffer: tuple[Sample, ...]
    ready: tuple[Batch, ...]
    steps: int
    pads: int
    round: int
    emitted: int
    contribution: Contribution | None
    window_loss: int
    window_local: int
    windows: tuple[WindowRecord, ...]
    queue: tuple[int, ...] = ()  # dynamic sharding: assigned ids not yet observed
    cursor: int = 0  # dynamic sharding: plan positions dealt so far
    formed: bool = False  # dynamic sharding: a starved rank formed its window
    # Dynamic sharding with a cost table: the plan slices dealt to every rank, in
    # order (agreed state the priced deal reads; () without a table).
    slices: tuple[tuple[tuple[int, int], ...], ...] = ()


# The last initial slices computed, with what they were computed from (the ranks of
# one process, a simulation's, share the epoch's plan and table: computed once). One
# tuple, read and replaced whole, so ranks on threads never mix two entries.
_INITIAL: list[tuple[Any, ...]] = [()]


def initial_slices_of(config: ProtocolConfig) -> tuple[tuple[int, int], ...]:
    """Dynamic sharding: every rank's initial plan slice, `assign.initial_slices` of
    the config's plan, world, target and cost table (agreed state). The loader's
    rank source reads its slice from the same function (`torch/rank_source.py`)."""
    plan, table = config.plan, config.cost_table
    key = (config.world_size, config.configured_target)
    cached = _INITIAL[0]
    if cached and cached[0] is plan and cached[1] is table and cached[2] == key:
        return cached[3]  # type: ignore[no-any-return]
    sizes = None if table is None else table.placed(plan, *key)[1]
    out = initial_slices(len(plan), config.world_size, config.configured_target, sizes)
    _INITIAL[0] = (plan, table, key, out)
    return out


class RankMachine:
    """The protocol state of one rank for one epoch."""

    def __init__(self, rank: int, config: ProtocolConfig) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < config.world_size:
            raise ProtocolError(f"rank={rank!r} is not in [0, {config.world_size})")
        self.rank = rank
        self.config = config
        self.phase = RankPhase.FILLING
        self.exhausted = False
        self.buffer: dict[int, Sample] = {}
        self.ready: deque[Batch] = deque()
        self.steps = 0
        self.pads = 0
        self.round = 0
        self.emitted = 0  # global real samples emitted so far this epoch (same on all ranks)
        # The open optimizer window: its global and this rank's loss tokens so far.
        self.window_loss = 0
        self.window_local = 0
        self.windows: tuple[WindowRecord, ...] = ()  # closed windows, in order
        self._seen: set[int] = set()
        self._truncated: dict[int, int] = {}
        self._contribution: Contribution | None = None
        self._former = FORMERS[config.former]
        # Dynamic sharding: ids assigned to this rank and not yet observed (in plan
        # order), and how far into the plan every rank has dealt.
        self.queue: dict[int, None] = {}
        self.cursor = 0
        self.formed = False  # starved: the window was formed since it last changed
        # Dynamic sharding: the cost of each id this rank observed (the next epoch's
        # cost table, `odb_core.cost_table.record`), and, when a table prices the
        # deals, the plan slices dealt to every rank, in order (agreed state).
        self.observed: dict[int, int] = {}
        self._slices: list[list[tuple[int, int]]] = []
        # Window bytes (`config.window_bytes`): the size, as observed, of each sample
        # held in the window or in a formed batch not yet emitted, and their sum.
        self.sizes: dict[int, int] = {}
        self.window_bytes = 0
        if config.dynamic:
            slices = initial_slices_of(config)
            start, stop = slices[rank]
            self.queue = dict.fromkeys(config.plan[start:stop])
            self.cursor = slices[-1][1]
            if config.cost_table is not None:
                self._slices = [[s] for s in slices]

    # ---- queries -------------------------------------------------------

    def enabled(self) -> frozenset[RankAction]:
        """Local actions legal now. OBSERVE and EXHAUST are both 'needs a sample':
        the source decides which one happens."""
        k = self.config.buffer_size
        starved = self.starved
        if self.phase is RankPhase.WAITING:
            if not self.exhausted and not starved and len(self.buffer) < k and not self.byte_full:
                return _NEEDS_SAMPLE
            return _NOTHING
        if self.phase is RankPhase.DONE:
            return _NOTHING
        if self.ready:
            return _CONTRIBUTE
        if len(self.buffer) >= k or (self.exhausted and self.buffer):
            return _FORM
        if starved and self.buffer and not self.formed:
            return _FORM
        if self.exhausted or starved:
            return _CONTRIBUTE
        if self.byte_full and not self.formed:
            # The spec's FormEarly with EarlyForm = 1, taken by the core, not the driver.
            return _FORM_EARLY
        early = self.config.early_form
        if early is not None and len(self.buffer) >= early and not self.formed:
            return _NEEDS_SAMPLE_OR_EARLY
        return _NEEDS_SAMPLE

    @property
    def plan_left(self) -> int:
        """Dynamic sharding: plan ids no rank has been dealt yet (0 when static)."""
        return len(self.config.plan) - self.cursor

    @property
    def starved(self) -> bool:
        """Dynamic sharding: nothing assigned is left unread, but the plan is not
        dealt out yet. The rank forms its window once, keeping the open batch back
        (more ids may be dealt to fill it), and contributes what is ready: offering
        0 steps if nothing is, which earns it ids in the round's deal."""
        return self.config.dynamic and not self.queue and self.plan_left > 0

    @property
    def unassigned(self) -> tuple[int, ...]:
        """Dynamic sharding: the plan ids not dealt to any rank yet."""
        return self.config.plan[self.cursor :]

    @property
    def byte_full(self) -> bool:
        """The bytes held (window and batches not yet emitted) reached
        `config.window_bytes` (never without a bound)."""
        bound = self.config.window_bytes
        return bound is not None and self.window_bytes >= bound

    @property
    def needs_sample(self) -> bool:
        return RankAction.OBSERVE in self.enabled()

    @property
    def contribution(self) -> Contribution | None:
        return self._contribution

    def _require(self, action: RankAction) -> None:
        if action not in self.enabled():
            raise ProtocolError(
                f"rank {self.rank}: {action.value} is illegal in phase {self.phase.value} "
                f"(exhausted={self.exhausted}, buffer={len(self.buffer)}, "
                f"ready={len(self.ready)}); enabled: "
                f"{sorted(a.value for a in self.enabled())}"
            )

    # ---- events --------------------------------------------------------

    def observe(self, sample: Sample, nbytes: int = 0) -> None:
        """A processed sample arrived from this rank's source; `nbytes`: its size as
        the driver measured it (counted against `config.window_bytes`)."""
        self._require(RankAction.OBSERVE)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ProtocolError(f"sample {sample.id!r}: nbytes={nbytes!r} is not a byte count")
        if sample.id in self._seen or sample.id in self.buffer:
            raise DuplicateSampleError(
                f"rank {self.rank}: sample id {sample.id!r} observed twice in this epoch"
            )
        if self.config.dynamic:
            if sample.id not in self.queue:
                raise ProtocolError(
                    f"rank {self.rank}: sample id {sample.id!r} is not assigned to this rank"
                )
            del self.queue[sample.id]
            self.observed[sample.id] = sample.tokens + sample.visual_tokens
        self.formed = False
        sample = self._apply_oversize_policy(sample)
        self._seen.add(sample.id)
        self.buffer[sample.id] = sample
        if nbytes:
            self.sizes[sample.id] = nbytes
            self.window_bytes += nbytes

    def exhaust(self) -> None:
        """This rank's source has no more samples this epoch."""
        self._require(RankAction.EXHAUST)
        if self.queue or self.plan_left:
            raise ProtocolError(
                f"rank {self.rank}: Exhaust with {len(self.queue)} assigned ids unread "
                f"and {self.plan_left} plan ids not dealt"
            )
        self.exhausted = True

    def form(self) -> list[Batch]:
        """Run the former on the window; closed batches become ready."""
        self._require(RankAction.FORM)
        flush = len(self.buffer) < self.config.buffer_size
        batches, leftovers = self._run_former(list(self.buffer.values()), flush)
        if self.starved and flush:
            # Starved, not dry: the open batch waits for what the next deal brings.
            batches, leftovers = self._run_former(list(self.buffer.values()), False)
            if batches and not leftovers:
                *batches, last = batches
                leftovers = list(last.samples)
            self.formed = True
        self.ready.extend(batches)
        self.buffer = {s.id: s for s in leftovers}
        return batches

    def form_early(self) -> list[Batch]:
        """Form the partial window without flush and emit only its fullest batch
        (`formers.fullest_batch`); the rest, open batch included, waits for later
        arrivals. Nothing is emitted when the window is one batch. Once per
        observation: the next early form needs a new sample first."""
        self._require(RankAction.FORM_EARLY)
        batches, leftovers = fullest_batch(self._run_former(list(self.buffer.values()), False))
        self.formed = True
        if not leftovers:
            return []
        self.ready.extend(batches)
        self.buffer = {s.id: s for s in leftovers}
        return batches

    def contribute(self) -> Contribution:
        """Enter the round's collective; returns this rank's vector."""
        self._require(RankAction.CONTRIBUTE)
        self._contribution = self._make_contribution()
        self.phase = RankPhase.WAITING
        return self._contribution

    def all_gather(self, contributions: Sequence[Contribution]) -> RoundResult:
        """The round's collective returned; emit the agreed aligned steps."""
        if self.phase is not RankPhase.WAITING or self._contribution is None:
            raise ProtocolError(
                f"rank {self.rank}: all_gather is illegal in phase {self.phase.value}"
            )
        if len(contributions) != self.config.world_size:
            raise ODBPeerError(
                f"rank {self.rank}: all-gather returned {len(contributions)} vectors "
                f"for world size {self.config.world_size}"
            )
        if contributions[self.rank] != self._contribution:
            raise ODBPeerError(
                f"rank {self.rank}: all-gather returned {contributions[self.rank]!r} as this "
                f"rank's vector, but it sent {self._contribution!r}"
            )
        c = self.config
        decision = decide_round(
            c.mode,
            c.quota,
            self.emitted,
            contributions,
            plan_left=self.plan_left if c.dynamic else None,
            target=c.target,
            pricing=self.pricing(contributions),
        )
        steps = self._emit(decision)
        if decision.assigned:
            start, stop = self._dealt_slice(decision.assigned)
            self.queue.update(dict.fromkeys(c.plan[start:stop]))
            if self._slices:
                at = self.cursor
                for r, n in enumerate(decision.assigned):
                    if n:
                        self._slices[r].append((at, at + n))
                    at += n
            self.cursor += sum(decision.assigned)
        self.round += 1
        self._contribution = None
        carried: tuple[Sample, ...] = ()
        if decision.done:
            carried = self._close()
        else:
            self.phase = RankPhase.FILLING
        return RoundResult(steps, decision.done, carried)

    # ---- conveniences for drivers ---------------------------------------

    def fill(
        self,
        pull: Callable[[], Sample | None],
        early: Callable[[], bool] | None = None,
        nbytes: Callable[[Sample], int] | None = None,
    ) -> Contribution:
        """Run local actions, pulling samples with `pull` (None = source dry),
        until the rank contributes. Adapters and the simulator use this.

        `early`: the driver's observation, asked only when FORM_EARLY is enabled
        (`ProtocolConfig.early_form`): True when the next sample is not there yet
        and waiting for the rest of the window is not worth it; the rank then
        forms early instead of pulling. `nbytes`: each pulled sample's size
        (`observe`), for the window's byte bound."""
        while True:
            enabled = self.enabled()
            if RankAction.CONTRIBUTE in enabled:
                return self.contribute()
            if RankAction.FORM in enabled:
                self.form()
            elif RankAction.FORM_EARLY in enabled and (
                RankAction.OBSERVE not in enabled or (early is not None and early())
            ):
                self.form_early()
            elif RankAction.OBSERVE in enabled:
                s = pull()
                if s is None:
                    self.exhaust()
                else:
                    self.observe(s, 0 if nbytes is None else nbytes(s))
            else:
                raise ProtocolError(f"rank {self.rank}: fill() in phase {self.phase.value}")

    def snapshot(self) -> RankSnapshot:
        return RankSnapshot(
            self.phase,
            self.exhausted,
            tuple(sorted(self.buffer.values(), key=lambda s: s.id)),
            tuple(self.ready),
            self.steps,
            self.pads,
            self.round,
            self.emitted,
            self._contribution,
            self.window_loss,
            self.window_local,
            self.windows,
            tuple(self.queue),
            self.cursor,
            self.formed,
            tuple(tuple(s) for s in self._slices),
        )

    @classmethod
    def restore(cls, rank: int, config: ProtocolConfig, snap: RankSnapshot) -> RankMachine:
        """Rebuild a machine from a snapshot (used by the model checker)."""
        m = cls(rank, config)
        m.phase = snap.phase
        m.exhausted = snap.exhausted
        m.buffer = {s.id: s for s in snap.buffer}
        m.ready = deque(snap.ready)
        m.steps, m.pads, m.round, m.emitted = snap.steps, snap.pads, snap.round, snap.emitted
        m.window_loss, m.window_local, m.windows = snap.window_loss, snap.window_local, snap.windows
        m._seen = set(m.buffer) | {s.id for b in m.ready for s in b.samples}
        m._contribution = snap.contribution
        m.queue = dict.fromkeys(snap.queue)
        m.cursor = snap.cursor
        m.formed = snap.formed
        if snap.slices:
            m._slices = [list(s) for s in snap.slices]
        return m

    # ---- internals -----------------------------------------------------

    def _run_former(self, window: list[Sample], flush: bool) -> FormResult:
        """The configured former; quota mode forms carried samples first."""
        c = self.config
        return carried_first(self._former, window, c.carried, c.budget, c.cost_model, flush)

    def _make_contribution(self) -> Contribution:
        m = self.config.max_steps_per_round
        offered = min(len(self.ready), m)
        head = [self.ready[i] for i in range(offered)]
        final = self.exhausted and not self.buffer and len(self.ready) <= m
        held = held_work = 0
        if self.config.dynamic:
            later = [self.ready[i] for i in range(offered, len(self.ready))]
            held = len(self.buffer) + sum(len(b.samples) for b in later)
            held_work = sum(s.tokens + s.visual_tokens for s in self.buffer.values())
            held_work += sum(b.tokens for b in later)
        return Contribution(
            offered,
            final,
            tuple(len(b.samples) for b in head),
            tuple(b.tokens for b in head),
            tuple(b.loss_tokens for b in head),
            len(self.queue),
            held,
            held_work,
        )

    def pricing(self, contributions: Sequence[Contribution]) -> Pricing | None:
        """What the cost table says of this round's deal (None without a table): each
        rank's unread ids, the last `unread` of the ids dealt to it (a rank reads its
        ids in dealt order; were it not to, only the balance would suffer), and the
        plan ids after the cursor. Agreed state only."""
        table = self.config.cost_table
        if table is None or not self.config.dynamic:
            return None
        plan = self.config.plan
        known, unseen = table.plan_prefix(plan)
        unread: list[tuple[int, int]] = []
        for r, c in enumerate(contributions):
            left, k, u = c.unread, 0, 0
            slices = self._slices[r]
            for a, b in reversed(slices):
                if left <= 0:
                    break
                a = max(a, b - left)
                k += known[b] - known[a]
                u += unseen[b] - unseen[a]
                left -= b - a
            unread.append((k, u))
        cursor = self.cursor
        seen = len(plan) - unseen[-1]
        mean = max(1, known[-1] // seen) if seen else 1

        def upcoming(i: int) -> int | None:
            return table.price(plan[cursor + i])

        return Pricing(tuple(unread), upcoming, mean)

    def _dealt_slice(self, assigned: tuple[int, ...]) -> tuple[int, int]:
        """Plan positions [start, stop) this rank loads from a round's deal: its
        slice follows those of the lower ranks."""
        start = self.cursor + sum(assigned[: self.rank])
        return start, start + assigned[self.rank]

    @property
    def window_steps(self) -> int:
        """Steps decided in the open optimizer window."""
        return self.steps - (self.windows[-1].end if self.windows else 0)

    def _window_closes(self) -> bool:
        """Whether the open window closes at the step just added (every rank agrees:
        the rule reads only global counts and the step count)."""
        if self.config.tokens_per_update is not None:
            return self.window_loss >= self.config.tokens_per_update
        return self.window_steps >= self.config.accum_steps

    def _close_window(self) -> None:
        self.windows = (
            *self.windows,
            WindowRecord(self.steps, self.window_loss, self.window_local),
        )
        self.window_loss = self.window_local = 0

    def _emit(self, decision: RoundDecision) -> tuple[StepInfo, ...]:
        out = []
        for t in range(decision.steps):
            if self.ready:
                batch: Batch | None = self.ready.popleft()
                assert batch is not None
                if self.sizes:
                    self.window_bytes -= sum(self.sizes.pop(x.id, 0) for x in batch.samples)
                local = (len(batch.samples), batch.tokens, batch.loss_tokens)
                truncated = tuple(
                    (s.id, s.tokens) for s in batch.samples if s.id in self._truncated
                )
            else:
                batch, local, truncated = None, (0, 0, 0), ()
                self.pads += 1
            window = len(self.windows)
            self.steps += 1
            self.emitted += decision.global_samples[t]
            self.window_loss += decision.global_loss_tokens[t]
            self.window_local += local[2]
            closes = self._window_closes() or (decision.done and t == decision.steps - 1)
            if closes:
                self._close_window()
            out.append(
                StepInfo(
                    step=self.steps - 1,
                    rank=self.rank,
                    round=self.round,
                    is_pad=batch is None,
                    batch=batch,
                    local_samples=local[0],
                    global_samples=decision.global_samples[t],
                    local_tokens=local[1],
                    global_tokens=decision.global_tokens[t],
                    local_loss_tokens=local[2],
                    global_loss_tokens=decision.global_loss_tokens[t],
                    window=window,
                    sync_gradients=closes,
                    truncated=truncated,
                )
            )
        if decision.done and self.window_steps > 0:
            self._close_window()  # an open window ends with the epoch (a 0-step last round)
        return tuple(out)

    def _close(self) -> tuple[Sample, ...]:
        self.phase = RankPhase.DONE
        carried = tuple(self.buffer.values()) + tuple(s for b in self.ready for s in b.samples)
        if carried and self.config.mode is Mode.JOIN:
            raise ProtocolError(
                f"rank {self.rank}: join-mode epoch closed with {len(carried)} samples not emitted"
            )
        self.buffer = {}
        self.sizes.clear()
        self.window_bytes = 0
        self.ready.clear()
        return carried

    def _apply_oversize_policy(self, s: Sample) -> Sample:
        if self.config.budget.fits_alone(s, self.config.cost_model):
            return s  # the common case, checked once
        refusal = oversize_refusal(s, self.config, f"rank {self.rank}")
        if refusal is not None:
            raise refusal
        if self.config.oversize is OversizePolicy.TRUNCATE:
            kept = _truncated_tokens(s, self.config)
            assert kept is not None  # oversize_refusal refuses what no cut fits
            self._truncated[s.id] = s.tokens
            # An adapter that knows the labels measures loss_tokens after the cut;
            # without labels every kept text token counts.
            loss = None if s.loss_tokens is None else min(s.loss_tokens, kept)
            return s._replace(tokens=kept, loss_tokens=loss)
        return s  # solo


def oversize_refusal(s: Sample, config: ProtocolConfig, where: str) -> OversizeSampleError | None:
    """The error the oversize policy raises for `s` (`where` found it: a rank, or the
    step estimate), or None where it is admitted: it fits alone, the policy is
    `solo`, or `truncate` can cut its text to fit."""
    budget, model = config.budget, config.cost_model
    if budget.fits_alone(s, model) or config.oversize is OversizePolicy.SOLO:
        return None
    if config.oversize is OversizePolicy.TRUNCATE:
        if _truncated_tokens(s, config) is not None:
            return None
        return OversizeSampleError(
            f"{where}: sample {s.id!r} (tokens={s.tokens}, visual_tokens="
            f"{s.visual_tokens}, patches={s.patches}) exceeds budget "
            f"{budget.tokens!r} even with all text truncated"
        )
    cost = model.cost(BatchStats().add(s))
    return OversizeSampleError(
        f"{where}: sample {s.id!r} costs {cost:g} under the "
        f"{model.name} cost model, over the budget {budget.tokens!r} "
        f"(max_samples={budget.max_samples}, max_patches={budget.max_patches}); "
        "choose oversize='solo' or 'truncate' to admit it"
    )


def _truncated_tokens(s: Sample, config: ProtocolConfig) -> int | None:
    """Largest text-token count that lets `s` fit alone, or None if none does."""
    budget, model = config.budget, config.cost_model
    if not budget.fits_alone(s._replace(tokens=0), model):
        return None
    lo, hi = 0, s.tokens  # invariant: lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if budget.fits_alone(s._replace(tokens=mid), model):
            lo = mid
        else:
            hi = mid
    return lo


def steps_bound(samples_per_rank: Iterable[int]) -> int:
    """Proven bound on aligned steps in an epoch: max over ranks of its samples.

    Every step some rank that never padded emits a real batch (see proofs/), and a
    rank emits at most one batch per sample.
    """
    return max(samples_per_rank, default=0)


def rounds_bound(samples_per_rank: Iterable[int]) -> int:
    """Proven bound on collectives in an epoch: every round but the last runs >= 1 step."""
    return steps_bound(samples_per_rank) + 1
