"""`ProgressLR` through Accelerate on real gloo ranks: `accelerator.prepare(scheduler)`
steps it once per process at every update (`split_batches=False`), and it still
follows the run's exact progress: it ends at its final value on the last update
over 2 epochs at G=1 and G=2; saved with `accelerator.save_state` inside epoch 1
and loaded on 1 and on 3 ranks, it goes on from the saved progress and ends
there too. A token-aware case (`tokens_per_update` windows, `TokenScaling`)
checks each update's rate against its window's global loss tokens.

The schedule users write instead, `LinearLR(total_iters=len(train) * epochs)` (the
"steps" case), stops above its end (`len()` is an upper estimate); the adapter warns
once, at the end of the first short epoch, naming the figures and `ProgressLR`. The
broken variant (the adapter's check switched off, "steps_unwarned") is caught."""

from __future__ import annotations

import itertools
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from gloo_ranks import launch, ok, set_rank_env  # noqa: E402
from sft_support import VOCAB, ChatSFT, pad_collate  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.bench.launch import free_port  # noqa: E402
from odb_core.schedule import Schedule, TokenScaling  # noqa: E402
from odb_core.torch import ProgressLR, pop_step_meta, scaled_loss  # noqa: E402

pytestmark = pytest.mark.torch

PEAK = 1e-3
EPOCHS = 2
SAMPLES = 60
TOKENS = 300  # tokens_per_update and the token rule's reference in the "tokens" case

CASES: dict[str, dict[str, Any]] = {
    "g1": {"loader": {"grad_accum_steps": 1}, "schedule": {"shape": "linear"}},
    "g2": {"loader": {"grad_accum_steps": 2}, "schedule": {"shape": "cosine", "warmup": 0.2}},
    "tokens": {"loader": {"tokens_per_update": TOKENS}, "schedule": {"shape": "linear"}},
    "resume": {"loader": {"grad_accum_steps": 2}, "schedule": {"shape": "linear"}},
    "steps": {"loader": {"grad_accum_steps": 2}, "schedule": None},
}


def _accelerator(rank: int, world: int, port: int) -> Any:
    set_rank_env(rank, world, port)
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _run(
    accelerator: Any,
    name: str,
    *,
    save_after: int | None = None,
    ckpt: str | None = None,
    load: str | None = None,
) -> dict[str, Any]:
    from odb_core.integrations import accelerate as odb_accelerate
    from odb_core.integrations.accelerate import prepare_odb_loader

    odb_accelerate._warned.discard("short")  # once per process: once per run here
    case = CASES[name]
    torch.manual_seed(0)
    model = torch.nn.Embedding(VOCAB, 4)
    opt = torch.optim.SGD(model.parameters(), lr=PEAK)
    loader = ODBDataLoader(
        ChatSFT(SAMPLES, seed=1),
        token_budget=256,
        collate_fn=pad_collate,
        cost_model="padded",
        shuffle=True,
        seed=3,
        **case["loader"],
    )
    train = prepare_odb_loader(accelerator, loader)
    tokens = TokenScaling(TOKENS, "sqrt") if name == "tokens" else None
    if case["schedule"] is None:  # sized in steps from len(), as users write it
        total = len(train) * EPOCHS
        sched: Any = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=total)
    else:
        sched = ProgressLR(opt, train, epochs=EPOCHS, tokens=tokens, **case["schedule"])
    model, opt, prepared = accelerator.prepare(model, opt, sched)
    if load is not None:
        accelerator.load_state(load)
    used: list[float] = []
    applied: list[float] = []
    window_tokens: list[int] = []
    progress: list[float] = []
    epoch_steps: list[int] = []
    for _ in range(train.epoch, EPOCHS):
        epoch_steps.append(0)
        for batch in train:
            epoch_steps[-1] += 1
            meta = pop_step_meta(batch)
            with train.accumulate(model):
                loss = model(batch["input_ids"]).pow(2).mean()
                accelerator.backward(scaled_loss(meta, loss))
                if meta.sync_gradients:
                    used.append(float(opt.param_groups[0]["lr"]))
                    window_tokens.append(meta.window_loss_tokens)
                    progress.append(train.run_progress.fraction(EPOCHS))
                opt.step()
                if meta.sync_gradients:
                    applied.append(sched.applied_lr[0] if tokens else used[-1])
                    assert opt.param_groups[0]["lr"] == used[-1]  # taken back after the update
                prepared.step()
                opt.zero_grad()
            if save_after is not None and meta.sync_gradients and len(used) == save_after:
                accelerator.save_state(ckpt)
                return {"used": used, "progress": progress, "lr": sched.get_last_lr()[0]}
    return {
        "used": used,
        "applied": applied,
        "window_tokens": window_tokens,
        "progress": progress,
        "final": sched.get_last_lr()[0],
        "epoch_steps": epoch_steps,
        "estimate": len(train),
    }


def _run_recorded(accelerator: Any, name: str) -> dict[str, Any]:
    """`_run`, with odb's warnings that name ProgressLR."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _run(accelerator, name)
    out["warnings"] = [str(w.message) for w in caught if "ProgressLR" in str(w.message)]
    return out


def run_train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    # A fresh Accelerator per run: save_state writes every object prepared on it.
    from odb_core.integrations.accelerate import ODBAcceleratedLoader

    out = {
        name: _run_recorded(_accelerator(rank, world, spec["port"]), name)
        for name in ("g1", "g2", "tokens", "steps")
    }
    ODBAcceleratedLoader._check_short_schedule = lambda *a: None  # type: ignore[method-assign]
    out["steps_unwarned"] = _run_recorded(_accelerator(rank, world, spec["port"]), "steps")
    out["saved"] = _run(
        _accelerator(rank, world, spec["port"]),
        "resume",
        save_after=spec["save_after"],
        ckpt=spec["ckpt"],
    )
    return out


def run_load(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    return _run(_accelerator(rank, world, spec["port"]), "resume", load=spec["ckpt"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], str]:
    out = tmp_path_factory.mktemp("accelerate_lr")
    ckpt = str(out / "ckpt")
    # About 4 windows of 2 steps per epoch here: the 5th update is inside epoch 1.
    spec = {"port": free_port(), "ckpt": ckpt, "save_after": 5}
    return ok(launch("test_progress_lr_accelerate:run_train", 2, spec, out)), ckpt


def _expected(name: str, before: list[float]) -> list[float]:
    return [PEAK * Schedule(**CASES[name]["schedule"]).multiplier(p) for p in before]


@pytest.mark.parametrize("name", ["g1", "g2", "tokens"])
def test_schedule_ends_on_the_last_update(
    trained: tuple[list[dict[str, Any]], str], name: str
) -> None:
    ranks, _ = trained
    for r in ranks:
        run = r[name]
        assert run["warnings"] == []
        assert run["used"] == ranks[0][name]["used"]
        assert len(run["used"]) >= 4 and run["progress"][-1] == 1.0
        assert run["final"] <= 1e-6 * PEAK
        assert run["used"] == pytest.approx(_expected(name, [0.0, *run["progress"][:-1]]))


def check_short_schedule_warned(run: dict[str, Any]) -> None:
    """A schedule of len(train) * epochs steps stops above its end, and the first
    short epoch's figures are in one warning that names ProgressLR."""
    assert run["final"] > 1e-6 * PEAK, "the step-sized schedule reached its end"
    short = next(e for e, n in enumerate(run["epoch_steps"]) if n < run["estimate"])
    assert len(run["warnings"]) == 1, f"warned {len(run['warnings'])} times"
    (warning,) = run["warnings"]
    stated = f"epoch {short} ran {run['epoch_steps'][short]} steps where len(train) estimated"
    assert f"{stated} {run['estimate']}" in warning, warning
    assert "ProgressLR(optimizer, train, epochs=E)" in warning, warning


def test_a_step_sized_schedule_is_warned_about(
    trained: tuple[list[dict[str, Any]], str],
) -> None:
    ranks, _ = trained
    print()
    for r in ranks:
        run = r["steps"]
        print(
            f"LinearLR(total_iters=len(train) * {EPOCHS}): epochs of {run['epoch_steps']} "
            f"steps, len(train) {run['estimate']}, final lr {run['final']:.3g} of {PEAK}"
        )
        print(run["warnings"][0] if run["warnings"] else "no warning")
        check_short_schedule_warned(run)
        with pytest.raises(AssertionError, match="warned 0 times"):
            check_short_schedule_warned(r["steps_unwarned"])


def test_token_aware_rate_scales_each_update_by_its_window_tokens(
    trained: tuple[list[dict[str, Any]], str],
) -> None:
    run = trained[0][0]["tokens"]
    want = [
        lr * math.sqrt(t / TOKENS) for lr, t in zip(run["used"], run["window_tokens"], strict=True)
    ]
    assert run["applied"] == pytest.approx(want, rel=1e-12)
    # The windows differ in tokens, so the rule changed the rates.
    assert len(set(run["window_tokens"])) > 1
    assert any(abs(a - u) > 1e-6 * PEAK for a, u in zip(run["applied"], run["used"], strict=True))


@pytest.mark.parametrize("world", [1, 3])
def test_loaded_at_another_world_size_ends_on_the_last_update(
    trained: tuple[list[dict[str, Any]], str], world: int, tmp_path: Path
) -> None:
    ranks, ckpt = trained
    saved = ranks[0]["saved"]
    assert 0.5 < saved["progress"][-1] < 1.0, "the save point should be inside epoch 1"
    spec = {"port": free_port(), "ckpt": ckpt}
    loaded = ok(launch("test_progress_lr_accelerate:run_load", world, spec, tmp_path))
    for r in loaded:
        assert r["used"] == loaded[0]["used"]
        assert r["used"][0] == pytest.approx(saved["lr"], rel=1e-12)
        assert r["progress"][-1] == 1.0
        assert r["final"] <= 1e-6 * PEAK
        rates = saved["used"] + r["used"]
        assert all(a > b for a, b in itertools.pairwise(rates))
        before = [saved["progress"][-1], *r["progress"][:-1]]
        assert r["used"] == pytest.approx(_expected("resume", before))
