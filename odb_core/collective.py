"""The round's collective: what each rank puts into the all-gather (`Contribution`,
its fixed-width vector) and what every rank derives from the gathered vectors,
identically (`decide_round`: the round's steps, whether the epoch closes, and with
dynamic sharding the deal). spec/DGAP.tla's `Offer` and `Decide`. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from odb_core.assign import Pricing, deal
from odb_core.config import Mode
from odb_core.errors import ODBPeerError, ProtocolError


class Contribution(NamedTuple):
    """What one rank puts into the round's all-gather.

    `offered`: steps this rank can fill with real batches (<= M).
    `final`: the rank's source is dry and the offered batches are all it has.
    `samples[t]`, `tokens[t]`, `loss_tokens[t]`: size of the t-th offered batch
    (real samples, cost tokens, tokens whose loss counts), for exact global loss
    normalisation and window boundaries without a second collective.

    Dynamic sharding only (`Sharding.DYNAMIC`, 0 otherwise): `unread` ids assigned
    to this rank and not yet observed; `held` samples and `held_work` cost tokens
    this rank holds beyond the offered batches (its window and later ready
    batches). Every rank deals the next plan ids from these (`odb_core.assign`).
    """

    offered: int
    final: bool
    samples: tuple[int, ...]
    tokens: tuple[int, ...]
    loss_tokens: tuple[int, ...]
    unread: int = 0
    held: int = 0
    held_work: int = 0

    def to_vector(self, max_steps: int, dynamic: bool = False) -> list[int]:
        pad = [0] * (max_steps - self.offered)
        tail = [self.unread, self.held, self.held_work] if dynamic else []
        return [
            self.offered,
            int(self.final),
            *self.samples,
            *pad,
            *self.tokens,
            *pad,
            *self.loss_tokens,
            *pad,
            *tail,
        ]

    @staticmethod
    def vector_length(max_steps: int, dynamic: bool = False) -> int:
        return 2 + 3 * max_steps + (3 if dynamic else 0)

    @staticmethod
    def from_vector(vector: Sequence[int], max_steps: int, dynamic: bool = False) -> Contribution:
        expected = Contribution.vector_length(max_steps, dynamic)
        if len(vector) != expected:
            raise ODBPeerError(f"all-gather vector of length {len(vector)}, expected {expected}")
        offered, final = int(vector[0]), int(vector[1])
        if not 0 <= offered <= max_steps or final not in (0, 1):
            raise ODBPeerError(f"malformed all-gather vector {list(vector)!r}")

        def column(j: int) -> tuple[int, ...]:
            start = 2 + j * max_steps
            return tuple(int(x) for x in vector[start : start + offered])

        held: tuple[int, ...] = ()
        if dynamic:
            held = tuple(int(x) for x in vector[2 + 3 * max_steps :])
            if any(x < 0 for x in held):
                raise ODBPeerError(f"malformed all-gather vector {list(vector)!r}")
        return Contribution(offered, bool(final), column(0), column(1), column(2), *held)


class RoundDecision(NamedTuple):
    """What every rank derives, identically, from one all-gather."""

    steps: int
    done: bool
    global_samples: tuple[int, ...]
    global_tokens: tuple[int, ...]
    global_loss_tokens: tuple[int, ...]
    assigned: tuple[int, ...] = ()
    """Dynamic sharding: how many of the next plan ids each rank loads, in rank order."""


def decide_round(
    mode: Mode,
    quota: int | None,
    emitted_before: int,
    contributions: Sequence[Contribution],
    *,
    plan_left: int | None = None,
    target: int = 0,
    pricing: Pricing | None = None,
) -> RoundDecision:
    """The collective semantics: how many aligned steps this round runs, and whether
    the epoch closes after them. Pure, so every rank computes the same answer.

    join:  k = min offered over ranks that are not final (each of them can fill
           every step); when all are final, k = max offered and the epoch ends.
           A final rank with fewer than k batches pads.
    quota: k = min offered over all ranks (no pads); the epoch ends when a final
           rank empties (first rank runs dry) or, at the exact step, when the
           global sample count reaches the quota.
    dynamic sharding (`plan_left` given: plan ids not dealt yet): unless the epoch
           closes, the next plan ids are dealt by `odb_core.assign.deal`.
    """
    if not contributions:
        raise ProtocolError("decide_round needs the contribution of every rank, got none")
    if mode is Mode.JOIN:
        open_offers = [c.offered for c in contributions if not c.final]
        if open_offers:
            k, done = min(open_offers), False
        else:
            k, done = max(c.offered for c in contributions), True
    else:
        k = min(c.offered for c in contributions)
        done = any(c.final and c.offered == k for c in contributions)
    gs = tuple(sum(c.samples[t] for c in contributions if t < c.offered) for t in range(k))
    gt = tuple(sum(c.tokens[t] for c in contributions if t < c.offered) for t in range(k))
    gl = tuple(sum(c.loss_tokens[t] for c in contributions if t < c.offered) for t in range(k))
    if mode is Mode.QUOTA and quota is not None:
        total = emitted_before
        for t in range(k):
            total += gs[t]
            if total >= quota:
                k, done = t + 1, True
                gs, gt, gl = gs[:k], gt[:k], gl[:k]
                break
    assigned: tuple[int, ...] = ()
    if plan_left is not None and not done:
        if pricing is None:
            assigned = deal(contributions, k, plan_left, target)
        else:
            assigned = deal(contributions, k, plan_left, target, pricing)
    return RoundDecision(k, done, gs, gt, gl, assigned)
