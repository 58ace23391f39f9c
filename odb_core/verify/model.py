"""The global DGAP model: W rank machines, their sources, and the collective.

`init`, `enabled(state)`, `step(state, action)` and `successors(state)` expose all
nondeterminism explicitly: which sample arrives next on a rank (any still pending,
or only the next in order in deterministic mode), when a source is found dry, and
which rank acts next. Every rank decision is made by `RankMachine`; this module
only supplies sources and the all-gather.

The collective is a rendezvous: `AllGather` fires once every rank has contributed
and puts the gathered vectors in every rank's `inbox`; each rank then consumes
its copy in its own `Receive(r)`, so ranks leave the collective, emit their
steps and start the next round at different times, as real ranks do.

Variables mirror spec/DGAP.tla: per rank `phase, exhausted, buffer, ready, steps,
pads, round, emitted, ...` (in `RankSnapshot`), plus `pending` (each rank's source),
`inbox` (a gathered round not yet consumed), `delivered` (real emissions per
sample id), `ledger` (ids carried over by a quota-mode close), per rank the
batch (`step_batches`) and the global counts (`step_counts`) of every step it ran,
and `placement` (with `ModelConfig.any_placement`: the split of the gathered
round's deal, chosen at `AllGather` among all splits of its count).

Adversarial pricing (`any_placement`, the spec's `AnyPlacement`): a round's deal
count is decided from the gathered vectors as always, and `AllGather` branches
over every way of splitting it between the ranks (one successor per split,
labelled `AllGather(a0,a1,...)`); every rank then loads its slice of that agreed
split instead of the one `assign.deal` prices (proofs/dynamic_sharding.md,
"Pricing": safety must not depend on where the ids go).

Priced initial shares (`any_initial_split`, the spec's `AnyInitialSplit`): the
model has one initial state per agreed split of the initial prefix (`inits`): any
cursor `initial_cursors` gives and any split of `initial_splits` of it (any rank
for each id of the prefix), every rank starting on its share of that one split.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple

from odb_core.assign import initial_cursor
from odb_core.collective import Contribution, decide_round
from odb_core.config import ProtocolConfig
from odb_core.errors import ConfigError, ProtocolError
from odb_core.protocol import RankAction, RankMachine, RankPhase, RankSnapshot, RoundResult
from odb_core.sample import Sample


class Action(NamedTuple):
    """One labelled transition. `name` is the spec's action name; `deal`, on an
    `AllGather` of an `any_placement` model, the split of the round's deal chosen."""

    name: str
    rank: int | None = None
    sample: int | None = None
    deal: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        if self.rank is None:
            if self.deal is not None:
                return f"{self.name}({','.join(map(str, self.deal))})"
            return self.name
        if self.sample is None:
            return f"{self.name}({self.rank})"
        return f"{self.name}({self.rank},{self.sample})"


ALL_GATHER = Action("AllGather")


class GlobalState(NamedTuple):
    ranks: tuple[RankSnapshot, ...]
    pending: tuple[frozenset[int], ...]
    inbox: tuple[tuple[Contribution, ...] | None, ...]
    delivered: tuple[int, ...]
    ledger: frozenset[int]
    # Per rank, one entry per step it ran: the batch's ids (empty for a pad), and
    # the step's global (samples, cost tokens, loss tokens) as it decided them.
    step_batches: tuple[tuple[frozenset[int], ...], ...]
    step_counts: tuple[tuple[tuple[int, int, int], ...], ...]
    # any_placement: the agreed split of the gathered round's deal while a rank has
    # yet to consume it; None otherwise (always None without any_placement).
    placement: tuple[int, ...] | None = None

    @property
    def all_done(self) -> bool:
        return all(r.phase is RankPhase.DONE for r in self.ranks)


@dataclass(frozen=True)
class ModelConfig:
    """A protocol config plus the epoch's samples, sharded to ranks.

    `any_placement` (dynamic sharding only): every round's deal is split between
    the ranks by any placement of its count, agreed by all ranks (an adversarial
    pricing; the spec's `AnyPlacement`).

    `any_initial_split` (dynamic sharding only): the ranks start on any agreed split
    of the initial prefix (`GlobalModel.inits`: one initial state per split; the
    spec's `AnyInitialSplit`), as a cost table's prices may split it."""

    protocol: ProtocolConfig
    shards: tuple[tuple[Sample, ...], ...]
    machine: type[RankMachine] = field(default=RankMachine)
    any_placement: bool = False
    any_initial_split: bool = False

    def __post_init__(self) -> None:
        w = self.protocol.world_size
        if len(self.shards) != w:
            raise ConfigError(f"{len(self.shards)} shards for world_size={w}")
        if self.any_placement and not self.protocol.dynamic:
            raise ConfigError("any_placement places the deals of dynamic sharding only")
        if self.any_placement and self.protocol.cost_table is not None:
            raise ConfigError("any_placement replaces a cost table's placement: set no table")
        if self.any_initial_split and not self.protocol.dynamic:
            raise ConfigError(
                "any_initial_split splits the initial shares of dynamic sharding only"
            )
        if self.any_initial_split and self.protocol.cost_table is not None:
            raise ConfigError(
                "any_initial_split replaces a cost table's initial split: set no table"
            )
        ids = [s.id for shard in self.shards for s in shard]
        if sorted(ids) != list(range(len(ids))):
            raise ConfigError(f"sample ids must be exactly 0..{len(ids) - 1}, got {sorted(ids)}")

    @property
    def n_samples(self) -> int:
        return sum(len(s) for s in self.shards)

    @property
    def samples_per_rank(self) -> tuple[int, ...]:
        return tuple(len(s) for s in self.shards)

    def sample(self, sample_id: int) -> Sample:
        return self._by_id[sample_id]

    @property
    def _by_id(self) -> dict[int, Sample]:
        cache: dict[int, Sample] | None = self.__dict__.get("_cache")
        if cache is None:
            cache = {s.id: s for shard in self.shards for s in shard}
            object.__setattr__(self, "_cache", cache)
        return cache


def dynamic_model(
    protocol: ProtocolConfig,
    costs: Sequence[int],
    loss: Sequence[int] | None = None,
    machine: type[RankMachine] = RankMachine,
) -> ModelConfig:
    """A dynamic-sharding model: sample i costs costs[i], the plan is 0..n-1. The
    shards only hold the samples (every rank could be dealt any of them)."""
    from dataclasses import replace

    n = len(costs)
    proto = replace(protocol, plan=tuple(range(n)))
    shards = round_robin_shards(costs, protocol.world_size, loss)
    return ModelConfig(proto, shards, machine=machine)


def round_robin_shards(
    costs: Sequence[int],
    world_size: int,
    loss: Sequence[int] | None = None,
    *,
    visual: Sequence[int] | None = None,
    patches: Sequence[int] | None = None,
) -> tuple[tuple[Sample, ...], ...]:
    """Sample i (cost costs[i], of which visual[i] visual tokens; patches[i]
    patches; loss tokens loss[i], default all its text tokens) goes to rank
    i mod W, like a non-padding DistributedSampler."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size={world_size!r} must be an integer >= 1")
    for name, col in (("loss-token", loss), ("visual-token", visual), ("patch", patches)):
        if col is not None and len(col) != len(costs):
            raise ConfigError(f"{len(col)} {name} counts for {len(costs)} samples")
    vis = visual or [0] * len(costs)
    if any(not 0 <= v <= c for v, c in zip(vis, costs, strict=True)):
        raise ConfigError(f"visual tokens {list(vis)} must be within the costs {list(costs)}")
    return tuple(
        tuple(
            Sample(
                i,
                c - vis[i],
                visual_tokens=vis[i],
                patches=0 if patches is None else patches[i],
                loss_tokens=None if loss is None else loss[i],
            )
            for i, c in enumerate(costs)
            if i % world_size == r
        )
        for r in range(world_size)
    )


class GlobalModel:
    """Composition of W rank machines with synchronous all-gather semantics."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.protocol = config.protocol
        self.world = config.protocol.world_size
        # Rank-local transitions recur across many global states (the state space is
        # roughly a product of rank states), so memoise them per rank snapshot.
        # RankMachine is deterministic given its snapshot and event, so this is exact.
        self._enabled_memo: dict[tuple[int, RankSnapshot], frozenset[RankAction]] = {}
        self._local_memo: dict[tuple[int, RankSnapshot, Action], RankSnapshot] = {}
        self._placed = _placed(config.machine)
        self._receive_memo: dict[
            tuple[int, RankSnapshot, tuple[Contribution, ...], tuple[int, ...] | None],
            tuple[RankSnapshot, RoundResult],
        ] = {}

    def init(self) -> GlobalState:
        """The initial state (a model with `any_initial_split` has several: `inits`)."""
        if self.config.any_initial_split:
            raise ValueError("an any_initial_split model has several initial states: use inits()")
        return self._init()

    def inits(self) -> list[GlobalState]:
        """Every initial state: the one of `init`, or with `any_initial_split` one per
        cursor of `initial_cursors` and split of `initial_splits` (the spec's Init)."""
        if not self.config.any_initial_split:
            return [self._init()]
        base, p = self._init(), self.protocol
        out = []
        for c in initial_cursors(len(p.plan), self.world, p.configured_target):
            for f in initial_splits(c, self.world):
                ranks = tuple(
                    s._replace(
                        queue=tuple(i for i, q in zip(p.plan[:c], f, strict=True) if q == r),
                        cursor=c,
                    )
                    for r, s in enumerate(base.ranks)
                )
                pending = tuple(frozenset(s.queue) for s in ranks)
                out.append(base._replace(ranks=ranks, pending=pending))
        return out

    def _init(self) -> GlobalState:
        if self.protocol.dynamic:
            # The model's machine deals the initial slices (a broken variant its own).
            make = self.config.machine
            fresh = [make(r, self.protocol).snapshot() for r in range(self.world)]
            pending = tuple(frozenset(f.queue) for f in fresh)
        else:
            fresh = [RankMachine(0, self.protocol).snapshot()] * self.world
            pending = tuple(frozenset(s.id for s in shard) for shard in self.config.shards)
        return GlobalState(
            ranks=tuple(fresh),
            pending=pending,
            inbox=(None,) * self.world,
            delivered=(0,) * self.config.n_samples,
            ledger=frozenset(),
            step_batches=((),) * self.world,
            step_counts=((),) * self.world,
        )

    def machine(self, state: GlobalState, rank: int) -> RankMachine:
        return self.config.machine.restore(rank, self.protocol, state.ranks[rank])

    def enabled(self, state: GlobalState) -> list[Action]:
        actions: list[Action] = []
        for r in range(self.world):
            key = (r, state.ranks[r])
            local = self._enabled_memo.get(key)
            if local is None:
                local = self._enabled_memo[key] = self.machine(state, r).enabled()
            if RankAction.OBSERVE in local:
                pending = state.pending[r]
                if pending:
                    if not self.protocol.deterministic:
                        choices = sorted(pending)
                    elif self.protocol.dynamic:
                        choices = [state.ranks[r].queue[0]]  # plan order
                    else:
                        choices = [min(pending)]
                    actions.extend(Action("Observe", r, i) for i in choices)
                else:
                    actions.append(Action("Exhaust", r))
            if RankAction.FORM in local:
                actions.append(Action("Form", r))
            if RankAction.FORM_EARLY in local:
                actions.append(Action("FormEarly", r))
            if RankAction.CONTRIBUTE in local:
                actions.append(Action("Contribute", r))
            if state.inbox[r] is not None:
                actions.append(Action("Receive", r))
        if all(s.phase is RankPhase.WAITING for s in state.ranks) and all(
            i is None for i in state.inbox
        ):
            if self.config.any_placement:
                n = self._deal_total(state)
                actions.extend(Action("AllGather", deal=a) for a in splits(n, self.world))
            else:
                actions.append(ALL_GATHER)
        return actions

    def _deal_total(self, state: GlobalState) -> int:
        """The count of the deal every rank decides from the round about to be
        gathered (all ranks consumed the same rounds: rank 0's view stands for all;
        the spec's DealTotal)."""
        p, rs = self.protocol, state.ranks[0]
        gathered = tuple(r.contribution for r in state.ranks)
        if any(c is None for c in gathered):
            raise ValueError("AllGather while a rank has not contributed")
        d = decide_round(
            p.mode,
            p.quota,
            rs.emitted,
            [c for c in gathered if c is not None],
            plan_left=len(p.plan) - rs.cursor,
            target=p.target,
        )
        return sum(d.assigned)

    def step(self, state: GlobalState, action: Action) -> GlobalState:
        return self.step_with_output(state, action)[0]

    def step_with_output(
        self, state: GlobalState, action: Action
    ) -> tuple[GlobalState, RoundResult | None]:
        """`step`, also returning what a `Receive` emitted (its StepInfos)."""
        if action.name == "AllGather":
            return self._all_gather(state, action.deal), None
        r = action.rank
        if r is None or not 0 <= r < self.world:
            raise ValueError(f"action {action.label} names no valid rank")
        if action.name == "Receive":
            return self._receive(state, r)
        return self._local(state, action, r), None

    def _local(self, state: GlobalState, action: Action, r: int) -> GlobalState:
        pending = state.pending
        if action.name == "Observe":
            if action.sample is None or action.sample not in pending[r]:
                raise ValueError(f"{action.label}: sample not pending on rank {r}")
            pending = _replace(pending, r, pending[r] - {action.sample})
        elif action.name == "Exhaust" and pending[r]:
            raise ValueError(f"{action.label}: rank {r} still has pending samples")
        key = (r, state.ranks[r], action)
        snap = self._local_memo.get(key)
        if snap is None:
            snap = self._local_memo[key] = self._local_step(state, action, r)
        return state._replace(ranks=_replace(state.ranks, r, snap), pending=pending)

    def _local_step(self, state: GlobalState, action: Action, r: int) -> RankSnapshot:
        m = self.machine(state, r)
        if action.name == "Observe":
            assert action.sample is not None
            m.observe(self.config.sample(action.sample))
        elif action.name == "Exhaust":
            m.exhaust()
        elif action.name == "Form":
            m.form()
        elif action.name == "FormEarly":
            m.form_early()
        elif action.name == "Contribute":
            m.contribute()
        else:
            raise ValueError(f"unknown action {action.label}")
        return m.snapshot()

    def successors(self, state: GlobalState) -> Iterator[tuple[Action, GlobalState]]:
        for a in self.enabled(state):
            yield a, self.step(state, a)

    def _all_gather(self, state: GlobalState, deal: tuple[int, ...] | None) -> GlobalState:
        contributions = []
        for r in range(self.world):
            c = self.machine(state, r).contribution
            if c is None or state.inbox[r] is not None:
                raise ValueError(f"AllGather while rank {r} is not waiting on a fresh round")
            contributions.append(c)
        gathered = tuple(contributions)
        if self.config.any_placement:
            if deal is None or deal not in splits(self._deal_total(state), self.world):
                raise ValueError(f"AllGather with {deal!r}: not a split of the round's deal")
        elif deal is not None:
            raise ValueError("AllGather names a placement, but the model has any_placement off")
        return state._replace(inbox=(gathered,) * self.world, placement=deal)

    def _receive(self, state: GlobalState, r: int) -> tuple[GlobalState, RoundResult]:
        gathered = state.inbox[r]
        if gathered is None:
            raise ValueError(f"Receive({r}) with an empty inbox")
        key = (r, state.ranks[r], gathered, state.placement)
        memo = self._receive_memo.get(key)
        if memo is None:
            m = self.machine(state, r)
            if state.placement is not None:
                placed = self._placed.restore(r, self.protocol, state.ranks[r])
                assert isinstance(placed, _Placed)
                placed.placement = state.placement
                m = placed
            result = m.all_gather(gathered)
            memo = self._receive_memo[key] = (m.snapshot(), result)
        snap, result = memo
        delivered = list(state.delivered)
        for info in result.steps:
            for i in info.sample_ids:
                delivered[i] += 1
        ledger = state.ledger | {s.id for s in result.carried}
        pending = state.pending
        if self.protocol.dynamic:
            # The rank loads what the round dealt it.
            pending = _replace(pending, r, frozenset(snap.queue))
        if result.done:
            # Unarrived samples of a closed quota epoch are carried too (with dynamic
            # sharding, also the plan ids no rank was dealt).
            ledger = ledger | pending[r] | frozenset(self.protocol.plan[snap.cursor :])
            pending = _replace(pending, r, frozenset())
            # The spec's closed rank holds nothing: its unread ids went to the ledger,
            # so the snapshot keeps none either (the spec has no other copy of them).
            snap = snap._replace(queue=())
        batches = tuple(frozenset(info.sample_ids) for info in result.steps)
        counts = tuple(
            (info.global_samples, info.global_tokens, info.global_loss_tokens)
            for info in result.steps
        )
        inbox = _replace(state.inbox, r, None)
        return GlobalState(
            _replace(state.ranks, r, snap),
            pending,
            inbox,
            tuple(delivered),
            ledger,
            _replace(state.step_batches, r, state.step_batches[r] + batches),
            _replace(state.step_counts, r, state.step_counts[r] + counts),
            # The agreed placement is dropped once the last rank has loaded its slice.
            None if all(i is None for i in inbox) else state.placement,
        ), result


def initial_cursors(plan_len: int, world: int, target: int) -> tuple[int, ...]:
    """Every cursor the initial shares may end at (the spec's InitialCursors):
    `assign.initial_cursor` without a cost table and with one."""
    return tuple(sorted({initial_cursor(plan_len, world, target, priced=p) for p in (False, True)}))


def initial_splits(cursor: int, world: int) -> list[tuple[int, ...]]:
    """Every split of the initial prefix [0, cursor) between `world` ranks, as the rank
    each position starts on (the spec's InitialSplits(c), a rank f[i] for every id of
    the prefix): every placement a cost table's prices can choose
    (`cost_table.placed`), every cut into consecutive slices, and more."""
    return list(itertools.product(range(world), repeat=cursor))


@cache
def splits(n: int, world: int) -> tuple[tuple[int, ...], ...]:
    """Every split of n ids between `world` ranks (the spec's Placements(n))."""
    if world == 1:
        return ((n,),)
    return tuple((a, *rest) for a in range(n + 1) for rest in splits(n - a, world - 1))


class _Placed(RankMachine):
    """A rank that loads its slice of an agreed placement instead of the deal's own
    split (`any_placement`): `placement` is set before `all_gather`."""

    placement: tuple[int, ...] = ()

    def _dealt_slice(self, assigned: tuple[int, ...]) -> tuple[int, int]:
        if sum(self.placement) != sum(assigned):
            raise ProtocolError(
                f"rank {self.rank}: placement {self.placement} does not split the deal {assigned}"
            )
        start = self.cursor + sum(self.placement[: self.rank])
        return start, start + self.placement[self.rank]


def _placed(machine: type[RankMachine]) -> type[_Placed]:
    """`machine` (the model's rank machine, perhaps a broken variant) loading its
    slice of the agreed placement."""
    if issubclass(machine, _Placed):
        return machine
    return type(f"Placed{machine.__name__}", (_Placed, machine), {})


def _replace(t: tuple, i: int, v: object) -> tuple:  # type: ignore[type-arg]
    return (*t[:i], v, *t[i + 1 :])
