"""The epoch step estimate: close to what the protocol then runs, the same on
every rank, never above the proven bound, and refined by finished epochs."""

from __future__ import annotations

import random

import pytest

from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import Budget, PaddedTokens
from odb_core.errors import ConfigError
from odb_core.estimate import StepsEstimate, estimate_epoch_steps, update
from odb_core.protocol import RankMachine, steps_bound
from odb_core.sample import Sample


def long_tail(n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(i, min(2048, max(8, int(rng.lognormvariate(5.5, 1.0))))) for i in range(n)]


def realised_steps(config: ProtocolConfig, samples: list[Sample], seed: int) -> int:
    """Run the protocol on a shuffled round-robin split, as the loader does."""
    order = list(samples)
    random.Random(seed).shuffle(order)
    w = config.world_size
    shards = [iter(order[r::w]) for r in range(w)]
    machines = [RankMachine(r, config) for r in range(w)]
    while machines[0].phase.value != "done":
        cs = [m.fill(lambda it=it: next(it, None)) for m, it in zip(machines, shards, strict=True)]
        for m in machines:
            m.all_gather(cs)
    return machines[0].steps


@pytest.mark.parametrize("world", [1, 2, 4])
def test_estimate_is_within_ten_percent_of_the_realised_epochs(world: int) -> None:
    config = ProtocolConfig(world_size=world, budget=Budget(8192), cost_model=PaddedTokens())
    data = long_tail(3000, seed=1)
    sample = random.Random(7).sample(data, 256)  # the loader measures 256
    sizes = [len(data[r::world]) for r in range(world)]
    est = estimate_epoch_steps(config, sample, sizes)
    real = [realised_steps(config, data, seed) for seed in range(3)]
    for r in real:
        assert abs(est.steps - r) / r <= 0.10, (est, real)
    assert est.steps <= est.upper <= steps_bound(sizes)
    # Wrong on purpose: a budget twice as large must move the estimate far away.
    wide = estimate_epoch_steps(
        ProtocolConfig(world_size=world, budget=Budget(16384), cost_model=PaddedTokens()),
        sample,
        sizes,
    )
    assert abs(wide.steps - real[0]) / real[0] > 0.25


def test_estimate_is_a_function_of_its_inputs() -> None:
    config = ProtocolConfig(world_size=3, budget=Budget(4096))
    sample = long_tail(50, seed=3)
    a = estimate_epoch_steps(config, sample, [100, 100, 99])
    b = estimate_epoch_steps(config, list(sample), [100, 100, 99])
    assert a == b


def test_quota_mode_estimates_the_first_rank_to_run_dry() -> None:
    sample = long_tail(64, seed=4)
    join = ProtocolConfig(world_size=2, budget=Budget(4096))
    quota = ProtocolConfig(world_size=2, budget=Budget(4096), mode=Mode.QUOTA)
    sizes = [400, 100]
    assert (
        estimate_epoch_steps(quota, sample, sizes).steps
        < estimate_epoch_steps(join, sample, sizes).steps
    )


def test_without_costs_the_estimate_is_the_proven_bound() -> None:
    config = ProtocolConfig(world_size=2, budget=Budget(64))
    est = estimate_epoch_steps(config, [], [5, 4])
    assert (est.steps, est.upper) == (5, 5) and "bound" in est.basis


def test_finished_epochs_refine_the_estimate() -> None:
    first = StepsEstimate(100, 110, "bootstrap")
    later = update(first, [90, 94])
    assert later.steps == 92 and later.upper >= 110
    assert update(first, []) == first


@pytest.mark.parametrize(
    ("sizes", "kw", "match"),
    [
        ([1], {}, "1 shard sizes for world_size=2"),
        ([1, -1], {}, "shard sizes"),
        ([1, 1], {"replicates": 0}, "replicates=0"),
    ],
)
def test_bad_input_names_the_value(sizes: list[int], kw: dict[str, int], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        estimate_epoch_steps(
            ProtocolConfig(world_size=2, budget=Budget(64)), [Sample(0, 1)], sizes, **kw
        )


def test_loader_length_is_the_upper_estimate_and_epochs_are_recorded() -> None:
    pytest.importorskip("torch")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from sft_support import ChatSFT, pad_collate
    from torch.utils.data import IterableDataset

    from odb_core import ODBDataLoader

    loader = ODBDataLoader(
        ChatSFT(400), token_budget=2048, cost_model="padded", collate_fn=pad_collate, shuffle=True
    )
    est = loader.steps_estimate()
    assert len(loader) == est.upper >= est.steps
    realised = [sum(1 for _ in loader) for _ in range(2)]
    assert loader.epoch_steps == {0: realised[0], 1: realised[1]}
    for r in realised:
        assert abs(est.steps - r) / r <= 0.15, (est, realised)

    class Stream(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([])

    with pytest.raises(TypeError, match="no length estimate"):
        len(ODBDataLoader(Stream(), token_budget=64))
