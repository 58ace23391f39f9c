"""The Accelerate adapter on real processes: two gloo ranks, `Accelerator(cpu=True)`.

Each rank initialises a gloo process group itself (RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_* set as a launcher would) and then builds `Accelerator(cpu=True)`, which
finds the group initialised and wraps the model in DDP (MULTI_CPU). A tiny
random-init `LlamaForCausalLM` (float64) trains with SGD on chat SFT samples with
masked prompts (`sft_support.py`), through `prepare_odb_loader`.

Every optimizer step of epoch 0 records (from an optimizer pre-hook, so only the
steps Accelerate really took) the gradient it consumes and the parameters it
was computed at. The test process loads those parameters into one model and
computes the single-process per-token mean over exactly the window's samples;
the two agree within 1e-6 relative L2, with windows of one step and of two, at
a step where one rank pads, and on the epoch's short last window.

Cases, one launch (`resume` first, so its checkpoint holds only its objects):

- `resume`: `grad_accum_steps=2`, deterministic; `accelerator.save_state` after an
  optimizer step mid-epoch, then the epoch continues. A second launch (fresh
  processes) builds the same objects, `accelerator.load_state`s and finishes the
  epoch: the same batches as the uninterrupted run, every sample once, the same
  final parameters.
- `ga1`: windows of one step, padded batches, `model(**batch).loss`, 2 epochs.
- `ga2`: `grad_accum_steps=2`, packed rows, uneven shards (rank 1 pads), the last
  window short.
- `misuse`: `accelerator.accumulate(model)` with 2-step windows raises.
- `baseline`: what Accelerate would do without the adapter (the wrong variant): the
  ODB loader through `accelerator.prepare`, `Accelerator` accumulation of 2: raises.
- bad input checks.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest
from guards import HANG_GUARD_S, run_script

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from gloo_ranks import launch_entry, set_rank_env  # noqa: E402
from sft_support import (  # noqa: E402
    COLLATES,
    MODELS,
    ChatSFT,
    Reference,
    flat_grad,
    rel_l2,
)

from odb_core.bench.launch import init_local_gloo, release_child_resources  # noqa: E402
from odb_core.errors import ConfigError  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 2
TOL = 1e-6
WRONG = 1e-4
LR = 0.5

COMMON = {
    "deterministic": True,
    "buffer_size": 16,
    "max_steps_per_round": 4,
    "num_workers": 0,
}

CASES: dict[str, dict[str, Any]] = {
    "resume": {
        "data": {"n": 64, "seed": 11},
        "collate": "padded",
        "loss": "hf",
        "epochs": 1,
        "save_after_update": 3,
        "loader": {
            "cost_model": "padded",
            "token_budget": 160,
            "shuffle": True,
            "seed": 3,
            "grad_accum_steps": 2,
        },
    },
    "ga1": {
        "data": {"n": 48, "seed": 1, "masked_every": 11},
        "collate": "padded",
        "loss": "hf",
        "epochs": 2,
        "loader": {"cost_model": "padded", "token_budget": 256, "shuffle": True, "seed": 5},
    },
    "ga2": {
        # Unshuffled, skewed: rank 0 holds the long samples, rank 1 runs dry and pads.
        "data": {"n": 36, "seed": 2, "skew": True},
        "collate": "packed",
        "loss": "causal_lm",
        "epochs": 1,
        "loader": {
            "cost_model": "packed",
            "token_budget": 320,
            "shuffle": False,
            "grad_accum_steps": 2,
        },
    },
}
# PEFT LoRA (`sft_support.lora_llama`) on ga2's data and loader: the adapter's gradient.
CASES["ga2_lora"] = {**CASES["ga2"], "model": "lora"}
BASELINE = "ga2"  # the data and loader the baseline (no adapter) runs on


# ---- what runs inside a rank ----------------------------------------------------------


def _flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


def _build(accelerator: Any, case: dict[str, Any]) -> tuple[Any, Any, Any]:
    from odb_core import ODBDataLoader

    model = MODELS[case.get("model", "full")](seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = ODBDataLoader(
        ChatSFT(**case["data"]), collate_fn=COLLATES[case["collate"]], **COMMON, **case["loader"]
    )
    return model, optimizer, loader


def _loss(case: dict[str, Any], model: Any, batch: dict[str, Any], meta: Any) -> Any:
    from odb_core.torch import causal_lm_loss, scaled_loss

    if case["loss"] == "hf":
        return scaled_loss(meta, model(**batch).loss)
    labels = batch.pop("labels")
    return causal_lm_loss(meta, model(**batch).logits, labels)


class Recorder:
    """The optimizer steps Accelerate really took: the gradient each consumed and
    the parameters it was computed at (epoch 0 only)."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.module = model.module if hasattr(model, "module") else model
        self.updates = [0]  # per epoch
        self.grads: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []
        self.record = True
        optimizer.optimizer.register_step_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.updates[-1] += 1
        if self.record:
            self.grads.append(flat_grad(self.module))
            self.params.append(_flat_params(self.module))

    def new_epoch(self) -> None:
        self.updates.append(0)
        self.record = False


def _step_row(train: Any, accelerator: Any, batch: dict[str, Any], meta: Any) -> dict[str, Any]:
    info = train.loader.step_info
    return {
        "step": meta.step,
        "window": meta.window,
        "sync": meta.sync_gradients,
        "is_pad": meta.is_pad,
        "ids": [int(i) for i in info.sample_ids],
        "acc_sync": accelerator.sync_gradients,
        "end": accelerator.gradient_state.end_of_dataloader,
        "device": str(batch["input_ids"].device),
        "epoch": train.loader.epoch,
    }


def run_case(accelerator: Any, name: str, ckpt: str | None = None) -> dict[str, Any]:
    from odb_core.integrations.accelerate import prepare_odb_loader
    from odb_core.torch import pop_step_meta

    case = CASES[name]
    model, optimizer, loader = _build(accelerator, case)
    train = prepare_odb_loader(accelerator, loader)
    rec = Recorder(model, optimizer)
    epochs: list[list[dict[str, Any]]] = []
    leftover: list[bool] = []
    saved_at = None
    estimate = _length(train)  # before any epoch: from a sample of costs
    if ckpt is not None and name == "resume_load":
        accelerator.load_state(ckpt)
    for e in range(case["epochs"]):
        if e:
            rec.new_epoch()
        rows = []
        for batch in train:
            meta = pop_step_meta(batch)
            rows.append(_step_row(train, accelerator, batch, meta))
            with train.accumulate(model):
                accelerator.backward(_loss(case, model, batch, meta))
                optimizer.step()
                optimizer.zero_grad()
            if (
                ckpt is not None
                and name == "resume"
                and meta.sync_gradients
                and rec.updates[0] == case["save_after_update"]
            ):
                accelerator.save_state(ckpt)
                saved_at = meta.step
        epochs.append(rows)
        leftover.append(any(p.grad is not None for p in model.parameters()))
    return {
        "epochs": epochs,
        "updates": rec.updates,
        "grads": rec.grads,
        "params": rec.params,
        "leftover_grads": leftover,
        "final_params": _flat_params(rec.module),
        "saved_at": saved_at,
        "len": [estimate, _length(train)],
        "epoch_steps": train.loader.epoch_steps,
    }


def _length(train: Any) -> int | None:
    try:
        return len(train)
    except TypeError:  # a loader without a step estimate
        return None


def run_baseline(accelerator: Any) -> dict[str, Any]:
    """Accelerate without the adapter: `prepare` returns the ODB loader untouched and
    Accelerate would count windows of 2 and divide the loss by 2 (4.7e-3 off the
    exact update, silently, before the loader checked it): iterating it raises."""
    from odb_core.errors import ConfigError

    case = CASES[BASELINE]
    _model, _optimizer, loader = _build(accelerator, case)
    prepared = accelerator.prepare(loader)
    accelerator.gradient_accumulation_steps = 2
    raised = ""
    try:
        for _batch in prepared:
            break
    except ConfigError as exc:
        raised = str(exc)
    finally:
        accelerator.gradient_accumulation_steps = 1
    for _batch in prepared:  # Accelerate's accumulation off again: it runs
        break
    loader.close()
    return {"same_object": prepared is loader, "raised": raised}


def run_misuse(accelerator: Any) -> str:
    """`accelerator.accumulate(model)` with the loader's 2-step windows."""
    from odb_core.integrations.accelerate import prepare_odb_loader
    from odb_core.torch import pop_step_meta

    case = CASES["ga2"]
    model, optimizer, loader = _build(accelerator, case)
    train = prepare_odb_loader(accelerator, loader, register_for_checkpointing=False)
    try:
        for batch in train:
            meta = pop_step_meta(batch)
            with accelerator.accumulate(model):
                accelerator.backward(_loss(case, model, batch, meta))
                optimizer.step()
                optimizer.zero_grad()
    except ConfigError as exc:
        return f"step {meta.step}: {exc}"
    return "no error"


def run_bad_input(accelerator: Any) -> dict[str, str]:
    from accelerate import Accelerator, DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from odb_core import ODBDataLoader
    from odb_core.integrations.accelerate import prepare_odb_loader

    out: dict[str, str] = {}
    ds = ChatSFT(8, seed=0)
    try:
        prepare_odb_loader(accelerator, accelerator.prepare(DataLoader(ds, batch_size=2)))
        out["plain"] = "no error"
    except ConfigError as exc:
        out["plain"] = str(exc)
    loader = ODBDataLoader(ds, token_budget=256, collate_fn=COLLATES["padded"], **COMMON)
    accelerator.gradient_accumulation_steps = 4
    try:
        prepare_odb_loader(accelerator, loader, register_for_checkpointing=False)
        out["accum"] = "no error"
    except ConfigError as exc:
        out["accum"] = str(exc)
    finally:
        accelerator.gradient_accumulation_steps = 1
    split = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_odb_loader(split, loader, register_for_checkpointing=False)
        prepare_odb_loader(split, loader, register_for_checkpointing=False)
    out["split"] = " | ".join(str(w.message) for w in caught if "split_batches" in str(w.message))
    return out


def _rank_entry(rank: int, world: int, port: int, out: str, phase: str, ckpt: str) -> None:
    set_rank_env(rank, world, port, OMP_NUM_THREADS="1")
    try:
        init_local_gloo(rank, world, port, timeout_s=HANG_GUARD_S)
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        result: dict[str, Any] = {
            "times": {},
            "accelerator": (accelerator.num_processes, accelerator.process_index),
            "device": str(accelerator.device),
        }
        jobs: dict[str, Any]
        if phase == "train":
            jobs = {
                "resume": lambda: run_case(accelerator, "resume", ckpt),
                "ga1": lambda: run_case(accelerator, "ga1"),
                "ga2": lambda: run_case(accelerator, "ga2"),
                "ga2_lora": lambda: run_case(accelerator, "ga2_lora"),
                "misuse": lambda: run_misuse(accelerator),
                "bad_input": lambda: run_bad_input(accelerator),
                "baseline": lambda: run_baseline(accelerator),
            }
        else:
            CASES["resume_load"] = CASES["resume"]
            jobs = {"resume_load": lambda: run_case(accelerator, "resume_load", ckpt)}
        for name, job in jobs.items():
            t0 = time.perf_counter()
            result[name] = job()
            result["times"][name] = round(time.perf_counter() - t0, 2)
        torch.save(result, Path(out, f"rank{rank}.pt"))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
    release_child_resources()
    os._exit(0)  # a peer may be dead: skip destroy_process_group's handshake


# ---- the launch and the reference -------------------------------------------------------


def launch(
    out: Path, phase: str, ckpt: Path, timeout: float = HANG_GUARD_S
) -> list[dict[str, Any]]:
    return launch_entry(_rank_entry, WORLD, out, phase, str(ckpt), timeout=timeout)


def reference_model(name: str, params: torch.Tensor) -> Any:
    """Case `name`'s model (full or LoRA) at `params`."""
    model = MODELS[CASES[name].get("model", "full")](seed=0)
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    return model


def reference_grad(name: str, params: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """The single-process per-token mean gradient over `ids` at `params`."""
    return Reference(reference_model(name, params), ChatSFT(**CASES[name]["data"])).mean(ids)


def windows_of(rows: list[dict[str, Any]]) -> list[list[int]]:
    out: list[list[int]] = []
    for t in range(len(rows)):
        if not out or rows[t - 1]["sync"]:
            out.append([])
        out[-1].append(t)
    return out


def window_ids(per_rank: list[dict[str, Any]], steps: list[int], epoch: int = 0) -> list[int]:
    return [i for t in steps for r in per_rank for i in r["epochs"][epoch][t]["ids"]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    t0 = time.perf_counter()
    base = tmp_path_factory.mktemp("accelerate")
    ckpt = base / "ckpt"
    train = launch(base / "train", "train", ckpt)
    t1 = time.perf_counter()
    resumed = launch(base / "resume", "resume", ckpt)
    print(
        f"\naccelerate launches {t1 - t0:.1f}s + {time.perf_counter() - t1:.1f}s; "
        f"per case {train[0]['times']}"
    )
    return {"train": train, "resumed": resumed}


def case(runs: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in runs["train"]]


# ---- tests ----------------------------------------------------------------------------------


def test_accelerator_picked_up_the_gloo_group(runs: dict[str, Any]) -> None:
    for rank, r in enumerate(runs["train"]):
        assert r["accelerator"] == (WORLD, rank)
        assert r["device"].startswith("cpu")


def test_batches_on_device_sync_and_end_of_dataloader_follow_the_loader(
    runs: dict[str, Any],
) -> None:
    for name in ("ga1", "ga2", "resume", "resume_load"):
        per_rank = [r[name] for r in runs["resumed" if name == "resume_load" else "train"]]
        for r in per_rank:
            for rows in r["epochs"]:
                want = torch.device(runs["train"][0]["device"]).type
                assert {torch.device(row["device"]).type for row in rows} == {want}
                assert [row["acc_sync"] for row in rows] == [row["sync"] for row in rows]
                ends = [row["end"] for row in rows]
                assert ends == [False] * (len(rows) - 1) + [True], name


def test_every_sample_once_per_epoch_and_new_order(runs: dict[str, Any]) -> None:
    per_rank = case(runs, "ga1")
    n = CASES["ga1"]["data"]["n"]
    orders = []
    for e in range(2):
        counts = {len(r["epochs"][e]) for r in per_rank}
        assert len(counts) == 1, f"epoch {e}: step counts differ across ranks: {counts}"
        ids = window_ids(per_rank, list(range(counts.pop())), e)
        assert sorted(ids) == list(range(n)), f"epoch {e}: not every sample exactly once"
        assert {row["epoch"] for r in per_rank for row in r["epochs"][e]} == {e}
        orders.append([row["ids"] for row in per_rank[0]["epochs"][e]])
    assert orders[0] != orders[1], "the two epochs have the same order"
    for name in ("ga2", "resume"):
        per_rank = case(runs, name)
        ids = window_ids(per_rank, list(range(len(per_rank[0]["epochs"][0]))))
        assert sorted(ids) == list(range(CASES[name]["data"]["n"])), name


def test_one_optimizer_step_per_window_on_every_rank(runs: dict[str, Any]) -> None:
    for name in ("ga1", "ga2", "resume"):
        per_rank = case(runs, name)
        windows = [len(windows_of(rows)) for rows in per_rank[0]["epochs"]]
        for r in per_rank:
            assert r["updates"] == windows, (name, r["updates"], windows)
            assert not any(r["leftover_grads"]), f"{name}: gradients left after the epoch"
        assert len(per_rank[0]["grads"]) == windows[0]


def _errors(runs: dict[str, Any], name: str) -> list[float]:
    per_rank = case(runs, name)
    out = []
    for w, steps in enumerate(windows_of(per_rank[0]["epochs"][0])):
        assert rel_l2(per_rank[1]["grads"][w], per_rank[0]["grads"][w]) <= 1e-12
        ref = reference_grad(name, per_rank[0]["params"][w], window_ids(per_rank, steps))
        out.append(rel_l2(per_rank[0]["grads"][w], ref))
    return out


def test_windows_of_one_step_match_single_process(runs: dict[str, Any]) -> None:
    errors = _errors(runs, "ga1")
    print(f"[ga1] first update rel L2 {errors[0]:.3g}; max over {len(errors)} {max(errors):.3g}")
    assert max(errors) <= TOL, errors


def test_windows_of_two_steps_pad_step_and_short_last_window(runs: dict[str, Any]) -> None:
    per_rank = case(runs, "ga2")
    rows0, rows1 = (r["epochs"][0] for r in per_rank)
    windows = windows_of(rows0)
    assert all(len(s) == 2 for s in windows[:-1])
    assert len(windows[-1]) == 1, "the epoch should end in a short window"
    pads = [t for t in range(len(rows0)) if rows1[t]["is_pad"] and not rows0[t]["is_pad"]]
    assert pads, "rank 1 never padded: the shards are not uneven enough"
    (pad_window,) = {w for w, steps in enumerate(windows) if pads[0] in steps}
    errors = _errors(runs, "ga2")
    print(
        f"[ga2] first update {errors[0]:.3g}, pad window {pad_window} {errors[pad_window]:.3g}, "
        f"short last window {errors[-1]:.3g}, max {max(errors):.3g}"
    )
    assert max(errors) <= TOL, errors
    wrong = unscaled_error(runs, "ga2", pad_window)
    print(f"[ga2] pad window without the loader's scale: rel L2 {wrong:.3g}")
    assert wrong > WRONG


def unscaled_error(runs: dict[str, Any], name: str, w: int) -> float:
    """The wrong variant: each rank's plain per-token mean, averaged by DDP, at window
    `w`, against the reference."""
    per_rank = case(runs, name)
    rows0, rows1 = (r["epochs"][0] for r in per_rank)
    steps = windows_of(rows0)[w]
    ref = Reference(reference_model(name, per_rank[0]["params"][w]), ChatSFT(**CASES[name]["data"]))
    unscaled = torch.zeros_like(per_rank[0]["grads"][w])
    for t in steps:
        for rows in (rows0, rows1):
            if rows[t]["ids"]:
                g, n = ref.summed(rows[t]["ids"])
                if n:
                    unscaled += g / n / WORLD
    return rel_l2(unscaled, ref.mean(window_ids(per_rank, steps)))


def test_lora_windows_match_single_process(runs: dict[str, Any]) -> None:
    """PEFT LoRA, G=2, uneven shards: the gradient is on the adapter weights only and
    every window's is the per-token mean's; without the loader's scale it is not."""
    per_rank = case(runs, "ga2_lora")
    model = reference_model("ga2_lora", per_rank[0]["params"][0])
    adapter = torch.cat(
        [torch.full((p.numel(),), "lora_" in n) for n, p in model.named_parameters()]
    )
    for grad in per_rank[0]["grads"]:
        assert (grad[~adapter] == 0).all() and (grad[adapter] != 0).any()
    errors = _errors(runs, "ga2_lora")
    wrong = max(unscaled_error(runs, "ga2_lora", w) for w in range(len(errors)))
    print(
        f"[ga2_lora] max rel L2 over {len(errors)} windows {max(errors):.3g}; unscaled {wrong:.3g}"
    )
    assert max(errors) <= TOL < WRONG < wrong


def test_plain_accelerate_accumulation_over_the_odb_loader_raises(runs: dict[str, Any]) -> None:
    """The wrong variant (Accelerate's own accumulation over the ODB loader) is an error
    naming the fix."""
    for r in runs["train"]:
        base = r["baseline"]
        assert base["same_object"], "accelerator.prepare wrapped the ODB loader"
        assert "prepare_odb_loader" in base["raised"], base
        assert "gradient_accumulation_steps=1" in base["raised"], base


def test_accelerate_accumulate_with_longer_windows_raises(runs: dict[str, Any]) -> None:
    for r in runs["train"]:
        msg = r["misuse"]
        assert msg.startswith("step 0:"), msg  # raised when the next batch is asked for
        assert "train.accumulate(model)" in msg


def test_bad_input_is_named(runs: dict[str, Any]) -> None:
    for r in runs["train"]:
        bad = r["bad_input"]
        assert "needs an ODBDataLoader" in bad["plain"] and "DataLoaderShard" in bad["plain"]
        assert "gradient_accumulation_steps=1" in bad["accum"]
        assert "grad_accum_steps=4" in bad["accum"]
        # once per process: said at the first prepare, not at the second
        assert bad["split"].count("split_batches=True") == 1, bad["split"]
        assert "ignored" in bad["split"]


def test_save_state_mid_epoch_then_load_state_resumes_exactly_once(runs: dict[str, Any]) -> None:
    first = case(runs, "resume")
    resumed = [r["resume_load"] for r in runs["resumed"]]
    saved_at = first[0]["saved_at"]
    assert saved_at is not None and saved_at == first[1]["saved_at"]
    total = len(first[0]["epochs"][0])
    assert 0 < saved_at < total - 1, "the checkpoint should be mid-epoch"
    before = window_ids(first, list(range(saved_at + 1)))
    after_rows = [r["epochs"][0] for r in resumed]
    assert [row["step"] for row in after_rows[0]] == list(range(saved_at + 1, total))
    after = [i for rows in after_rows for row in rows for i in row["ids"]]
    assert sorted(before + after) == list(range(CASES["resume"]["data"]["n"]))
    for r in range(WORLD):  # batch for batch as the uninterrupted run (deterministic=True)
        assert [row["ids"] for row in after_rows[r]] == [
            row["ids"] for row in first[r]["epochs"][0][saved_at + 1 :]
        ]
    err = rel_l2(resumed[0]["final_params"], first[0]["final_params"])
    print(f"[resume] saved after step {saved_at} of {total}; final params rel L2 {err:.3g}")
    assert err <= 1e-12


def test_len_is_the_loaders_step_estimate(runs: dict[str, Any]) -> None:
    for name in ("ga1", "ga2"):
        for r in case(runs, name):
            before, after = r["len"]
            realised = [len(rows) for rows in r["epochs"]]
            assert isinstance(before, int) and before > 0, name
            assert r["epoch_steps"] == dict(enumerate(realised)), name
            print(f"[{name}] len before epoch 0 {before}, after {after}; realised {realised}")


def test_version_outside_the_range_warns_once() -> None:
    from odb_core.integrations import accelerate as adapter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert adapter.check_accelerate_version("1.16.0")
        assert not adapter.check_accelerate_version("0.9.1")
        assert not adapter.check_accelerate_version("0.9.1")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "odb-core[accelerate]" in messages[0], messages


def test_plain_dataloader_is_rejected_before_anything_runs() -> None:
    from torch.utils.data import DataLoader

    from odb_core.integrations.accelerate import prepare_odb_loader

    with pytest.raises(ConfigError, match="needs an ODBDataLoader"):
        prepare_odb_loader(None, DataLoader(list(range(4)), batch_size=2))  # type: ignore[arg-type]


def test_import_odb_core_does_not_import_accelerate() -> None:
    import subprocess
    import sys

    code = "import sys, odb_core, odb_core.integrations; assert 'accelerate' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=HANG_GUARD_S)


def test_accelerate_example_runs_under_torchrun(tmp_path: Path) -> None:
    """`torchrun --nproc_per_node 2 examples/accelerate_sft.py`, small, with a save."""
    import re
    import sys

    example = Path(__file__).resolve().parents[1] / "examples" / "accelerate_sft.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(example),
        *("--samples", "96", "--epochs", "2", "--token-budget", "1024"),
        *("--ckpt", str(tmp_path / "ckpt"), "--save-at-update", "2"),
    ]
    proc = run_script(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = (
        r"epoch (\d): (\d+) aligned steps, (\d+) optimizer updates, (\d+) samples .*loss ([\d.]+)"
    )
    epochs = [tuple(float(x) for x in m) for m in re.findall(line, proc.stdout)]
    assert [(e[0], e[3]) for e in epochs] == [(0, 96), (1, 96)], proc.stdout
    for _, steps, updates, _, _ in epochs:
        assert updates == -(-steps // 2), proc.stdout  # windows of 2 steps, the last short
    assert epochs[1][4] < epochs[0][4], proc.stdout
    assert "saved" in proc.stdout and (tmp_path / "ckpt" / "custom_checkpoint_0.pkl").exists()
    assert "done on 2 ranks" in proc.stdout
