"""Deliberately broken protocol variants, one per guarantee.

Each variant changes one rule of `RankMachine`. The checker must report a
counterexample for the property named in `BugVariant.violates`; the tests and
`odb check --bug NAME` show it, so no guarantee is vacuously true (the habit of
MongoDB's *_bug.cfg models).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import replace

from odb_core.assign import initial_cursor, initial_slices, priced_shares
from odb_core.batch import Batch
from odb_core.collective import Contribution
from odb_core.config import Mode, ProtocolConfig, Sharding
from odb_core.cost import Budget
from odb_core.formers import FormResult
from odb_core.protocol import RankAction, RankMachine, RankPhase, RoundResult
from odb_core.sample import Sample
from odb_core.verify.model import ModelConfig, dynamic_model, round_robin_shards


class SilentStop(RankMachine):
    """A rank that runs dry stops without telling the others."""

    def contribute(self) -> Contribution:
        c = super().contribute()
        if c.final and c.offered == 0:
            self.phase = RankPhase.DONE
        return c


class NoPads(RankMachine):
    """Each rank runs only the steps it has real batches for: no pad steps."""

    def all_gather(self, contributions: Sequence[Contribution]) -> RoundResult:
        result = super().all_gather(contributions)
        real = tuple(s for s in result.steps if not s.is_pad)
        self.steps -= len(result.steps) - len(real)
        self.pads -= len(result.steps) - len(real)
        return result._replace(steps=real)


class DropLeftovers(RankMachine):
    """The former's leftovers are discarded instead of carried to the next window."""

    def form(self) -> list[Batch]:
        batches = super().form()
        self.buffer = {}
        return batches


class PadRepeatsBatch(RankMachine):
    """A pad step re-emits the round's first real batch as if it were real."""

    def all_gather(self, contributions: Sequence[Contribution]) -> RoundResult:
        result = super().all_gather(contributions)
        real = [s for s in result.steps if not s.is_pad]
        if not real:
            return result
        first = real[0]
        steps = tuple(
            replace(
                s,
                is_pad=False,
                batch=first.batch,
                local_samples=first.local_samples,
                local_tokens=first.local_tokens,
            )
            if s.is_pad
            else s
            for s in result.steps
        )
        return result._replace(steps=steps)


class FormKeepsWindow(RankMachine):
    """The former's batches are not removed from the window, so they form again."""

    def form(self) -> list[Batch]:
        window = dict(self.buffer)
        batches = super().form()
        self.buffer = window
        return batches


class QuotaForgetsLedger(RankMachine):
    """A quota-mode close discards what was not emitted instead of carrying it."""

    def all_gather(self, contributions: Sequence[Contribution]) -> RoundResult:
        return super().all_gather(contributions)._replace(carried=())


class IgnoreBudget(RankMachine):
    """The former packs the whole window into one batch, budget or not."""

    def form(self) -> list[Batch]:
        self._require(RankAction.FORM)
        batch = Batch(tuple(sorted(self.buffer.values())))
        self.ready.append(batch)
        self.buffer = {}
        return [batch]


class EagerContribute(RankMachine):
    """A rank may enter the collective before it has formed a batch, so rounds can
    agree on zero steps and an epoch can take unboundedly many collectives."""

    def enabled(self) -> frozenset[RankAction]:
        base = super().enabled()
        if self.phase is RankPhase.FILLING and RankAction.OBSERVE in base:
            return base | {RankAction.CONTRIBUTE}
        return base


class LossByCost(RankMachine):
    """The vector carries each batch's cost tokens where its loss tokens belong, so
    masked prompt tokens are counted in the loss normalisation."""

    def _make_contribution(self) -> Contribution:
        c = super()._make_contribution()
        return c._replace(loss_tokens=c.tokens)


class WindowByLocal(RankMachine):
    """An optimizer window closes when this rank's own loss tokens reach the target,
    not the window's global ones: ranks step their optimizers at different steps."""

    def _window_closes(self) -> bool:
        target = self.config.tokens_per_update
        if target is None:
            return super()._window_closes()
        return self.window_local >= target


class CarryNotFirst(RankMachine):
    """Quota mode: carried ids are formed like fresh ones (the former before
    issue 11): longest first, so a short carried sample is left over behind the
    fresh arrivals, pass after pass."""

    def _run_former(self, window: list[Sample], flush: bool) -> FormResult:
        c = self.config
        return self._former(window, c.budget, c.cost_model, flush)


class DealOverlaps(RankMachine):
    """Dynamic sharding: a rank loads its share of the deal from the cursor on,
    ignoring the slices of the lower ranks, so two ranks are assigned one id."""

    def _dealt_slice(self, assigned: tuple[int, ...]) -> tuple[int, int]:
        return self.cursor, self.cursor + assigned[self.rank]


class RankLocalPlacement(RankMachine):
    """Dynamic sharding: each rank places the round's deal by its own pricing, by
    which its own held work is the least, so it takes the whole deal: every split is
    one of the deal's count, but the ranks' splits differ, and two ranks load one id
    (spec/DGAPBugs.tla `rank-local-placement`: each rank any split of its own)."""

    def _dealt_slice(self, assigned: tuple[int, ...]) -> tuple[int, int]:
        return self.cursor, self.cursor + sum(assigned)


class RankLocalInitialSplit(RankMachine):
    """Dynamic sharding: each rank places the initial prefix by prices of its own (rank
    0 prices every id alike, a later rank its first id dearer), so the ranks' shares
    are not one split of the prefix: rank 0 takes two ids where the others' split
    gives it one, and an id starts on two ranks (spec/DGAPBugs.tla
    `rank-local-initial-split`: each rank any split of its own)."""

    def __init__(self, rank: int, config: ProtocolConfig) -> None:
        super().__init__(rank, config)
        n, w = len(config.plan), config.world_size
        c = initial_cursor(n, w, config.configured_target, priced=True)
        prices = [1 + (rank * c if k == 0 else 0) for k in range(c)]
        sizes = [len(share) for share in priced_shares(prices, range(c), w)]
        own = initial_slices(n, w, config.configured_target, sizes)
        start, stop = own[rank]
        self.queue = dict.fromkeys(config.plan[start:stop])
        self.cursor = own[-1][1]


class BugVariant(enum.Enum):
    SILENT_STOP = "silent-stop"
    NO_PADS = "no-pads"
    DROP_LEFTOVERS = "drop-leftovers"
    PAD_REPEATS_BATCH = "pad-repeats-batch"
    FORM_KEEPS_WINDOW = "form-keeps-window"
    QUOTA_FORGETS_LEDGER = "quota-forgets-ledger"
    IGNORE_BUDGET = "ignore-budget"
    EAGER_CONTRIBUTE = "eager-contribute"
    LOSS_BY_COST = "loss-by-cost"
    WINDOW_BY_LOCAL = "window-by-local"
    CARRY_NOT_FIRST = "carry-not-first"
    DEAL_OVERLAPS = "deal-overlaps"
    RANK_LOCAL_PLACEMENT = "rank-local-placement"
    RANK_LOCAL_INITIAL_SPLIT = "rank-local-initial-split"

    @property
    def machine(self) -> type[RankMachine]:
        return _MACHINES[self]

    @property
    def violates(self) -> str:
        """The guarantee whose counterexample this variant must produce."""
        return _VIOLATES[self]

    @property
    def mode(self) -> Mode:
        quota = (BugVariant.QUOTA_FORGETS_LEDGER, BugVariant.CARRY_NOT_FIRST)
        return Mode.QUOTA if self in quota else Mode.JOIN

    @property
    def dynamic(self) -> bool:
        """A bug of dynamic sharding (`Sharding.DYNAMIC`): its model deals the plan.
        spec/DGAP.tla models it too (`Dynamic`; `MCdeal_overlaps_bug`,
        `MCrank_local_placement_bug`, `MCrank_local_initial_split_bug`)."""
        return self in (
            BugVariant.DEAL_OVERLAPS,
            BugVariant.RANK_LOCAL_PLACEMENT,
            BugVariant.RANK_LOCAL_INITIAL_SPLIT,
        )

    @property
    def passes(self) -> int:
        """Passes a check must run to see the bug: 2 for a cross-epoch property,
        which `odb_core.verify.fairness.check_passes` checks (not `checker.check`)."""
        return 2 if self is BugVariant.CARRY_NOT_FIRST else 1

    def model(self) -> ModelConfig:
        """A small configuration on which the checker finds this bug."""
        costs, world, buffer = _SMALL_MODEL.get(self, ((1, 2, 3, 1, 2, 3), 3, 2))
        protocol = ProtocolConfig(
            world_size=world,
            budget=Budget(4),
            buffer_size=buffer,
            mode=self.mode,
            max_steps_per_round=2,
            tokens_per_update=_TOKENS_PER_UPDATE.get(self),
            quota=_QUOTA.get(self),
        )
        # Loss tokens below the cost (a masked first token, as causal LM labels have),
        # so counting the cost instead shows.
        loss = [max(c - 1, 0) for c in costs]
        if self.dynamic:
            target = _TARGET.get(self, 2)
            dynamic = replace(protocol, sharding=Sharding.DYNAMIC, assign_target=target)
            return dynamic_model(dynamic, costs, loss, machine=self.machine)
        return ModelConfig(protocol, round_robin_shards(costs, world, loss), machine=self.machine)


# A pad next to a real batch in one round needs a rank that ends with fewer
# batches than another final rank: rank 0 gets costs 3,3 (two batches), rank 1
# costs 3,1 (one batch).
_SMALL_MODEL: dict[BugVariant, tuple[tuple[int, ...], int, int]] = {
    BugVariant.PAD_REPEATS_BATCH: ((3, 3, 3, 1), 2, 3),
    # Rank 0's samples carry a loss token each, rank 1's none: by local counts only
    # rank 0 ever closes a window.
    BugVariant.WINDOW_BY_LOCAL: ((2, 1, 2, 1, 2, 1), 2, 1),
}


# Two ranks: both are starved in the first round, and each takes the whole deal.
_SMALL_MODEL[BugVariant.RANK_LOCAL_PLACEMENT] = ((1, 2, 3, 1, 2, 3), 2, 2)

# Target 3 on 4 ids: the deal target is 2 and 2 x 2 >= 4, so a priced split covers
# the whole plan; rank 0 (by squares) takes [0, 3), rank 1 (by count) [2, 4).
_SMALL_MODEL[BugVariant.RANK_LOCAL_INITIAL_SPLIT] = ((3, 1, 2, 1), 2, 2)
_TARGET: dict[BugVariant, int] = {BugVariant.RANK_LOCAL_INITIAL_SPLIT: 3}

_TOKENS_PER_UPDATE: dict[BugVariant, int] = {BugVariant.WINDOW_BY_LOCAL: 2}

# Pass 1 can close at quota 3 carrying only id 4 (rank 0); pass 2 forms rank 0's
# fresh id 0 (as long, a lower id) first, leaves 4 over and meets the quota without it.
_SMALL_MODEL[BugVariant.CARRY_NOT_FIRST] = ((4, 1, 4, 4, 4, 1), 2, 2)
_QUOTA: dict[BugVariant, int] = {BugVariant.CARRY_NOT_FIRST: 3}

_MACHINES: dict[BugVariant, type[RankMachine]] = {
    BugVariant.SILENT_STOP: SilentStop,
    BugVariant.NO_PADS: NoPads,
    BugVariant.DROP_LEFTOVERS: DropLeftovers,
    BugVariant.PAD_REPEATS_BATCH: PadRepeatsBatch,
    BugVariant.FORM_KEEPS_WINDOW: FormKeepsWindow,
    BugVariant.QUOTA_FORGETS_LEDGER: QuotaForgetsLedger,
    BugVariant.IGNORE_BUDGET: IgnoreBudget,
    BugVariant.EAGER_CONTRIBUTE: EagerContribute,
    BugVariant.LOSS_BY_COST: LossByCost,
    BugVariant.WINDOW_BY_LOCAL: WindowByLocal,
    BugVariant.CARRY_NOT_FIRST: CarryNotFirst,
    BugVariant.DEAL_OVERLAPS: DealOverlaps,
    BugVariant.RANK_LOCAL_PLACEMENT: RankLocalPlacement,
    BugVariant.RANK_LOCAL_INITIAL_SPLIT: RankLocalInitialSplit,
}

_VIOLATES: dict[BugVariant, str] = {
    BugVariant.SILENT_STOP: "DeadlockFreedom",
    BugVariant.NO_PADS: "StepAlignment",
    BugVariant.DROP_LEFTOVERS: "NoLoss",
    BugVariant.PAD_REPEATS_BATCH: "NoDuplicate",
    BugVariant.FORM_KEEPS_WINDOW: "NoDuplicate",
    BugVariant.QUOTA_FORGETS_LEDGER: "QuotaClosure",
    BugVariant.IGNORE_BUDGET: "BudgetSafety",
    BugVariant.EAGER_CONTRIBUTE: "BoundedTermination",
    BugVariant.LOSS_BY_COST: "ExactLossScaling",
    BugVariant.WINDOW_BY_LOCAL: "WindowAlignment",
    BugVariant.CARRY_NOT_FIRST: "CrossEpochFairness",
    BugVariant.DEAL_OVERLAPS: "NoDuplicate",
    BugVariant.RANK_LOCAL_PLACEMENT: "NoDuplicate",
    BugVariant.RANK_LOCAL_INITIAL_SPLIT: "NoDuplicate",
}
