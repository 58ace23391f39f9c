"""`ProgressLR` in a plain loop on real gloo ranks: the schedule is driven by the
loader's exact run progress, so it starts at its start value and ends at its final
value on the last update, at G=1 and G=2, over 2 epochs, and after a resume at
another world size (2 -> 1, 2 -> 3). A schedule sized from `len(loader)` (the
step estimate) stops short on the same run, which shows the check can fail."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_ranks import launch, ok
from sft_support import ChatSFT, loss_tokens, pad_collate

from odb_core import ConfigError, ODBDataLoader
from odb_core.schedule import Schedule, match_fixed_batch
from odb_core.torch import ProgressLR, pop_step_meta, sample_profile

PEAK = 1e-3
EPOCHS = 2
SAMPLES = 60
BUDGET = 256


def _loader(G: int) -> ODBDataLoader:
    return ODBDataLoader(
        ChatSFT(SAMPLES, seed=1),
        token_budget=BUDGET,
        collate_fn=pad_collate,
        cost_model="padded",
        shuffle=True,
        seed=3,
        grad_accum_steps=G,
    )


def _train(
    loader: ODBDataLoader,
    sched: ProgressLR,
    opt: torch.optim.Optimizer,
    param: torch.nn.Parameter,
    stop_after: int | None = None,
    estimated: tuple[Any, Any] | None = None,
    epochs: int = EPOCHS,
) -> dict[str, Any]:
    """Run the loop to the end of the run (or `stop_after` updates); record the LR
    each update used and the progress it was taken at."""
    used, progress = [], []
    for _ in range(loader.epoch, epochs):
        for batch in loader:
            meta = pop_step_meta(batch)
            (param.sum() * meta.loss_scale).backward()
            if meta.sync_gradients:
                used.append(opt.param_groups[0]["lr"])
                progress.append(loader.run_progress.fraction(epochs))
                opt.step()
                sched.step()
                sched.step()  # a duplicate call (as Accelerate makes) changes nothing
                opt.zero_grad()
                if estimated is not None:
                    est_opt, est_sched = estimated
                    est_opt.step()
                    est_sched.step()
                if stop_after is not None and len(used) == stop_after:
                    return {"used": used, "progress": progress}
    return {"used": used, "progress": progress}


def run_plain(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, G, shape, warmup in (("g1", 1, "linear", 0.0), ("g2", 2, "cosine", 0.2)):
        loader = _loader(G)
        param = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([param], lr=PEAK)
        sched = ProgressLR(opt, loader, epochs=EPOCHS, shape=shape, warmup=warmup)
        start = sched.get_last_lr()[0]
        est_param = torch.nn.Parameter(torch.ones(1))
        est_opt = torch.optim.SGD([est_param], lr=PEAK)
        total = EPOCHS * math.ceil(len(loader) / G)  # the step-estimate recipe
        est = torch.optim.lr_scheduler.LambdaLR(est_opt, lambda s, t=total: max(0.0, 1 - s / t))
        lens = [len(loader)]
        run = _train(loader, sched, opt, param, estimated=(est_opt, est))
        lens.append(len(loader))
        out[name] = {
            **run,
            "start": start,
            "final": sched.get_last_lr()[0],
            "estimated_final": est.get_last_lr()[0],
            "lens": lens,
            "epoch_steps": list(loader.epoch_steps.values()),
        }
    return out


def run_save(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    loader = _loader(2)
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=PEAK)
    sched = ProgressLR(opt, loader, epochs=EPOCHS)
    run = _train(loader, sched, opt, param, stop_after=spec["stop_after"])
    return {
        **run,
        "loader": loader.state_dict(),
        "sched": sched.state_dict(),
        "lr": sched.get_last_lr()[0],
    }


def run_resume(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    loader = _loader(2)
    loader.load_state_dict(spec["states"])
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=PEAK)
    sched = ProgressLR(opt, loader, epochs=EPOCHS)
    sched.load_state_dict(spec["sched"])
    lr0 = opt.param_groups[0]["lr"]
    run = _train(loader, sched, opt, param)
    return {**run, "lr0": lr0, "final": sched.get_last_lr()[0]}


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return ok(launch("test_progress_lr:run_plain", 2, {}, tmp_path_factory.mktemp("plain")))


@pytest.mark.parametrize("name", ["g1", "g2"])
def test_schedule_ends_on_the_last_update(plain: list[dict[str, Any]], name: str) -> None:
    r0, r1 = (r[name] for r in plain)
    assert r0["used"] == r1["used"]  # the same rates on every rank
    assert r0["start"] == (PEAK if name == "g1" else 0.0)  # linear starts at peak; warmup at 0
    assert len(r0["used"]) >= 6
    assert r0["progress"][-1] == 1.0
    assert r0["final"] <= 1e-6 * PEAK
    schedule = Schedule("linear") if name == "g1" else Schedule("cosine", warmup=0.2)
    # Each update used the rate of the progress before it (the previous update's).
    before = [0.0, *r0["progress"][:-1]]
    assert r0["used"] == pytest.approx([PEAK * schedule.multiplier(p) for p in before], abs=1e-15)
    # A schedule sized from the step estimate stops short on the same run.
    assert r0["estimated_final"] > 1e-6 * PEAK


@pytest.mark.parametrize("name", ["g1", "g2"])
def test_len_is_stable_across_epochs(plain: list[dict[str, Any]], name: str) -> None:
    r0 = plain[0][name]
    assert r0["lens"][0] == r0["lens"][1]
    assert r0["lens"][0] >= max(r0["epoch_steps"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("save")
    # Past epoch 0 (about 4 updates of 2 steps each on these 60 samples).
    return ok(launch("test_progress_lr:run_save", 2, {"stop_after": 5}, out))


@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_another_world_size_ends_on_the_last_update(
    saved: list[dict[str, Any]], world: int, tmp_path: Path
) -> None:
    states = [r["loader"] for r in saved]
    assert states[0]["epoch"] == 1, "the save point should be inside epoch 1"
    spec = {"states": states, "sched": saved[0]["sched"]}
    resumed = ok(launch("test_progress_lr:run_resume", world, spec, tmp_path))
    for r in resumed:
        assert r["lr0"] == pytest.approx(saved[0]["lr"], rel=1e-12)  # continues where it was
        assert r["used"][0] == pytest.approx(saved[0]["lr"], rel=1e-12)
        assert r["progress"][-1] == 1.0
        assert r["final"] <= 1e-6 * PEAK
        assert r["used"] == resumed[0]["used"]
    # Linear decay, and strictly decreasing over the whole run.
    rates = saved[0]["used"] + resumed[0]["used"]
    assert all(a > b for a, b in itertools.pairwise(rates))


def test_sample_profile_is_the_loaders_and_sizes_the_fixed_batch_match() -> None:
    """One process: `sample_profile(dataset)` measures what the loader measures (every
    sample of a dataset under 256), so it sizes `tokens_per_update` before the loader."""
    ds = ChatSFT(SAMPLES, seed=1)
    profile = sample_profile(ds)
    exact = sum(loss_tokens(ds[i]) for i in range(SAMPLES)) / SAMPLES
    assert profile.measured == SAMPLES
    assert profile.loss_per_sample == pytest.approx(exact, rel=1e-12)
    assert match_fixed_batch(profile, batch_size=4, world_size=2) == round(8 * exact)
    loader = ODBDataLoader(ds, token_budget=BUDGET, collate_fn=pad_collate, cost_model="padded")
    assert loader.sample_profile() == profile
    masked = sample_profile(ds, loss_tokens_fn=lambda s: 1)
    assert masked.loss_per_sample == 1.0 and masked.cost_per_sample == profile.cost_per_sample


def test_bad_scheduler_input_is_named() -> None:
    loader = ODBDataLoader(ChatSFT(8), token_budget=BUDGET, collate_fn=pad_collate)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=PEAK)
    with pytest.raises(ConfigError, match="epochs=0"):
        ProgressLR(opt, loader, epochs=0)
    with pytest.raises(ConfigError, match="source=list"):
        ProgressLR(opt, [], epochs=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tokens=3"):
        ProgressLR(opt, loader, epochs=1, tokens=3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="shape"):
        ProgressLR(opt, loader, epochs=1, shape="exponential")
    sched = ProgressLR(opt, loader, epochs=1)
    state = sched.state_dict()
    assert set(state) <= {"base_lrs", "last_epoch", "_step_count", "_last_lr", "applied_lr"}
    with pytest.raises(ConfigError, match="unknown keys"):
        sched.load_state_dict({**state, "lr_lambdas": []})

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([])

    stream = ODBDataLoader(Stream(), token_budget=BUDGET)
    with pytest.raises(ConfigError, match="IterableDataset"):
        ProgressLR(opt, stream, epochs=1)


def test_quota_epochs_are_the_clock_in_quota_mode() -> None:
    """One process, quota mode: an epoch consumes the quota (a pass closed short of
    it counts whole), so the schedule still ends on the last update of the run."""
    loader = ODBDataLoader(
        ChatSFT(SAMPLES, seed=1),
        token_budget=BUDGET,
        collate_fn=pad_collate,
        cost_model="padded",
        mode="quota",
        quota=25,
    )
    assert loader.epoch_samples == 25
    param = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([param], lr=PEAK)
    sched = ProgressLR(opt, loader, epochs=3)
    run = _train(loader, sched, opt, param, epochs=3)
    assert run["progress"][-1] == 1.0 and sched.get_last_lr()[0] == 0.0
    # Each quota pass ends at a whole third of the run.
    assert [p for p in run["progress"] if p * 3 == round(p * 3)] == [1 / 3, 2 / 3, 1.0]
