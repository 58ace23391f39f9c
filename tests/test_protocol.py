"""The per-rank machine: legal transitions, bad input, loss scaling, oversize policies."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from odb_core.collective import Contribution, decide_round
from odb_core.config import LossNormalization, Mode, OversizePolicy, ProtocolConfig
from odb_core.cost import Budget, Multimodal, PackedTokens
from odb_core.errors import (
    ConfigError,
    DuplicateSampleError,
    ODBPeerError,
    OversizeSampleError,
    ProtocolError,
    SampleError,
)
from odb_core.protocol import RankAction, RankMachine, RankPhase
from odb_core.sample import Sample, make_sample
from odb_core.window import WindowBuffer


def cfg(**kw: object) -> ProtocolConfig:
    base: dict[str, object] = {"world_size": 2, "budget": Budget(10), "buffer_size": 2}
    base.update(kw)
    return ProtocolConfig(**base)  # type: ignore[arg-type]


def test_import_does_not_pull_torch() -> None:
    code = "import sys, odb_core; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- bad input: clear error naming the value, nothing half-applied ----------


@pytest.mark.parametrize(
    ("tokens", "match"),
    [(-1, "-1"), (math.nan, "nan"), (2.5, "2.5"), ("7", "'7'"), (True, "True")],
)
def test_bad_cost_is_rejected(tokens: object, match: str) -> None:
    with pytest.raises(SampleError, match=match):
        make_sample(3, tokens)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((3, -1), "sample 3: tokens=-1 is negative"),
        ((3, 5, -2), "sample 3: visual_tokens=-2 is negative"),
        ((3, 5, 0, 1.5), "sample 3: patches=1.5 is not an integer token count"),
        ((3, 5, 0, 0, -1), "sample 3: loss_tokens=-1 is negative"),
        (("x", 5), "sample id 'x' is not an integer"),
        ((2.5, 5), "sample id 2.5 is not an integer"),
    ],
)
def test_a_bad_sample_error_names_the_sample_the_field_and_the_value(
    args: tuple[object, ...], message: str
) -> None:
    with pytest.raises(SampleError) as info:
        make_sample(*args)
    assert str(info.value) == message


def test_integral_float_and_numpy_costs_are_accepted() -> None:
    import numpy as np

    assert make_sample(np.int64(4), 12.0) == Sample(4, 12)
    assert make_sample(1, np.int32(7)).tokens == 7


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"world_size": 0}, "world_size=0"),
        ({"buffer_size": 0}, "buffer_size=0"),
        ({"mode": "bogus"}, "'bogus'"),
        ({"former": "nope"}, "'nope'"),
        ({"oversize": "drop"}, "'drop'"),
        ({"quota": 5}, "quota=5"),
        ({"mode": "quota", "quota": 0}, "quota=0"),
        ({"max_steps_per_round": -2}, "max_steps_per_round=-2"),
    ],
)
def test_bad_config_names_the_value(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        cfg(**kw)


def test_enum_values_are_accepted() -> None:
    c = cfg(mode="quota", oversize="solo", former="bfd")
    assert c.mode is Mode.QUOTA and c.oversize is OversizePolicy.SOLO


def test_duplicate_id_is_rejected_and_state_unchanged() -> None:
    m = RankMachine(0, cfg(buffer_size=4))
    m.observe(Sample(1, 3))
    before = m.snapshot()
    with pytest.raises(DuplicateSampleError, match="1"):
        m.observe(Sample(1, 4))
    assert m.snapshot() == before


def test_oversize_error_policy_names_sample_and_leaves_state() -> None:
    m = RankMachine(0, cfg())
    before = m.snapshot()
    with pytest.raises(OversizeSampleError, match=r"sample 7 costs 11"):
        m.observe(Sample(7, 11))
    assert m.snapshot() == before
    m.observe(Sample(7, 10))  # the id was not consumed by the failed attempt


def test_oversize_solo_policy() -> None:
    m = RankMachine(0, cfg(world_size=1, oversize="solo", buffer_size=1))
    m.observe(Sample(0, 50))
    assert m.form()[0].oversize


def test_oversize_truncate_policy_reports_truncation() -> None:
    m = RankMachine(0, cfg(world_size=1, oversize="truncate", buffer_size=1))
    m.observe(Sample(0, 50, visual_tokens=4))
    m.form()
    c = m.contribute()
    step = m.all_gather([c]).steps[0]
    assert step.batch is not None and step.batch.samples[0].tokens == 6
    assert step.truncated == ((0, 6),)


def test_truncate_impossible_when_visual_alone_overflows() -> None:
    m = RankMachine(0, cfg(oversize="truncate", cost_model=Multimodal()))
    with pytest.raises(OversizeSampleError, match="even with all text truncated"):
        m.observe(Sample(0, 1, visual_tokens=11))


# ---- explicit transitions: illegal events raise at once ----------------------


def test_illegal_events_raise() -> None:
    m = RankMachine(0, cfg())
    assert m.enabled() == {RankAction.OBSERVE, RankAction.EXHAUST}
    with pytest.raises(ProtocolError, match="Form is illegal"):
        m.form()
    with pytest.raises(ProtocolError, match="Contribute is illegal"):
        m.contribute()
    with pytest.raises(ProtocolError, match="all_gather is illegal"):
        m.all_gather([])
    m.exhaust()
    with pytest.raises(ProtocolError, match="Observe is illegal"):
        m.observe(Sample(0, 1))


def test_full_round_and_done() -> None:
    ms = [RankMachine(r, cfg()) for r in range(2)]
    ms[0].observe(Sample(0, 4))
    ms[0].exhaust()
    ms[0].form()
    ms[1].exhaust()
    cs = [m.contribute() for m in ms]
    assert cs[0] == Contribution(1, True, (1,), (4,), (4,))
    assert cs[1] == Contribution(0, True, (), (), ())
    results = [m.all_gather(cs) for m in ms]
    assert all(r.done for r in results)
    assert [r.steps[0].is_pad for r in results] == [False, True]
    assert all(m.phase is RankPhase.DONE for m in ms)
    with pytest.raises(ProtocolError):
        ms[0].contribute()


def test_peer_vector_inconsistent_with_own_raises_peer_error() -> None:
    m = RankMachine(0, cfg())
    m.exhaust()
    m.contribute()
    with pytest.raises(ODBPeerError, match="sent"):
        m.all_gather([Contribution(1, True, (1,), (1,), (1,)), Contribution(0, True, (), (), ())])
    with pytest.raises(ODBPeerError, match="3 vectors for world size 2"):
        m.all_gather([Contribution(0, True, (), (), ())] * 3)


def test_vector_roundtrip_and_malformed_vector() -> None:
    c = Contribution(2, False, (3, 1), (30, 9), (20, 0))
    assert Contribution.from_vector(c.to_vector(4), 4) == c
    with pytest.raises(ODBPeerError):
        Contribution.from_vector([9, 0, 0, 0], 1)


# ---- collective semantics ----------------------------------------------------


def test_join_round_takes_min_over_open_ranks_and_pads_final() -> None:
    d = decide_round(
        Mode.JOIN,
        None,
        0,
        [
            Contribution(3, False, (1, 1, 1), (5, 5, 5), (4, 4, 4)),
            Contribution(1, True, (2,), (7,), (3,)),
        ],
    )
    assert d.steps == 3 and not d.done
    assert d.global_samples == (3, 1, 1) and d.global_tokens == (12, 5, 5)
    assert d.global_loss_tokens == (7, 4, 4)


def test_join_all_final_takes_max_and_ends() -> None:
    d = decide_round(
        Mode.JOIN,
        None,
        0,
        [Contribution(2, True, (1, 1), (1, 1), (1, 1)), Contribution(0, True, (), (), ())],
    )
    assert d.steps == 2 and d.done


def test_quota_cuts_at_the_exact_step() -> None:
    cs = [Contribution(3, False, (2, 2, 2), (1, 1, 1), (1, 1, 1))] * 2
    d = decide_round(Mode.QUOTA, 7, 0, cs)
    assert d.steps == 2 and d.done  # 4 after step 0, 8 >= 7 after step 1


def test_quota_closes_when_first_rank_runs_dry() -> None:
    cs = [Contribution(2, False, (1, 1), (1, 1), (1, 1)), Contribution(1, True, (1,), (1,), (1,))]
    d = decide_round(Mode.QUOTA, None, 0, cs)
    assert d.steps == 1 and d.done


@pytest.mark.parametrize("norm", list(LossNormalization))
def test_loss_scale_gives_exact_global_mean(norm: LossNormalization) -> None:
    # Rank 0: one sample of 6 tokens, 2 of them loss tokens; rank 1: two samples of
    # 1 token each, all loss tokens. The cost tokens (8) must not normalise the loss.
    c = cfg(loss_normalization=norm, budget=Budget(10), buffer_size=2)
    ms = [RankMachine(r, c) for r in range(2)]
    sources = [iter([Sample(0, 6, loss_tokens=2)]), iter([Sample(1, 1), Sample(2, 1)])]
    cs = [m.fill(lambda it=it: next(it, None)) for m, it in zip(ms, sources, strict=True)]
    steps = [WindowBuffer(c).push(m.all_gather(cs))[0] for m in ms]
    assert steps[0].global_tokens == steps[1].global_tokens == 8
    assert steps[0].global_loss_tokens == steps[1].global_loss_tokens == 4
    assert steps[0].global_samples == steps[1].global_samples == 3
    # Per-token losses: rank 0 all 1.0, rank 1 all 4.0.
    if norm is LossNormalization.TOKENS:
        local_means, true_mean = [1.0, 4.0], (2 * 1.0 + 2 * 4.0) / 4
    else:
        local_means, true_mean = [1.0, 4.0], (1 * 1.0 + 2 * 4.0) / 3
    ddp_avg = sum(lm * s.loss_scale for lm, s in zip(local_means, steps, strict=True)) / 2
    assert ddp_avg == pytest.approx(true_mean, rel=1e-12)
    wrong = (6 * 1.0 + 2 * 4.0) / 8  # what cost-token normalisation would give
    assert norm is LossNormalization.SAMPLES or abs(ddp_avg - wrong) > 0.1


def test_machine_steps_are_provisional_until_their_window_closes() -> None:
    c = cfg(grad_accum_steps=2, budget=Budget(1), buffer_size=1, max_steps_per_round=1)
    m = RankMachine(0, replace(c, world_size=1))
    buf = WindowBuffer(m.config)
    src = iter([Sample(0, 1), Sample(1, 1), Sample(2, 1)])
    released = []
    while m.phase is not RankPhase.DONE:
        contrib = m.fill(lambda: next(src, None))
        result = m.all_gather([contrib])
        assert all(not s.final for s in result.steps)
        released.extend(buf.push(result))
    assert [s.window for s in released] == [0, 0, 1]
    assert [s.sync_gradients for s in released] == [False, True, True]
    assert all(s.final for s in released) and buf.held == 0
    assert [s.loss_scale for s in released] == [0.5, 0.5, 1.0]
    assert [(w.end, w.loss) for w in m.windows] == [(2, 2), (3, 1)]


def test_zero_loss_window_has_scale_zero() -> None:
    c = cfg(world_size=1)
    m = RankMachine(0, c)
    src = iter([Sample(0, 3, loss_tokens=0)])
    result = m.all_gather([m.fill(lambda: next(src, None))])
    (info,) = WindowBuffer(c).push(result)
    assert info.global_loss_tokens == 0 and info.loss_scale == 0.0 and not info.is_pad


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"grad_accum_steps": 0}, "grad_accum_steps=0"),
        ({"grad_accum_steps": 1.5}, "grad_accum_steps=1.5"),
        ({"tokens_per_update": 0}, "tokens_per_update=0"),
        ({"tokens_per_update": -3}, "tokens_per_update=-3"),
        ({"grad_accum_steps": 2, "tokens_per_update": 10}, "grad_accum_steps=2 and"),
    ],
)
def test_window_config_errors_name_the_value(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        cfg(**kw)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", float("nan")])
def test_loss_token_count_must_be_a_non_negative_integer(bad: object) -> None:
    with pytest.raises(SampleError, match="loss_tokens="):
        make_sample(0, 5, loss_tokens=bad)


def test_truncation_keeps_loss_tokens_within_the_kept_tokens() -> None:
    m = RankMachine(0, cfg(world_size=1, oversize=OversizePolicy.TRUNCATE, budget=Budget(4)))
    m.observe(Sample(0, 9, loss_tokens=6))
    m.observe(Sample(1, 9))
    kept = sorted(m.buffer.values())
    assert [(s.tokens, s.loss) for s in kept] == [(4, 4), (4, 4)]


def test_packed_default_cost_model() -> None:
    assert isinstance(cfg().cost_model, PackedTokens)


def test_describe_is_the_plain_data_fingerprint_of_every_field_but_the_carry() -> None:
    from odb_core.cost import PaddedTokens

    config = ProtocolConfig(
        world_size=3,
        budget=Budget(512, max_samples=7, max_patches=9),
        cost_model=PaddedTokens(),
        buffer_size=16,
        mode=Mode.QUOTA,
        oversize=OversizePolicy.TRUNCATE,
        max_steps_per_round=2,
        quota=40,
        deterministic=True,
        grad_accum_steps=4,
        carried=frozenset({1}),
    )
    assert config.describe() == {
        "world_size": 3,
        "budget_tokens": 512,
        "max_samples": 7,
        "max_patches": 9,
        "cost_model": "padded",
        "buffer_size": 16,
        "mode": "quota",
        "former": "greedy",
        "oversize": "truncate",
        "max_steps_per_round": 2,
        "quota": 40,
        "deterministic": True,
        "loss_normalization": "tokens",
        "grad_accum_steps": 4,
        "tokens_per_update": None,
    }


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"world_size": True}, "world_size=True must be an integer >= 1"),
        ({"budget": "x"}, "budget='x' must be a Budget"),
        ({"cost_model": 5}, "cost_model=5 has no cost(stats) method"),
        ({"mode": "bogus"}, "unknown mode 'bogus'; expected one of 'join', 'quota'"),
        (
            {"loss_normalization": "x"},
            "unknown loss normalization 'x'; expected one of 'tokens', 'samples'",
        ),
        (
            {"oversize": "drop"},
            "unknown oversize policy 'drop'; expected one of 'error', 'solo', 'truncate'",
        ),
        ({"quota": 5}, "quota=5 is only meaningful with mode='quota'"),
        ({"deterministic": "yes"}, "deterministic='yes' must be a bool"),
        (
            {"grad_accum_steps": 2, "tokens_per_update": 3},
            "grad_accum_steps=2 and tokens_per_update=3 both close optimizer windows; "
            "give one of them",
        ),
        ({"tokens_per_update": 0}, "tokens_per_update=0 must be an integer >= 1"),
        ({"mode": "quota", "carried": "ab"}, "carried='ab' must be a set of sample ids"),
        (
            {"mode": "quota", "carried": [1.5]},
            "carried holds 1.5, which is not an integer sample id",
        ),
        ({"carried": [1]}, "carried ids (1) are only meaningful with mode='quota'"),
    ],
)
def test_config_errors_say_exactly_what_is_wrong(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        cfg(**kw)
    assert str(err.value) == message
