"""Dynamic sharding: which rank loads the next ids of the epoch's plan.

With `Sharding.DYNAMIC` no rank owns a fixed 1/W of the epoch. The epoch has one
plan (an ordered tuple of sample ids, the same on every rank). Each rank starts
with a contiguous `initial_share` of it (with a learned cost table, the plan's
prefix placed by price so that every rank starts on about equal priced work:
`priced_shares`, `initial_slices`); after that, every round's all-gather
carries what each rank holds (`Contribution.unread`, `.held`, `.held_work`), and
every rank deals the next plan positions with the same pure `deal`, so all ranks
agree on who loads which id without a further collective, and no sample ever
moves between ranks.

The rule is longest-processing-time list scheduling with unknown job sizes: the
round deals as many ids as the ranks lack to hold `target` samples each (but,
in a round that runs steps, at most half of the plan left: `deal_cap`), one at
a time, each to the rank whose held work (known costs of its window and ready
batches, plus its unread ids priced at the gathered mean cost) is least, ties to
the lower rank. A rank that holds expensive samples therefore gets fewer new
ids, and when the plan runs out every rank holds about the same work
(proofs/dynamic_tail.md). The deal is a function of the gathered vectors and
the round's agreed step count only: determinism and resume are unaffected.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol


class Contribution(Protocol):
    """The fields of `odb_core.collective.Contribution` the deal reads (typed here so
    that this module imports nothing of the core)."""

    @property
    def offered(self) -> int: ...
    @property
    def final(self) -> bool: ...
    @property
    def samples(self) -> tuple[int, ...]: ...
    @property
    def tokens(self) -> tuple[int, ...]: ...
    @property
    def unread(self) -> int: ...
    @property
    def held(self) -> int: ...
    @property
    def held_work(self) -> int: ...


def deal_target(plan_len: int, world: int, target: int) -> int:
    """The samples each rank is topped up to per round, from the configured `target`
    T (the window K unless set): T, but no more than the half split
    `plan_len // (2 * world)` and no less than half of T.

    Why the half split: the initial shares hold back at least half of the plan, to
    be dealt by measured cost; a target above the initial share would deal most of
    that half in the first round, to every rank at once, priced by the few costs
    known then (docs/SIMULATOR.md, "Dynamic sharding"). With the target equal to
    the initial share, every deal after the first replaces what the round's steps
    took, and the held-back half goes out over the epoch. Why not under half of T:
    a rank topped up to fewer samples than half a window rarely closes a batch
    before it is starved, and rounds without steps wait for the slowest rank's
    preprocessing. Quantities every rank knows; never the workload's costs.
    """
    return min(target, max(plan_len // (2 * world), -(-target // 2)))


def deal_cap(plan_left: int, world: int, steps: int) -> int:
    """The most ids one round may deal: half of the plan left, rounded up, once the
    round runs steps and more than two ids a rank are left; else all of it.

    Factoring (Hummel, Schonberg and Flynn, CACM 1992): with job sizes unknown
    until run, hand out half of the remaining work per batch, so that the last
    batches are small. Here the cost of a dealt id is known only after its rank
    has preprocessed it, so a deal is priced at the mean; the ids of the deal that
    empties the plan are never corrected by a later one, and their misprice is
    the spread of the ranks' finish. Halving makes that last deal at most 2W ids
    (two a rank), and every earlier half is corrected by the costs observed before
    the next. A round without steps waits on preprocessing anyway (a starved rank
    offered nothing), so it deals all it wants: halving there only adds barriers
    (docs/SIMULATOR.md, "Dynamic sharding").
    """
    if steps > 0 and plan_left > 2 * world:
        return (plan_left + 1) // 2
    return plan_left


def initial_share(plan_len: int, world: int, target: int) -> int:
    """Ids each rank loads before its first round: `target`, but at most half of
    an even split, so at least half of the plan is dealt by measured cost. The same
    with the configured target T0 or the deal target (`deal_target`, which is T0
    bounded below by half of it and above by no less than the half split); the
    functions below take T0, the spec's `Target`."""
    return max(1, min(target, plan_len // (2 * world)))


def initial_slice(rank: int, plan_len: int, world: int, target: int) -> tuple[int, int]:
    """Plan positions [start, stop) rank `rank` loads before its first round."""
    c = initial_share(plan_len, world, target)
    return min(rank * c, plan_len), min((rank + 1) * c, plan_len)


def initial_cursor(plan_len: int, world: int, target: int, priced: bool = False) -> int:
    """The first plan position not dealt by the initial shares; `priced`: a learned
    cost table places them (`priced_shares`), which deals the whole plan up front when
    a rank's share of it fits its configured target `target` (the window unless set:
    `world * target >= plan_len`). Held back, those ids would come in rounds of
    about the same size to ranks that wait for each round's ids to be read and form
    their one window in parts; placed at once, a rank reads its share as one stream
    and forms it once (docs/SIMULATOR.md, "The cost table learned online")."""
    if priced and world * target >= plan_len:
        return plan_len
    return min(world * initial_share(plan_len, world, target), plan_len)


def initial_slices(
    plan_len: int,
    world: int,
    target: int,
    sizes: Sequence[int] | None = None,
) -> tuple[tuple[int, int], ...]:
    """Every rank's initial plan positions [start, stop), in rank order: consecutive,
    contiguous slices covering [0, initial_cursor) once. Pure: every rank computes
    the same tuple from agreed state.

    Without a table (`sizes` None): `initial_share` ids a rank (`initial_slice`).

    With a learned cost table the plan's prefix is placed first (`priced_shares`, through
    `cost_table.placed`): reordered so that each rank's priced share of it is one run
    of the plan, and `sizes` are the runs' lengths, in rank order. The prefix is then
    the whole plan when a rank's share of it fits the configured target (`world *
    target >= plan_len`, `initial_cursor`). D1 and D2 need only that every rank
    computes the same slices (proofs/dynamic_sharding.md, "Pricing").
    """
    if sizes is None:
        return tuple(initial_slice(r, plan_len, world, target) for r in range(world))
    c = initial_cursor(plan_len, world, target, priced=True)
    if len(sizes) != world or sum(sizes) != c or min(sizes, default=0) < 0:
        raise ValueError(
            f"sizes {tuple(sizes)!r} do not split {c} plan positions over {world} ranks"
        )
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return tuple(out)


def priced_shares(
    prices: Sequence[int], keys: Sequence[int], world: int
) -> tuple[tuple[int, ...], ...]:
    """The ranks' shares of a priced plan prefix: positions 0..len-1, in rank order,
    each rank's in plan order. Longest-processing-time list scheduling (Graham,
    "Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math. 17(2), 1969):
    positions are taken dearest first (ties: the lower key) and each goes to the rank
    of least priced work so far (ties: the rank of fewer ids, then the lower rank). So
    any two ranks' priced work differs by at most the dearest price, where a split
    into contiguous runs of the plan is off by up to a whole id at every cut; and
    every rank gets an id while there is one a rank.

    The shares depend only on the (key, price) pairs, not on their order: placing a
    placed prefix gives the same shares again, so a placed plan is a fixed point
    (`cost_table.placed`).
    """
    if len(prices) != len(keys):
        raise ValueError(f"{len(prices)} prices for {len(keys)} keys")
    order = sorted(range(len(prices)), key=lambda k: (-prices[k], keys[k]))
    heap = [(0, 0, r) for r in range(world)]
    shares: list[list[int]] = [[] for _ in range(world)]
    for k in order:
        work, count, r = heapq.heappop(heap)
        shares[r].append(k)
        heapq.heappush(heap, (work + prices[k], count + 1, r))
    return tuple(tuple(sorted(s)) for s in shares)


class Pricing(NamedTuple):
    """What a learned cost table (`odb_core.cost_table`) says of the round's ids, from
    agreed state only: every rank computes the same `Pricing`.

    `unread[r]`: rank r's unread ids as (priced cost of those the table knows, count
    of those it does not). `upcoming(k)`: the priced cost of the k-th plan id after
    the cursor, None when unseen. `mean`: the table's mean priced cost (>= 1), which
    prices unseen ids while no rank holds a sample.
    """

    unread: Sequence[tuple[int, int]]
    upcoming: Callable[[int], int | None]
    mean: int


def deal(
    contributions: Sequence[Contribution],
    steps: int,
    plan_left: int,
    target: int,
    pricing: Pricing | None = None,
) -> tuple[int, ...]:
    """How many of the next `plan_left` plan ids each rank loads, in rank order
    (rank r takes the slice after those of ranks < r).

    `steps` is the round's agreed step count: batches a rank offered beyond it stay
    held. Pure and integer-only, so every rank computes the same tuple.

    A round that runs steps deals at most half of the plan left (`deal_cap`).

    `pricing` (a learned cost table, optional) changes only how the round's ids are
    split between the ranks (`_level`), never how many are dealt: the count is
    decided above it from the gathered vectors alone, so the ids dealt are the same
    whatever the table holds (proofs/dynamic_sharding.md, "Pricing").
    """
    plan_left = deal_cap(plan_left, len(contributions), steps)
    counts: list[int] = []
    work: list[int] = []
    for c in contributions:
        n, w = c.held + c.unread, c.held_work
        for t in range(min(steps, c.offered), c.offered):
            n += c.samples[t]
            w += c.tokens[t]
        counts.append(n)
        work.append(w)
    out = [0] * len(contributions)
    # A rank that offered nothing and is not final is starved: it gets an id first,
    # so a round without steps always deals (and the epoch progresses).
    for r, c in enumerate(contributions):
        if c.offered == 0 and not c.final and plan_left > 0:
            out[r] += 1
            plan_left -= 1
    want = sum(max(0, target - n - out[r]) for r, n in enumerate(counts))
    total = min(plan_left, want)
    if total <= 0:
        return tuple(out)
    # The mean cost of a held sample over all ranks prices the unread ids; scaled by
    # the held count so that everything stays an integer.
    held_n = sum(
        c.held + sum(c.samples[t] for t in range(min(steps, c.offered), c.offered))
        for c in contributions
    )
    held_w = sum(work)
    if pricing is not None:
        return _level(contributions, work, out, total, held_n, held_w, pricing)
    if held_n == 0 or held_w == 0:
        scale, unit = 1, 1
        heap = [(n + out[r], r) for r, n in enumerate(counts)]
    else:
        scale, unit = held_n, held_w
        heap = [
            (work[r] * scale + (c.unread + out[r]) * unit, r) for r, c in enumerate(contributions)
        ]
    heapq.heapify(heap)
    for _ in range(total):
        est, r = heapq.heappop(heap)
        out[r] += 1
        heapq.heappush(heap, (est + unit, r))
    return tuple(out)


def _level(
    contributions: Sequence[Contribution],
    work: list[int],
    least: list[int],
    total: int,
    held_n: int,
    held_w: int,
    pricing: Pricing,
) -> tuple[int, ...]:
    """Split `total` ids (the next plan ids, in rank-order slices, each rank at least
    `least[r]`) so that every rank's priced work ends near one common level: known
    costs at the table's price, unseen ids at the gathered mean (the table's, while
    nothing is held). Integer-only: everything is scaled by the mean's denominator.
    The count dealt is `total` whatever the prices."""
    w = len(contributions)
    if held_n > 0 and held_w > 0:
        scale, unit = held_n, held_w
    else:
        scale, unit = 1, max(1, pricing.mean)

    def price(k: int) -> int:
        p = pricing.upcoming(k)
        return unit if p is None else max(0, p) * scale

    n_ids = total + sum(least)  # the starved ranks' first ids are in the slices too
    prices = [price(k) for k in range(n_ids)]
    est = []
    for r in range(w):
        known, unseen = pricing.unread[r]
        est.append(work[r] * scale + max(0, known) * scale + max(0, unseen) * unit)
    # The common level L at which the round's priced work, poured over the ranks,
    # tops every rank below L up to it: sum(max(0, L - est[r])) = sum(prices).
    pour = sum(prices)
    ordered = sorted(est)
    level, below = ordered[0], 1
    for e in ordered[1:]:
        need = below * (e - level)
        if need >= pour:
            break
        pour -= need
        level, below = e, below + 1
    level += pour // below
    # The slices in rank order: rank r's ends where the round's priced ids, summed
    # from the first, come nearest to what ranks 0..r lack of the level (so rounding
    # never accumulates); the last rank's ends at the round's last id. A starved
    # rank takes at least its one id, and later ranks' are kept for them.
    out = [0] * w
    reserved = sum(least)
    poured = target = j = 0
    for r in range(w):
        reserved -= least[r]
        target += max(0, level - est[r])
        take = 0
        while j < n_ids - reserved and (
            r == w - 1 or take < least[r] or 2 * poured + prices[j] <= 2 * target
        ):
            poured += prices[j]
            j += 1
            take += 1
        out[r] = take
    return tuple(out)


def dynamic_bounds(plan_len: int, world: int, target: int, priced: bool = False) -> tuple[int, int]:
    """(steps, rounds) bounds of a dynamic-sharding epoch of `plan_len` ids.

    Steps: every step some rank emits a real batch, so at most one per id.
    Rounds: every round but the last runs a step, or has a starved rank offer 0,
    and then deals at least one id (a starved rank wants `target` > 0 ids); so at
    most the steps plus the ids dealt after the initial shares, plus the last.
    """
    after_initial = plan_len - initial_cursor(plan_len, world, target, priced)
    return plan_len, plan_len + after_initial + 1
