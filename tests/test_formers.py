"""Batch formers: partition contract, budget safety, oversize handling."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tlc import require_tlc

from odb_core.batch import Batch
from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import AttentionAware, BatchStats, Budget, CostModel, PackedTokens, PaddedTokens
from odb_core.errors import ConfigError
from odb_core.formers import (
    FORMERS,
    Former,
    FormerKind,
    FormResult,
    fullest_batch,
    sort_window_greedy,
)
from odb_core.protocol import RankAction, RankMachine
from odb_core.sample import Sample
from odb_core.trace import ProtocolTrace, TracingRankMachine
from odb_core.verify.checker import check
from odb_core.verify.model import ModelConfig, round_robin_shards
from odb_core.verify.tlc import validate_trace_tlc
from odb_core.verify.trace_validation import validate_trace

MODELS: list[CostModel] = [PackedTokens(), PaddedTokens(), AttentionAware(alpha=0.01)]

windows = st.lists(
    st.tuples(st.integers(1, 60), st.integers(0, 20), st.integers(0, 3)), min_size=0, max_size=40
).map(lambda xs: [Sample(i, t, v, p) for i, (t, v, p) in enumerate(xs)])


def contract_violations(
    former: Former, window: list[Sample], b: Budget, model: CostModel, flush: bool
) -> list[str]:
    """Every clause of the former contract (module docstring of odb_core.formers)."""
    result = former(window, b, model, flush)
    out: list[str] = []
    emitted = [s for batch in result.batches for s in batch.samples] + result.leftovers
    if Counter(emitted) != Counter(window):
        out.append("batches + leftovers are not a partition of the window")
    if flush and result.leftovers:
        out.append("leftovers after a flush")
    if window and not result.batches:
        out.append("a non-empty window formed no batch")
    for batch in result.batches:
        if not batch.samples:
            out.append("an empty batch")
            continue
        fits = b.fits(BatchStats.of(batch.samples), model)
        if not (fits or (len(batch.samples) == 1 and batch.oversize)):
            out.append(f"batch {batch.ids} over budget")
        if batch.oversize != (not fits):
            out.append(f"batch {batch.ids} oversize flag is {batch.oversize}")
    return out


@settings(max_examples=200, deadline=None)
@given(
    window=windows,
    kind=st.sampled_from(list(FormerKind)),
    model=st.sampled_from(MODELS),
    budget=st.integers(20, 200),
    max_samples=st.none() | st.integers(1, 8),
    max_patches=st.none() | st.integers(1, 6),
    flush=st.booleans(),
)
def test_former_contract(
    window: list[Sample],
    kind: FormerKind,
    model: CostModel,
    budget: int,
    max_samples: int | None,
    max_patches: int | None,
    flush: bool,
) -> None:
    b = Budget(budget, max_samples, max_patches)
    assert contract_violations(FORMERS[kind], window, b, model, flush) == []


def _drops_leftovers(w: Sequence[Sample], b: Budget, m: CostModel, flush: bool) -> FormResult:
    return FormResult(sort_window_greedy(w, b, m, flush).batches, [])


def _one_batch(w: Sequence[Sample], b: Budget, m: CostModel, flush: bool) -> FormResult:
    return FormResult([Batch(tuple(w), False)] if w else [], [])


def _holds_all(w: Sequence[Sample], b: Budget, m: CostModel, flush: bool) -> FormResult:
    return FormResult([], list(w))


def _duplicates_head(w: Sequence[Sample], b: Budget, m: CostModel, flush: bool) -> FormResult:
    r = sort_window_greedy(w, b, m, flush)
    return FormResult(r.batches, [*r.leftovers, r.batches[0].samples[0]])


@pytest.mark.parametrize(
    "broken", [_drops_leftovers, _one_batch, _holds_all, _duplicates_head], ids=lambda f: f.__name__
)
def test_a_broken_former_is_caught_by_the_contract(broken: Former) -> None:
    window = [Sample(0, 3), Sample(1, 5), Sample(2, 2), Sample(3, 4)]
    found = contract_violations(broken, window, Budget(9), PackedTokens(), flush=False)
    assert found, f"{broken.__name__} passed the contract"


def test_greedy_is_longest_first_and_cuts_at_budget() -> None:
    window = [Sample(0, 3), Sample(1, 5), Sample(2, 2), Sample(3, 4)]
    r = sort_window_greedy(window, Budget(9), PackedTokens(), flush=True)
    assert [b.ids for b in r.batches] == [(1, 3), (0, 2)]


def test_greedy_keeps_open_batch_as_leftover() -> None:
    window = [Sample(0, 3), Sample(1, 5), Sample(2, 2), Sample(3, 4)]
    r = sort_window_greedy(window, Budget(9), PackedTokens(), flush=False)
    assert [b.ids for b in r.batches] == [(1, 3)]
    assert sorted(s.id for s in r.leftovers) == [0, 2]


def test_greedy_emits_single_open_batch_of_a_full_window() -> None:
    r = sort_window_greedy([Sample(0, 1), Sample(1, 1)], Budget(9), PackedTokens(), flush=False)
    assert [b.ids for b in r.batches] == [(0, 1)] and r.leftovers == []


def test_ties_are_broken_by_id_not_arrival() -> None:
    a = [Sample(5, 4), Sample(2, 4), Sample(9, 4)]
    r1 = sort_window_greedy(a, Budget(8), PackedTokens(), flush=True)
    r2 = sort_window_greedy(a[::-1], Budget(8), PackedTokens(), flush=True)
    assert r1 == r2 and r1.batches[0].ids == (2, 5)


def test_padded_budget_accounts_for_padding() -> None:
    window = [Sample(0, 10), Sample(1, 1), Sample(2, 1)]
    r = sort_window_greedy(window, Budget(20), PaddedTokens(), flush=True)
    assert [b.ids for b in r.batches] == [(0, 1), (2,)]


def test_bfd_fills_the_fullest_bin() -> None:
    window = [Sample(0, 6), Sample(1, 5), Sample(2, 4), Sample(3, 4)]
    r = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(10), PackedTokens(), True)
    assert sorted(b.ids for b in r.batches) == [(0, 2), (1, 3)]


def test_oversize_sample_forms_a_flagged_solo_batch() -> None:
    window = [Sample(0, 50), Sample(1, 3), Sample(2, 3)]
    r = sort_window_greedy(window, Budget(10), PackedTokens(), flush=True)
    assert r.batches[0].ids == (0,) and r.batches[0].oversize
    assert not r.batches[1].oversize


@pytest.mark.parametrize("kind", list(FormerKind))
def test_empty_window(kind: FormerKind) -> None:
    r = FORMERS[kind]([], Budget(10), PackedTokens(), False)
    assert r.batches == [] and r.leftovers == []


def _ids(result: object) -> list[list[int]]:
    return [list(b.ids) for b in result.batches]  # type: ignore[attr-defined]


def test_best_fit_breaks_a_tie_towards_the_first_batch() -> None:
    # 6 and 6 open two batches; 3 leaves both equally full and joins the first.
    window = [Sample(0, 6), Sample(1, 6), Sample(2, 3)]
    r = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(10), PackedTokens(), True)
    assert _ids(r) == [[0, 2], [1]]


def test_best_fit_returns_the_least_filled_of_two_batches_as_leftovers() -> None:
    window = [Sample(0, 7), Sample(1, 5)]
    r = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(10), PackedTokens(), False)
    assert _ids(r) == [[0]]
    assert [s.id for s in r.leftovers] == [1]
    flushed = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(10), PackedTokens(), True)
    assert _ids(flushed) == [[0], [1]] and flushed.leftovers == []


def test_best_fit_puts_zero_cost_samples_together() -> None:
    # a batch of empty samples costs 0, which must still count as a fit
    window = [Sample(0, 0), Sample(1, 0), Sample(2, 0)]
    r = FORMERS[FormerKind.BEST_FIT_DECREASING](window, Budget(8), PackedTokens(), True)
    assert _ids(r) == [[0, 1, 2]] and r.leftovers == []


# ---- early forms: the fullest batch of a partial window -------------------------


def test_fullest_batch_keeps_the_batch_with_most_tokens_and_returns_the_rest() -> None:
    a = Batch((Sample(0, 5), Sample(1, 5)), False)  # 10 tokens
    b = Batch((Sample(2, 6), Sample(3, 6)), False)  # 12 tokens, the fullest
    c = Batch((Sample(4, 12),), False)  # 12 tokens too, but later
    result = fullest_batch(FormResult([a, b, c], [Sample(5, 1)]))
    assert result.batches == [b]
    assert sorted(s.id for s in result.leftovers) == [0, 1, 4, 5]
    one = FormResult([a], [Sample(5, 1)])
    assert fullest_batch(one) == one
    assert fullest_batch(FormResult([], [])) == FormResult([], [])


@settings(max_examples=150, deadline=None)
@given(windows, st.sampled_from(MODELS), st.integers(20, 200))
def test_fullest_batch_of_a_partial_window_keeps_the_former_contract(
    window: list[Sample], model: CostModel, tokens: int
) -> None:
    b = Budget(tokens)
    result = fullest_batch(sort_window_greedy(window, b, model, False))
    emitted = [s for batch in result.batches for s in batch.samples] + result.leftovers
    assert Counter(emitted) == Counter(window)
    assert len(result.batches) <= 1
    if window:
        assert result.batches
    for batch in result.batches:
        assert batch.oversize or b.fits(BatchStats.of(batch.samples), model)


def _early(world: int, n: int, k: int, e: int, costs: list[int], budget: int) -> ModelConfig:
    protocol = ProtocolConfig(
        world_size=world,
        budget=Budget(budget),
        cost_model=PaddedTokens(),
        buffer_size=k,
        max_steps_per_round=2,
        early_form=e,
    )
    return ModelConfig(protocol, round_robin_shards(costs[:n], world))


class EarlyFormDropsTheRest(RankMachine):
    """A broken early form: what it holds back is discarded, not kept for later."""

    def form_early(self) -> list[Batch]:
        batches = super().form_early()
        if batches:
            self.buffer = {}
        return batches


@pytest.mark.parametrize(
    ("world", "n", "k", "e"), [(1, 5, 3, 1), (2, 6, 3, 2), (2, 7, 4, 2), (3, 7, 3, 2)]
)
def test_early_forms_keep_every_guarantee_in_every_interleaving(
    world: int, n: int, k: int, e: int
) -> None:
    costs = [1, 3, 2, 2, 3, 1, 1]
    r = check(_early(world, n, k, e, costs, 4))
    assert r.complete and r.ok, [v.to_json() for v in r.violations]
    assert r.deadlocks == 0 and r.acyclic and r.terminal_states >= 1
    assert r.max_steps_seen <= r.steps_bound
    # proofs/bounded_termination.md: at most N early forms on top of 2N + W + (2W + 1)(S + 1)
    assert r.longest_schedule <= 3 * n + world + (2 * world + 1) * (r.steps_bound + 1)
    cfg = _early(world, n, k, e, costs, 4)
    plain = check(replace(cfg, protocol=replace(cfg.protocol, early_form=None)))
    assert r.states > plain.states  # the early forms were explored


def test_an_early_form_that_drops_what_it_holds_back_is_caught() -> None:
    cfg = _early(2, 7, 4, 2, [1, 3, 2, 2, 3, 1, 1], 4)
    r = check(replace(cfg, machine=EarlyFormDropsTheRest))
    assert not r.ok and "NoLoss" in r.violated()


def test_an_early_form_emits_only_the_fullest_batch_once_per_observation() -> None:
    p = ProtocolConfig(
        world_size=1, budget=Budget(4), cost_model=PaddedTokens(), buffer_size=8, early_form=3
    )
    m = RankMachine(0, p)
    for s in (Sample(0, 2), Sample(1, 2)):
        m.observe(s)
    assert RankAction.FORM_EARLY not in m.enabled()  # below early_form
    m.observe(Sample(2, 1))
    assert m.enabled() == {RankAction.OBSERVE, RankAction.EXHAUST, RankAction.FORM_EARLY}
    assert [s.id for b in m.form_early() for s in b.samples] == [0, 1]  # 2 x 2 = 4 tokens
    assert sorted(m.buffer) == [2] and len(m.ready) == 1
    assert RankAction.FORM_EARLY not in RankMachine(0, p).enabled()
    m2 = RankMachine(0, p)
    for s in (Sample(0, 1), Sample(1, 1), Sample(2, 1)):
        m2.observe(s)
    assert m2.form_early() == [] and sorted(m2.buffer) == [0, 1, 2]  # one batch: kept
    assert RankAction.FORM_EARLY not in m2.enabled()  # once until the next observation
    m2.observe(Sample(3, 4))
    assert RankAction.FORM_EARLY in m2.enabled()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"early_form": 0}, "early_form=0"),
        ({"early_form": 8}, "early_form=8 must be below buffer_size=8"),
        ({"early_form": 2, "mode": Mode.QUOTA}, "needs mode='join'"),
    ],
)
def test_early_form_config_is_validated(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ProtocolConfig(world_size=2, budget=Budget(4), buffer_size=8, **change)  # type: ignore[arg-type]


def _traced_run_with_early_forms() -> ProtocolTrace:
    p = ProtocolConfig(
        world_size=2,
        budget=Budget(4),
        cost_model=PaddedTokens(),
        buffer_size=4,
        max_steps_per_round=2,
        early_form=2,
    )
    lengths = [3, 1, 2, 3, 1, 2, 3, 1]
    ms = [TracingRankMachine(r, p) for r in range(2)]
    sources = [iter([Sample(i, lengths[i]) for i in range(r, 8, 2)]) for r in range(2)]
    done = False
    while not done:
        contributions = []
        for m, src in zip(ms, sources, strict=True):
            while RankAction.CONTRIBUTE not in (en := m.enabled()):
                if RankAction.FORM in en:
                    m.form()
                elif RankAction.FORM_EARLY in en:
                    m.form_early()
                elif (s := next(src, None)) is None:
                    m.exhaust()
                else:
                    m.observe(s)
            contributions.append(m.contribute())
        results = [m.all_gather(contributions) for m in ms]  # every rank receives
        done = results[0].done
    return ProtocolTrace.from_machines(ms)


def test_a_trace_with_early_forms_replays_in_the_python_model() -> None:
    trace = _traced_run_with_early_forms()
    assert sum(e["action"] == "FormEarly" for rt in trace.ranks for e in rt.events) >= 2
    assert trace.protocol["early_form"] == 2
    assert validate_trace(trace).ok
    bad = copy.deepcopy(trace)
    bad.ranks[0].events = [e for e in bad.ranks[0].events if e["action"] != "FormEarly"]
    assert not validate_trace(bad).ok


@pytest.mark.tlc
def test_a_trace_with_early_forms_is_a_behaviour_of_the_spec() -> None:
    require_tlc()
    report = validate_trace_tlc(_traced_run_with_early_forms())
    assert report.ok, report.reason
