"""The `grouped` baselines: HF `group_by_length` and Accelerate's sharding, index for
index against the installed transformers / accelerate, and LLaVA's modality grouping."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import pytest

from simulator import grouped_baselines as grouped
from simulator.engine import SimConfig, simulate
from simulator.hardware import make_hardware
from simulator.workloads import make_workload

Order = Callable[[Sequence[int], int, Sequence[int]], list[int]]
Shard = Callable[[Sequence[int], int, int], list[list[list[int]]]]

CASES = [(1000, 8, 0), (1000, 31, 1), (37, 4, 2), (5, 8, 3), (2501, 2, 4)]


def _lengths(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.choice([rng.randint(1, 50), rng.randint(1, 4000)]) for _ in range(n)]


def _hf_matches(order: Order) -> bool:
    torch = pytest.importorskip("torch")
    tpu = pytest.importorskip("transformers.trainer_pt_utils")
    for n, bs, seed in CASES:
        lengths = _lengths(n, seed)
        theirs = tpu.get_length_grouped_indices(
            lengths, bs, generator=torch.Generator().manual_seed(seed)
        )
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
        if order(lengths, bs, perm) != theirs:
            return False
    return True


def _accelerate_matches(shard: Shard) -> bool:
    from torch.utils.data import BatchSampler

    data_loader = pytest.importorskip("accelerate.data_loader")
    for n, bs, world in [(100, 8, 8), (2500, 8, 64), (37, 4, 3), (5, 8, 4), (64, 8, 8), (9, 2, 2)]:
        order = list(range(1000, 1000 + n))
        ours = shard(order, bs, world)
        for r in range(world):
            theirs = data_loader.BatchSamplerShard(
                BatchSampler(order, bs, drop_last=False), world, r, False, True
            )
            if [list(b) for b in theirs] != ours[r]:
                return False
    return True


def test_length_grouping_is_hf_get_length_grouped_indices() -> None:
    assert _hf_matches(grouped.length_grouped_indices)


def test_sharding_is_accelerate_batch_sampler_shard() -> None:
    assert _accelerate_matches(grouped.accelerate_shard)


def _no_swap(lengths: Sequence[int], bs: int, perm: Sequence[int]) -> list[int]:
    size = grouped.hf_mega_batch_mult(len(lengths), bs) * bs
    mbs = [sorted(perm[i : i + size], key=lambda j: -lengths[j]) for i in range(0, len(perm), size)]
    return [i for mb in mbs for i in mb]


def _whole_sort(lengths: Sequence[int], bs: int, perm: Sequence[int]) -> list[int]:
    return sorted(perm, key=lambda j: lengths[j], reverse=True)


def _strided(order: Sequence[int], bs: int, world: int) -> list[list[list[int]]]:
    plan = grouped.accelerate_shard(order, bs, world)
    return [[sorted(b) for b in p] for p in plan]


def _no_even(order: Sequence[int], bs: int, world: int) -> list[list[list[int]]]:
    batches = [list(order[i : i + bs]) for i in range(0, len(order), bs)]
    return [batches[r::world] for r in range(world)]


@pytest.mark.parametrize("broken", [_no_swap, _whole_sort], ids=lambda f: f.__name__)
def test_a_wrong_grouping_is_caught(broken: Order) -> None:
    assert not _hf_matches(broken)


@pytest.mark.parametrize("broken", [_strided, _no_even], ids=lambda f: f.__name__)
def test_a_wrong_sharding_is_caught(broken: Shard) -> None:
    assert not _accelerate_matches(broken)


def test_hf_megabatch_size() -> None:
    assert grouped.hf_mega_batch_mult(20_000, 8) == 50
    assert grouped.hf_mega_batch_mult(1000, 31) == 8
    assert grouped.hf_mega_batch_mult(10, 8) == 1


def _rng_permute(seed: int) -> grouped.Permute:
    import random

    rng = random.Random(seed)

    def permute(n: int) -> list[int]:
        out = list(range(n))
        rng.shuffle(out)
        return out

    return permute


def test_modality_grouping_keeps_modalities_apart_and_balances_ranks() -> None:
    n, bs, world = 203, 4, 3
    lengths = _lengths(n, 7)
    mm = [i % 3 != 0 for i in range(n)]
    order = grouped.modality_grouped_indices(lengths, mm, bs, world, _rng_permute(1))
    assert Counter(order) == Counter(range(n))
    size = bs * world
    megabatches = [order[i : i + size] for i in range(0, n, size)]
    mixed = [mb for mb in megabatches if len({mm[i] for i in mb}) > 1]
    assert len(mixed) <= 1  # only the leftovers of both modalities share a megabatch
    for mb in megabatches:
        if len(mb) == size:
            chunks = [mb[k * bs : (k + 1) * bs] for k in range(world)]
            totals = sorted(sum(lengths[i] for i in c) for c in chunks)
            longest = max(lengths[i] for i in mb)
            assert totals[-1] - totals[0] <= longest  # balanced to within one sample


def test_even_chunks_fills_the_lightest_chunk() -> None:
    lengths = {0: 10, 1: 9, 2: 2, 3: 1}
    assert grouped._even_chunks([0, 1, 2, 3], lengths, 2) == [[0, 3], [1, 2]]  # type: ignore[arg-type]
    assert grouped._even_chunks([0, 1, 2], lengths, 2) == [[0, 2], [1]]  # type: ignore[arg-type]


def test_grouped_pads_little_with_standard_step_count() -> None:
    cfg = SimConfig(
        workload=make_workload("ultrachat", 2000, 0),
        ranks=8,
        hardware=make_hardware("h100", 1),
        strategies=("standard", "grouped", "grouped-modality", "odb"),
    )
    out = simulate(cfg)
    s, r = out["strategies"], out["ratios"]
    assert s["grouped"]["steps"] == s["standard"]["steps"]
    assert s["grouped"]["padding_ratio"] < 0.25 * s["standard"]["padding_ratio"]
    assert s["grouped"]["lost_ids"] == 0
    assert r["grouped"]["vs_grouped"] == 1.0
    assert r["odb"]["vs_grouped"] == pytest.approx(
        s["odb"]["samples_per_s"] / s["grouped"]["samples_per_s"], rel=1e-2
    )


@pytest.mark.parametrize("cost", ["packed", "padded"])
def test_time_split_adds_up_to_the_wall_time(cost: str) -> None:
    cfg = SimConfig(
        workload=make_workload("mmmix", 2000, 0),
        ranks=8,
        hardware=make_hardware("h100", 1),
        strategies=("standard", "gmt", "grouped", "odb"),
        cost=cost,
    )
    for name, m in simulate(cfg)["strategies"].items():
        t = m["time_s"]
        parts = t["data_wait"] + t["compute"] + t["rank_imbalance"] + t["step_overhead"]
        assert parts == pytest.approx(m["wall_s"], abs=0.01), name
        assert 0 <= t["of_which_padding"] <= t["compute"], name
        assert (t["of_which_padding"] > 0) == (m["padding_ratio"] > 0), name
        assert t["rank_imbalance"] > 0 and t["step_overhead"] > 0, name
