"""Cost models and budgets."""

from __future__ import annotations

import math

import pytest

from odb_core.config import make_cost_model
from odb_core.cost import (
    AttentionAware,
    BatchStats,
    Budget,
    CostKind,
    Multimodal,
    PackedTokens,
    PaddedTokens,
)
from odb_core.errors import ConfigError
from odb_core.sample import Sample

BATCH = [Sample(0, 10), Sample(1, 30, visual_tokens=20, patches=4), Sample(2, 5)]


def test_padded_is_n_times_max_len() -> None:
    assert PaddedTokens().cost(BatchStats.of(BATCH)) == 3 * 50


def test_packed_is_sum_of_lengths() -> None:
    assert PackedTokens().cost(BatchStats.of(BATCH)) == 10 + 50 + 5


def test_attention_adds_quadratic_term() -> None:
    cost = AttentionAware(alpha=0.5).cost(BatchStats.of(BATCH))
    assert cost == 65 + 0.5 * (10**2 + 50**2 + 5**2)


def test_multimodal_weights_visual_tokens() -> None:
    assert Multimodal(visual_weight=2.0).cost(BatchStats.of(BATCH)) == 45 + 2 * 20


def test_budget_combines_tokens_samples_and_patches() -> None:
    stats = BatchStats.of(BATCH)
    model = PackedTokens()
    assert Budget(65).fits(stats, model)
    assert not Budget(64).fits(stats, model)
    assert not Budget(100, max_samples=2).fits(stats, model)
    assert not Budget(100, max_patches=3).fits(stats, model)
    assert Budget(100, max_samples=3, max_patches=4).fits(stats, model)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "8", True])
def test_bad_budget_names_the_value(bad: object) -> None:
    with pytest.raises(ConfigError, match=re_escape(repr(bad))):
        Budget(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["max_samples", "max_patches"])
def test_bad_budget_caps(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        Budget(10, **{field: 0})  # type: ignore[arg-type]


@pytest.mark.parametrize("alpha", [-1.0, math.nan])
def test_bad_attention_alpha(alpha: float) -> None:
    with pytest.raises(ConfigError, match="alpha"):
        AttentionAware(alpha)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


def test_attention_alpha_zero_is_packed_tokens() -> None:
    stats = BatchStats.of(BATCH)
    assert AttentionAware(0.0).cost(stats) == PackedTokens().cost(stats)
    assert AttentionAware(0).cost(stats) == stats.sum_len


@pytest.mark.parametrize("bad", [-0.5, -1, math.nan, math.inf, "2", None])
def test_bad_visual_weight_names_the_value(bad: object) -> None:
    with pytest.raises(
        ConfigError,
        match=re_escape(f"multimodal visual_weight={bad!r} must be a finite number >= 0"),
    ):
        Multimodal(visual_weight=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("weight", [0, 0.0, 0.5, 1, 3.0])
def test_visual_weights_from_zero_up_are_accepted(weight: float) -> None:
    stats = BatchStats.of(BATCH)
    assert (
        Multimodal(visual_weight=weight).cost(stats) == stats.sum_text + weight * stats.sum_visual
    )


def test_default_window_is_larger_under_padded_cost() -> None:
    from odb_core.config import DEFAULT_BUFFER_SIZE, PADDED_BUFFER_SIZE, default_buffer_size

    assert (DEFAULT_BUFFER_SIZE, PADDED_BUFFER_SIZE) == (64, 1024)
    assert default_buffer_size(PaddedTokens()) == default_buffer_size("padded") == 1024
    for other in (PackedTokens(), AttentionAware(), Multimodal(), "packed", "attention"):
        assert default_buffer_size(other) == 64


@pytest.mark.parametrize("kind", list(CostKind))
def test_make_cost_model_builds_each_kind_by_member_or_value(kind: CostKind) -> None:
    by_member, by_value = make_cost_model(kind), make_cost_model(kind.value)
    assert by_member == by_value
    assert by_member.name == kind.value


def test_make_cost_model_passes_parameters_and_names_an_unknown_kind() -> None:
    assert make_cost_model(CostKind.ATTENTION, alpha=0.5) == AttentionAware(0.5)
    assert make_cost_model("multimodal", visual_weight=2.0) == Multimodal(2.0)
    with pytest.raises(ConfigError, match="unknown cost model 'pad'; expected one of 'packed'"):
        make_cost_model("pad")
