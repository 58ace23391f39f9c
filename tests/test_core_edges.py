"""Edge cases of the runtime core that mutation testing found unchecked
(docs/VERIFICATION.md lists the mutants each test kills)."""

from __future__ import annotations

from typing import Any

import pytest

from odb_core.collective import Contribution, decide_round
from odb_core.config import LossNormalization, Mode, OversizePolicy, ProtocolConfig
from odb_core.cost import Budget, Multimodal
from odb_core.errors import (
    ConfigError,
    DuplicateSampleError,
    ODBPeerError,
    OversizeSampleError,
    ProtocolError,
)
from odb_core.ledger import ages, plan_epoch, rank_order, share, validate_ledgers
from odb_core.protocol import RankMachine, rounds_bound, steps_bound
from odb_core.sample import Sample
from odb_core.step import StepInfo, loss_scale
from odb_core.window import WindowBuffer


def one_rank(budget: int, **kw: object) -> RankMachine:
    config = ProtocolConfig(
        world_size=1,
        budget=Budget(budget),
        buffer_size=2,
        oversize=OversizePolicy.TRUNCATE,
        **kw,  # type: ignore[arg-type]
    )
    return RankMachine(0, config)


def run(m: RankMachine, samples: list[Sample]) -> list[StepInfo]:
    source = iter(samples)
    steps: list[StepInfo] = []
    done = False
    while not done:
        result = m.all_gather([m.fill(lambda: next(source, None))])
        steps.extend(result.steps)
        done = result.done
    return steps


@pytest.mark.parametrize("budget", [1, 2, 7, 10, 16])
@pytest.mark.parametrize("over", [1, 2, 3, 5, 13, 40])
def test_truncation_keeps_the_largest_text_that_fits(budget: int, over: int) -> None:
    steps = run(one_rank(budget), [Sample(0, budget + over)])
    (info,) = steps
    assert info.batch is not None and info.batch.samples[0].tokens == budget


@pytest.mark.parametrize("visual", [6, 9, 10])
def test_truncation_can_keep_no_text_when_the_visual_tokens_fill_the_budget(visual: int) -> None:
    m = one_rank(10, cost_model=Multimodal())
    (info,) = run(m, [Sample(0, 5, visual_tokens=visual)])
    assert info.batch is not None and info.batch.samples[0].tokens == 10 - visual


def test_a_sample_whose_visual_tokens_alone_overflow_is_refused() -> None:
    with pytest.raises(OversizeSampleError, match="even with all text truncated"):
        run(one_rank(10, cost_model=Multimodal()), [Sample(0, 5, visual_tokens=11)])


def test_a_restored_machine_still_refuses_an_id_it_holds_in_a_ready_batch() -> None:
    m = one_rank(100)
    m.observe(Sample(0, 3))
    m.observe(Sample(1, 4))
    m.form()
    m.contribute()
    snap = m.snapshot()
    assert snap.ready and not snap.buffer
    restored = RankMachine.restore(0, m.config, snap)
    with pytest.raises(DuplicateSampleError):
        restored.observe(Sample(0, 3))


# ---- the all-gather vector -----------------------------------------------------------


def test_the_vector_pads_unused_slots_with_zeros_and_round_trips() -> None:
    c = Contribution(1, False, (2,), (9,), (7,))
    assert c.to_vector(3) == [1, 0, 2, 0, 0, 9, 0, 0, 7, 0, 0]
    assert Contribution.from_vector(c.to_vector(3), 3) == c


@pytest.mark.parametrize(
    ("vector", "needle"),
    [
        ([1, 0, 2, 9], r"vector of length 4, expected 5"),
        ([2, 0, 2, 9, 7], r"malformed all-gather vector \[2, 0, 2, 9, 7\]"),
        ([1, 2, 2, 9, 7], r"malformed all-gather vector \[1, 2, 2, 9, 7\]"),
        ([-1, 1, 0, 0, 0], r"malformed all-gather vector"),
    ],
)
def test_a_malformed_vector_from_a_peer_is_refused_naming_it(
    vector: list[int], needle: str
) -> None:
    with pytest.raises(ODBPeerError, match=needle):
        Contribution.from_vector(vector, 1)


@pytest.mark.parametrize("norm", list(LossNormalization))
def test_the_loss_scale_is_zero_when_either_count_is_zero(norm: LossNormalization) -> None:
    assert loss_scale(norm, 2, (1, 3), (0, 0)) == 0.0
    assert loss_scale(norm, 2, (0, 0), (4, 8)) == 0.0
    assert loss_scale(norm, 2, (1, 3), (4, 6)) == (2 * 1 / 4 if norm.value == "samples" else 1.0)


# ---- optimizer windows ---------------------------------------------------------------


def _info(step: int, window: int, sync: bool, local: int, glob: int) -> StepInfo:
    return StepInfo(step, 0, 0, False, None, local, glob, local, glob, local, glob, window, sync)


def test_a_released_window_carries_its_totals_and_scales() -> None:
    config = ProtocolConfig(world_size=2, budget=Budget(64), buffer_size=2, grad_accum_steps=2)
    out = WindowBuffer(config).push_steps(
        [_info(0, 0, False, 1, 3), _info(1, 0, True, 2, 5)], done=False
    )
    assert [(s.window_samples, s.window_loss_tokens) for s in out] == [(8, 8), (8, 8)]
    assert [s.loss_scale for s in out] == [2 * 1 / 8, 2 * 2 / 8]
    assert [s.sync_gradients for s in out] == [False, True]


def test_a_step_of_the_next_window_while_one_is_open_is_refused_naming_both() -> None:
    config = ProtocolConfig(world_size=1, budget=Budget(64), buffer_size=2, grad_accum_steps=2)
    buffer = WindowBuffer(config)
    assert buffer.push_steps([_info(0, 0, False, 1, 1)], done=False) == []
    with pytest.raises(ProtocolError, match="step 1 opens window 1 while window 0 is still open"):
        buffer.push_steps([_info(1, 1, True, 1, 1)], done=False)


# ---- ledgers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: validate_ledgers([{1, 2}]), r"ledger of rank 0 must be a sequence of integer"),
        (lambda: validate_ledgers(["12"]), r"ledger of rank 0 must be a sequence"),
        (lambda: validate_ledgers([[1, "2"]]), r"ledger of rank 0 holds '2'"),
        (lambda: validate_ledgers([[1, 2, 1]]), r"sample id 1 is in the ledger twice"),
        (lambda: validate_ledgers([[1], [2, 1]]), r"sample id 1 is in the ledger on ranks 0 and 1"),
        (
            lambda: validate_ledgers([[3], [], [3]]),
            r"sample id 3 is in the ledger on ranks 0 and 2",
        ),
        (lambda: share(((1,),), True, 0), r"world=True must be a positive integer"),
        (lambda: share(((1,),), 2, True), r"rank=True is not in \[0, 2\)"),
        (lambda: share(((1,),), 2, 2), r"rank=2 is not in \[0, 2\)"),
        (lambda: share(((1,),), 2, 0, keep_on_rank=True), r"cannot move to another rank$"),
        (lambda: rank_order((), {0, 1}, 1, 0), r"partition of rank 0 must be a sequence"),
        (lambda: rank_order((), [0, 3, 0], 1, 0), r"partition of rank 0 holds sample id 0 twice"),
        (lambda: plan_epoch((), [[0], {1}]), r"partition of rank 1 must be a sequence"),
        (
            lambda: plan_epoch((), [[0, 1], [2, 1]]),
            r"sample id 1 is in the partitions of ranks 0 and 1",
        ),
    ],
)
def test_bad_ledgers_and_partitions_are_refused_naming_the_value(call: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        call()


def test_plan_epoch_deals_the_ledger_round_robin_by_default() -> None:
    plan = plan_epoch([[5, 6, 7], []], [[0, 2], [1, 3]])
    assert plan == [[5, 7, 0, 2], [6, 1, 3]]
    assert plan_epoch([[5, 6, 7], []], [[0, 2], [1, 3]], keep_on_rank=True) == [
        [5, 6, 7, 0, 2],
        [1, 3],
    ]


def test_ages_count_the_passes_an_id_has_been_carried_in_a_row() -> None:
    assert ages(((1, 2), (3,))) == {1: 1, 2: 1, 3: 1}
    assert ages(((1, 2),), {1: 2, 9: 4}) == {1: 3, 2: 1}


def test_fill_after_the_epoch_is_refused_naming_the_phase() -> None:
    m = one_rank(10)
    run(m, [Sample(0, 3)])
    with pytest.raises(ProtocolError, match=r"rank 0: fill\(\) in phase done"):
        m.fill(lambda: None)


def test_a_window_closes_at_the_step_whose_loss_tokens_reach_tokens_per_update() -> None:
    m = one_rank(5, tokens_per_update=5)
    steps = run(m, [Sample(i, 5) for i in range(3)])
    assert [s.sync_gradients for s in steps] == [True, True, True]
    assert [s.window for s in steps] == [0, 1, 2]


def test_the_bounds_of_an_empty_epoch() -> None:
    assert (steps_bound([]), rounds_bound([])) == (0, 1)
    assert (steps_bound([3, 1]), rounds_bound([3, 1])) == (3, 4)


# ---- the rank machine's steps ----------------------------------------------------------


def ranks(world: int, shards: list[list[Sample]], **kw: Any) -> list[list[StepInfo]]:
    """Drive `world` rank machines through one epoch in lockstep."""
    config = ProtocolConfig(world_size=world, budget=Budget(10), buffer_size=2, **kw)
    machines = [RankMachine(r, config) for r in range(world)]
    sources = [iter(s) for s in shards]
    out: list[list[StepInfo]] = [[] for _ in range(world)]
    while not all(m.phase.value == "done" for m in machines):
        gathered = [
            m.fill(lambda s=s: next(s, None)) for m, s in zip(machines, sources, strict=True)
        ]
        for r, m in enumerate(machines):
            out[r].extend(m.all_gather(gathered).steps)
    for r, m in enumerate(machines):
        snap = m.snapshot()
        assert snap.pads == sum(s.is_pad for s in out[r])
        assert snap.steps == len(out[r])
    return out


@pytest.mark.parametrize("m", [1, 2])
def test_a_dry_rank_with_exactly_m_ready_batches_is_final(m: int) -> None:
    config = ProtocolConfig(
        world_size=1, budget=Budget(10), buffer_size=m + 1, max_steps_per_round=m
    )
    machine = RankMachine(0, config)
    source = iter([Sample(i, 10) for i in range(m)])
    c = machine.fill(lambda: next(source, None))
    assert (c.offered, c.final) == (m, True)
    result = machine.all_gather([c])
    assert result.done and len(result.steps) == m


def test_a_short_rank_pads_several_steps_and_counts_them() -> None:
    long, short = [Sample(i, 10) for i in range(0, 5)], [Sample(5, 10)]
    steps = ranks(2, [long, short])
    assert [s.is_pad for s in steps[1]] == [False, True, True, True, True]
    pad = steps[1][-1]
    assert (pad.local_samples, pad.local_tokens, pad.local_loss_tokens) == (0, 0, 0)


def test_step_info_names_rank_round_and_both_token_counts() -> None:
    shards = [[Sample(0, 6, loss_tokens=2)], [Sample(1, 8, loss_tokens=5)]]
    steps = ranks(2, shards)
    (a,), (b,) = steps
    assert (a.rank, a.round, b.rank, b.round) == (0, 0, 1, 0)
    assert (a.local_tokens, a.local_loss_tokens, b.local_tokens, b.local_loss_tokens) == (
        6,
        2,
        8,
        5,
    )
    assert (a.global_tokens, a.global_loss_tokens) == (14, 7)


@pytest.mark.parametrize(
    ("n", "sync"), [(4, [False, False, True, True]), (3, [False, False, True])]
)
def test_the_epoch_closes_its_last_window_and_opens_no_empty_one(n: int, sync: list[bool]) -> None:
    (steps,) = ranks(1, [[Sample(i, 10) for i in range(n)]], grad_accum_steps=3)
    assert [s.sync_gradients for s in steps] == sync
    config = ProtocolConfig(world_size=1, budget=Budget(10), buffer_size=2, grad_accum_steps=3)
    m = RankMachine(0, config)
    run(m, [Sample(i, 10) for i in range(n)])
    windows = m.snapshot().windows
    assert [w.end for w in windows] == ([3, 4] if n == 4 else [3])


def test_decide_round_without_contributions_is_refused() -> None:
    with pytest.raises(
        ProtocolError, match=r"^decide_round needs the contribution of every rank, got none$"
    ):
        decide_round(Mode.JOIN, None, 0, [])


@pytest.mark.parametrize("rank", [True, 2, -1, "0"])
def test_a_rank_outside_the_world_is_refused_naming_it(rank: object) -> None:
    config = ProtocolConfig(world_size=2, budget=Budget(10), buffer_size=2)
    with pytest.raises(ProtocolError, match=rf"^rank={rank!r} is not in \[0, 2\)$"):
        RankMachine(rank, config)  # type: ignore[arg-type]


def test_an_id_observed_twice_is_refused_after_its_batch_was_emitted() -> None:
    m = one_rank(10)
    source = iter([Sample(0, 10), Sample(1, 3)])
    m.all_gather([m.fill(lambda: next(source, None))])
    with pytest.raises(DuplicateSampleError):
        m.observe(Sample(0, 10))


def test_all_gather_before_contributing_is_refused() -> None:
    m = one_rank(10)
    m.observe(Sample(0, 3))
    with pytest.raises(ProtocolError):
        m.all_gather([])


def test_truncation_caps_the_loss_tokens_and_records_the_cut() -> None:
    (info,) = run(one_rank(10), [Sample(0, 15, loss_tokens=12)])
    assert info.batch is not None
    kept = info.batch.samples[0]
    assert (kept.tokens, kept.loss_tokens, info.local_loss_tokens) == (10, 10, 10)
    assert info.truncated == ((0, 10),)
    (info,) = run(one_rank(10), [Sample(0, 15, loss_tokens=4)])
    assert info.batch is not None and info.batch.samples[0].loss_tokens == 4


def test_an_oversize_sample_under_the_error_policy_names_the_remedy() -> None:
    config = ProtocolConfig(world_size=1, budget=Budget(10), buffer_size=2)
    with pytest.raises(
        OversizeSampleError, match=r"choose oversize='solo' or 'truncate' to admit it$"
    ):
        run(RankMachine(0, config), [Sample(0, 11)])
