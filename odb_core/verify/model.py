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
sample id), `ledger` (ids carried over by a quota-mode close), and per rank the
batch (`step_batches`) and the global counts (`step_counts`) of every step it ran.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from odb_core.config import ProtocolConfig
from odb_core.errors import ConfigError
from odb_core.protocol import (
    Contribution,
    RankAction,
    RankMachine,
    RankPhase,
    RankSnapshot,
    RoundResult,
)
from odb_core.sample import Sample


class Action(NamedTuple):
    """One labelled transition. `name` is the spec's action name."""

    name: str
    rank: int | None = None
    sample: int | None = None

    @property
    def label(self) -> str:
        if self.rank is None:
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

    @property
    def all_done(self) -> bool:
        return all(r.phase is RankPhase.DONE for r in self.ranks)


@dataclass(frozen=True)
class ModelConfig:
    """A protocol config plus the epoch's samples, sharded to ranks."""

    protocol: ProtocolConfig
    shards: tuple[tuple[Sample, ...], ...]
    machine: type[RankMachine] = field(default=RankMachine)

    def __post_init__(self) -> None:
        w = self.protocol.world_size
        if len(self.shards) != w:
            raise ConfigError(f"{len(self.shards)} shards for world_size={w}")
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
        self._receive_memo: dict[
            tuple[int, RankSnapshot, tuple[Contribution, ...]], tuple[RankSnapshot, RoundResult]
        ] = {}

    def init(self) -> GlobalState:
        if self.protocol.dynamic:
            fresh = [RankMachine(r, self.protocol).snapshot() for r in range(self.world)]
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
            actions.append(ALL_GATHER)
        return actions

    def step(self, state: GlobalState, action: Action) -> GlobalState:
        return self.step_with_output(state, action)[0]

    def step_with_output(
        self, state: GlobalState, action: Action
    ) -> tuple[GlobalState, RoundResult | None]:
        """`step`, also returning what a `Receive` emitted (its StepInfos)."""
        if action.name == "AllGather":
            return self._all_gather(state), None
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

    def _all_gather(self, state: GlobalState) -> GlobalState:
        contributions = []
        for r in range(self.world):
            c = self.machine(state, r).contribution
            if c is None or state.inbox[r] is not None:
                raise ValueError(f"AllGather while rank {r} is not waiting on a fresh round")
            contributions.append(c)
        gathered = tuple(contributions)
        return state._replace(inbox=(gathered,) * self.world)

    def _receive(self, state: GlobalState, r: int) -> tuple[GlobalState, RoundResult]:
        gathered = state.inbox[r]
        if gathered is None:
            raise ValueError(f"Receive({r}) with an empty inbox")
        key = (r, state.ranks[r], gathered)
        memo = self._receive_memo.get(key)
        if memo is None:
            m = self.machine(state, r)
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
        batches = tuple(frozenset(info.sample_ids) for info in result.steps)
        counts = tuple(
            (info.global_samples, info.global_tokens, info.global_loss_tokens)
            for info in result.steps
        )
        return GlobalState(
            _replace(state.ranks, r, snap),
            pending,
            _replace(state.inbox, r, None),
            tuple(delivered),
            ledger,
            _replace(state.step_batches, r, state.step_batches[r] + batches),
            _replace(state.step_counts, r, state.step_counts[r] + counts),
        ), result


def _replace(t: tuple, i: int, v: object) -> tuple:  # type: ignore[type-arg]
    return (*t[:i], v, *t[i + 1 :])
