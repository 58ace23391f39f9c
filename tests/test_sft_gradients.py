"""Exact loss scaling on real processes: DDP gradients equal a single process's.

Two gloo ranks on CPU train a tiny random-init `LlamaForCausalLM` (float64) with
DDP on a chat SFT dataset whose prompt labels are masked (`sft_support.py`).
For every optimizer window of every case, each rank records the gradient DDP
left after the window's closing backward (all-reduced: the same on both
ranks), and the sample ids it trained on. The test process then computes, on
one process and with no padding or packing, the per-token mean over exactly
those global samples: Σ over the samples of the token cross-entropy over their
unmasked shifted labels, divided by their total unmasked tokens. The two must
agree within 1e-6 relative L2 over all parameters.

The parameters stay at their seeded init (no optimizer step), so every window
is compared against the same model. One launch runs every case:

- `padded`: right-padded batches, `cost_model="padded"`, every step its own
  window, `scaled_loss(meta, model(**batch).loss)` (transformers' own loss);
- `packed`: one packed row per batch (position ids restart per sample), shards
  uneven on purpose (rank 1 runs dry and pads), `causal_lm_loss`;
- `accum4`: `grad_accum_steps=4`, DDP `no_sync` on the non-closing micro-steps,
  some samples fully masked, the epoch's last window short;
- `tokens`: `tokens_per_update=T` over packed, uneven shards;
- `lora`: the model under PEFT LoRA (`sft_support.lora_llama`), padded, G=2: only
  the adapter weights get a gradient, and it is the per-token mean's.

The errors are about 5e-8, not 1e-16: even in float64, transformers' Llama
computes its RMSNorm and rotary embeddings in float32 (and both losses their
token cross-entropy), so a padded or packed batch and a lone sample round
differently. A wrong normalisation is off by 1e-2 or more.

Each regression test also computes the gradient a wrong normalisation gives on
the same samples and shows it misses the reference by more than 1e-4, so the
comparison can fail. The last test runs `examples/train_sft.py` under torchrun.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from guards import HANG_GUARD_S, run_script

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gloo_ranks import launch_entry  # noqa: E402
from sft_support import (  # noqa: E402
    COLLATES,
    MODELS,
    ChatSFT,
    Reference,
    flat_grad,
    loss_tokens,
    rel_l2,
)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from odb_core import ODBDataLoader  # noqa: E402
from odb_core.bench.launch import init_local_gloo, release_child_resources  # noqa: E402
from odb_core.torch import causal_lm_loss, pop_step_meta, scaled_loss  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 2
TOL = 1e-6  # relative L2 of the DDP gradient against the single-process reference
WRONG = 1e-4  # a wrong normalisation misses the reference by more than this
TOKENS_PER_UPDATE = 160

COMMON = {
    "deterministic": True,
    "buffer_size": 16,
    "max_steps_per_round": 4,
    "num_workers": 0,
}

CASES: dict[str, dict[str, Any]] = {
    "padded": {
        "data": {"n": 56, "seed": 1},
        "collate": "padded",
        "loss": "hf",
        "loader": {"cost_model": "padded", "token_budget": 256, "shuffle": True, "seed": 5},
    },
    "packed": {
        # Unshuffled: rank 0 gets the even (3x longer) samples, rank 1 runs dry first.
        "data": {"n": 40, "seed": 2, "skew": True},
        "collate": "packed",
        "loss": "causal_lm",
        "loader": {"cost_model": "packed", "token_budget": 320, "shuffle": False},
    },
    "accum4": {
        "data": {"n": 72, "seed": 3, "masked_every": 7},
        "collate": "padded",
        "loss": "causal_lm",
        "loader": {
            "cost_model": "padded",
            "token_budget": 192,
            "shuffle": True,
            "seed": 7,
            "grad_accum_steps": 4,
        },
    },
    "tokens": {
        "data": {"n": 48, "seed": 4, "skew": True, "masked_every": 9},
        "collate": "packed",
        "loss": "causal_lm",
        "loader": {
            "cost_model": "packed",
            "token_budget": 256,
            "shuffle": False,
            "tokens_per_update": TOKENS_PER_UPDATE,
        },
    },
    "lora": {
        "data": {"n": 40, "seed": 6},
        "collate": "padded",
        "loss": "hf",
        "model": "lora",
        "loader": {
            "cost_model": "padded",
            "token_budget": 256,
            "shuffle": True,
            "seed": 9,
            "grad_accum_steps": 2,
        },
    },
}


# ---- what runs inside a rank ----------------------------------------------------------


def train_case(model: DistributedDataParallel, rank: int, case: dict[str, Any]) -> dict[str, Any]:
    """One epoch; returns every step's metadata and the gradient after each window."""
    loader = ODBDataLoader(
        ChatSFT(**case["data"]),
        collate_fn=COLLATES[case["collate"]],
        **{**COMMON, **case["loader"]},
    )
    loader.set_epoch(0)
    steps: list[dict[str, Any]] = []
    grads: list[torch.Tensor] = []
    model.zero_grad(set_to_none=True)
    for batch in loader:
        assert "odb_step" in batch
        meta = pop_step_meta(batch)
        assert "odb_step" not in batch
        info = loader.step_info
        assert info is not None
        sync = meta.sync_gradients
        # DDP all-reduces only on the window's closing backward.
        with contextlib.nullcontext() if sync else model.no_sync():
            if case["loss"] == "hf":
                loss = scaled_loss(meta, model(**batch).loss)
            else:
                labels = batch.pop("labels")
                loss = causal_lm_loss(meta, model(**batch).logits, labels)
            loss.backward()
        steps.append(
            {
                "step": meta.step,
                "window": meta.window,
                "is_pad": meta.is_pad,
                "sync": sync,
                "world_size": meta.world_size,
                "ids": [int(i) for i in info.sample_ids],
                "info_step": info.step,
                "info_is_pad": info.is_pad,
                "local_samples": meta.local_samples,
                "global_samples": meta.global_samples,
                "local_loss_tokens": meta.local_loss_tokens,
                "global_loss_tokens": meta.global_loss_tokens,
                "window_samples": meta.window_samples,
                "window_loss_tokens": meta.window_loss_tokens,
                "loss_scale": float(meta.loss_scale),
                "info_loss_scale": float(info.loss_scale),
                "local_tokens": info.local_tokens,
                "global_tokens": info.global_tokens,
                "loss": float(loss.detach()),
            }
        )
        if sync:
            grads.append(flat_grad(model.module))
            model.zero_grad(set_to_none=True)
    return {"steps": steps, "grads": torch.stack(grads) if grads else torch.zeros(0)}


def _rank_entry(rank: int, world: int, port: int, out: str) -> None:
    init_local_gloo(rank, world, port, timeout_s=HANG_GUARD_S)
    try:
        models = {kind: DistributedDataParallel(build(seed=0)) for kind, build in MODELS.items()}
        result: dict[str, Any] = {"times": {}}
        for name, case in CASES.items():
            t0 = time.perf_counter()
            result[name] = train_case(models[case.get("model", "full")], rank, case)
            result["times"][name] = time.perf_counter() - t0
        torch.save(result, Path(out, f"rank{rank}.pt"))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
    release_child_resources()
    os._exit(0)  # a peer may be dead: skip destroy_process_group's handshake


# ---- the launch and the reference -------------------------------------------------------


def launch(out: Path, timeout: float = HANG_GUARD_S) -> list[dict[str, Any]]:
    return launch_entry(_rank_entry, WORLD, out, timeout=timeout)


class Run:
    """Both ranks' records of one case, and its single-process reference."""

    def __init__(self, name: str, per_rank: list[dict[str, Any]], model: Any) -> None:
        self.name = name
        self.case = CASES[name]
        self.steps = [r["steps"] for r in per_rank]  # [rank][t]
        self.grads = [r["grads"] for r in per_rank]  # [rank][window]
        self.dataset = ChatSFT(**self.case["data"])
        self.ref = Reference(model, self.dataset)
        counts = {len(s) for s in self.steps}
        assert len(counts) == 1, f"{name}: step counts differ across ranks: {counts}"
        windows: list[list[int]] = []
        for t in range(len(self.steps[0])):
            if not windows or self.steps[0][t - 1]["sync"]:
                windows.append([])
            windows[-1].append(t)
        self.windows = windows  # step indices of each optimizer window, in order

    def ids(self, steps: list[int], rank: int | None = None) -> list[int]:
        ranks = range(WORLD) if rank is None else [rank]
        return [i for t in steps for r in ranks for i in self.steps[r][t]["ids"]]

    def reference(self, w: int) -> torch.Tensor:
        return self.ref.mean(self.ids(self.windows[w]))

    def error(self, w: int) -> float:
        return rel_l2(self.grads[0][w], self.reference(w))

    def max_error(self) -> float:
        return max(self.error(w) for w in range(len(self.windows)))

    # Wrong normalisations, from the same per-sample gradients.

    def _local(self, t: int, r: int) -> tuple[torch.Tensor, int, int] | None:
        ids = self.steps[r][t]["ids"]
        if not ids:
            return None
        g, n = self.ref.summed(ids)
        return g, n, sum(self.ref.cost(i) for i in ids)

    def cost_token_scaled(self, w: int) -> torch.Tensor:
        """The old scale: each rank's per-loss-token mean times W * its cost tokens
        / the window's cost tokens, averaged over the ranks by DDP."""
        steps = self.windows[w]
        cost = sum(self.ref.cost(i) for i in self.ids(steps))
        total = torch.zeros_like(self.grads[0][w])
        for t in steps:
            for r in range(WORLD):
                local = self._local(t, r)
                if local is not None and local[1] > 0:
                    g, n, c = local
                    total += (WORLD * c / cost) * (g / n) / WORLD
        return total

    def unscaled_local_mean(self, w: int) -> torch.Tensor:
        """No loader scale: DDP's average of each rank's per-token mean (a pad
        step contributing nothing), summed over the window's steps."""
        total = torch.zeros_like(self.grads[0][w])
        for t in self.windows[w]:
            for r in range(WORLD):
                local = self._local(t, r)
                if local is not None and local[1] > 0:
                    total += (local[0] / local[1]) / WORLD
        return total

    def per_step_mean(self, w: int) -> torch.Tensor:
        """Each micro-step normalised by its own step's global loss tokens, the
        window's steps averaged (`loss / grad_accum_steps`)."""
        steps = self.windows[w]
        total = torch.zeros_like(self.grads[0][w])
        for t in steps:
            g, n = self.ref.summed(self.ids([t]))
            if n:
                total += (g / n) / len(steps)
        return total


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    t0 = time.perf_counter()
    per_rank = launch(tmp_path_factory.mktemp("sft"))
    models = {kind: build(seed=0) for kind, build in MODELS.items()}  # DDP's seeded inits
    out = {
        name: Run(name, [r[name] for r in per_rank], models[CASES[name].get("model", "full")])
        for name in CASES
    }
    print(f"\nsft launch {time.perf_counter() - t0:.1f}s; per case {per_rank[0]['times']}")
    return out


def report(run: Run, label: str, value: float) -> None:
    print(f"[{run.name}] {label}: {value:.3g}")


# ---- the protocol's view is consistent across ranks -------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_step_meta_aligned_and_every_sample_once(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    for t in range(len(run.steps[0])):
        rows = [run.steps[r][t] for r in range(WORLD)]
        shared = {
            k: {row[k] for row in rows}
            for k in (
                "step",
                "window",
                "sync",
                "world_size",
                "global_samples",
                "global_loss_tokens",
                "window_samples",
                "window_loss_tokens",
            )
        }
        assert all(len(v) == 1 for v in shared.values()), f"step {t}: ranks disagree: {shared}"
        for row in rows:
            assert row["step"] == row["info_step"] == t
            assert row["is_pad"] == row["info_is_pad"] == (row["ids"] == [])
            assert row["world_size"] == WORLD
            assert row["loss_scale"] == row["info_loss_scale"]
            assert row["local_samples"] == len(row["ids"])
            assert row["local_loss_tokens"] == sum(loss_tokens(run.dataset[i]) for i in row["ids"])
        assert sum(row["local_samples"] for row in rows) == rows[0]["global_samples"]
        assert sum(row["local_loss_tokens"] for row in rows) == rows[0]["global_loss_tokens"]
    for w, steps in enumerate(run.windows):
        assert [run.steps[0][t]["sync"] for t in steps] == [False] * (len(steps) - 1) + [True]
        assert {run.steps[0][t]["window"] for t in steps} == {w}
        window_tokens = sum(loss_tokens(run.dataset[i]) for i in run.ids(steps))
        assert run.steps[0][steps[0]]["window_loss_tokens"] == window_tokens
        scales = sum(run.steps[r][t]["loss_scale"] for t in steps for r in range(WORLD))
        assert scales == pytest.approx(WORLD if window_tokens else 0.0, rel=1e-12)
    ids = run.ids(list(range(len(run.steps[0]))))
    assert sorted(ids) == list(range(len(run.dataset))), "not every sample exactly once"
    assert len(run.grads[0]) == len(run.grads[1]) == len(run.windows)


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_hold_the_same_gradient_after_each_window(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    worst = max(rel_l2(run.grads[1][w], run.grads[0][w]) for w in range(len(run.windows)))
    report(run, "max rel L2 rank 1 vs rank 0", worst)
    # Two ranks: every all-reduced element is a + b (commutative in IEEE) halved.
    assert all(torch.equal(run.grads[0][w], run.grads[1][w]) for w in range(len(run.windows)))


# ---- gradient equality with one process -----------------------------------------------


def test_step0_window_of_one_step_matches_single_process(runs: dict[str, Run]) -> None:
    run = runs["padded"]
    assert run.windows[0] == [0]
    assert all(len(s) == 1 for s in run.windows), "padded case: every step is its own window"
    err = run.error(0)
    report(run, "step 0 rel L2", err)
    assert err <= TOL


@pytest.mark.parametrize("name", list(CASES))
def test_every_window_matches_single_process(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    errors = [run.error(w) for w in range(len(run.windows))]
    report(run, f"max rel L2 over {len(errors)} windows", max(errors))
    assert max(errors) <= TOL, errors


def test_packed_step_where_one_rank_pads_matches_single_process(runs: dict[str, Run]) -> None:
    run = runs["packed"]
    padded = [
        t
        for t in range(len(run.steps[0]))
        if run.steps[1][t]["is_pad"] and not run.steps[0][t]["is_pad"]
    ]
    assert padded, "rank 1 never padded: the shards are not uneven enough"
    assert not any(run.steps[0][t]["is_pad"] for t in range(len(run.steps[0])))
    t = padded[0]
    (w,) = [w for w, steps in enumerate(run.windows) if t in steps]
    assert run.steps[1][t]["loss_scale"] == 0.0
    assert run.steps[0][t]["loss_scale"] == pytest.approx(WORLD)
    err = run.error(w)
    report(run, f"pad step {t} rel L2", err)
    assert err <= TOL


def test_grad_accum_first_full_and_last_short_window(runs: dict[str, Run]) -> None:
    run = runs["accum4"]
    assert len(run.windows) >= 3
    assert all(len(s) == 4 for s in run.windows[:-1])
    assert 1 <= len(run.windows[-1]) < 4, "the epoch should end in a short window"
    first, last = run.error(0), run.error(len(run.windows) - 1)
    report(run, "first full window rel L2", first)
    report(run, f"last window ({len(run.windows[-1])} steps) rel L2", last)
    assert first <= TOL and last <= TOL
    masked = [i for i in run.ids(run.windows[0]) if loss_tokens(run.dataset[i]) == 0]
    assert len(run.ids(run.windows[0])) > len(masked)
    assert any(loss_tokens(run.dataset[i]) == 0 for i in range(len(run.dataset)))


def test_tokens_per_update_windows_match_single_process(runs: dict[str, Run]) -> None:
    run = runs["tokens"]
    assert len(run.windows) >= 3
    for w, steps in enumerate(run.windows):
        seen = [run.steps[0][t]["global_loss_tokens"] for t in steps]
        if w < len(run.windows) - 1:  # closed at the first step reaching T
            assert sum(seen) >= TOKENS_PER_UPDATE > sum(seen[:-1])
        else:
            assert sum(seen[:-1]) < TOKENS_PER_UPDATE
    errors = [run.error(w) for w in range(len(run.windows))]
    report(run, f"max rel L2 over {len(errors)} token windows", max(errors))
    assert max(errors) <= TOL


# ---- regressions: what a loader-side normalisation got wrong ------------------------------


def test_masked_prompt_labels_cost_token_scale_is_off(runs: dict[str, Run]) -> None:
    """Prompt labels are masked, so a scale by cost tokens (input length) weights
    each rank's mean by the wrong share; the loss-token scale is exact."""
    run = runs["padded"]
    worst_new = worst_old = 0.0
    best_old = float("inf")
    for w in range(len(run.windows)):
        ref = run.reference(w)
        worst_new = max(worst_new, rel_l2(run.grads[0][w], ref))
        old = rel_l2(run.cost_token_scaled(w), ref)
        worst_old, best_old = max(worst_old, old), min(best_old, old)
    report(run, "new scale max rel L2", worst_new)
    report(run, "cost-token scale min rel L2", best_old)
    report(run, "cost-token scale max rel L2", worst_old)
    assert worst_new <= TOL
    assert worst_old > WRONG
    assert run.error(0) <= TOL < WRONG < rel_l2(run.cost_token_scaled(0), run.reference(0))


def test_uneven_ranks_unscaled_local_mean_is_off(runs: dict[str, Run]) -> None:
    """A rank's plain mean, averaged by DDP, weights a short rank's tokens as much
    as a long rank's, and a pad step halves the update; the loader's scale is exact."""
    run = runs["packed"]
    for t in (0, next(t for t in range(len(run.steps[0])) if run.steps[1][t]["is_pad"])):
        (w,) = [w for w, steps in enumerate(run.windows) if t in steps]
        ref = run.reference(w)
        wrong = rel_l2(run.unscaled_local_mean(w), ref)
        report(run, f"step {t}: unscaled local mean rel L2", wrong)
        assert run.error(w) <= TOL < WRONG < wrong


def test_lora_gradient_is_on_the_adapter_weights_only(runs: dict[str, Run]) -> None:
    """Under LoRA the frozen base weights get no gradient and every adapter matrix
    (A and B) a nonzero one: the windows' exactness is the adapter's."""
    run = runs["lora"]
    trained = [p.requires_grad and "lora_" in n for n, p in run.ref.model.named_parameters()]
    assert any(trained) and sum(trained) < len(trained)
    sizes = [p.numel() for p in run.ref.model.parameters()]
    for grad in run.grads[0]:
        parts = torch.split(grad, sizes)
        assert all((part.abs().sum() > 0) == t for part, t in zip(parts, trained, strict=True))
    errors = [run.error(w) for w in range(len(run.windows))]
    report(run, f"LoRA: max rel L2 over {len(errors)} windows", max(errors))
    assert max(errors) <= TOL


@pytest.mark.parametrize("name", ["accum4", "tokens", "lora"])
def test_accumulation_normalised_per_micro_step_is_off(runs: dict[str, Run], name: str) -> None:
    """Each micro-step normalised by its own tokens (then `/ steps`) weights a
    short step's tokens more; the window-wide scale is exact."""
    run = runs[name]
    w = next(w for w, steps in enumerate(run.windows) if len(steps) > 1)
    ref = run.reference(w)
    wrong = rel_l2(run.per_step_mean(w), ref)
    report(run, f"window {w}: per-micro-step normalisation rel L2", wrong)
    assert run.error(w) <= TOL < WRONG < wrong


def test_tokens_per_update_windows_close_on_global_tokens(runs: dict[str, Run]) -> None:
    """Windows by each rank's own loss tokens would close at different steps on the
    two ranks (DDP would hang or mix windows); the loader closes them on the
    global count, at the same step everywhere."""
    run = runs["tokens"]
    syncs = [[row["sync"] for row in run.steps[r]] for r in range(WORLD)]
    assert syncs[0] == syncs[1]

    def local_rule(r: int) -> list[bool]:
        out, acc = [], 0
        for row in run.steps[r]:
            acc += row["local_loss_tokens"]
            out.append(acc >= TOKENS_PER_UPDATE)
            acc = 0 if out[-1] else acc
        return out

    assert local_rule(0) != local_rule(1), "uneven shards should make local windows differ"


# ---- the runnable example ------------------------------------------------------------------


def test_train_sft_example_runs_under_torchrun(tmp_path: Path) -> None:
    """`torchrun --nproc_per_node 2 examples/train_sft.py`, small: every sample
    once per epoch, windows of 4 steps, the loss falls."""
    example = Path(__file__).resolve().parents[1] / "examples" / "train_sft.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(example),
        *("--samples", "120", "--epochs", "2", "--workers", "0", "--token-budget", "1024"),
    ]
    proc = run_script(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = (
        r"epoch (\d): (\d+) aligned steps, (\d+) optimizer updates, (\d+) samples .*loss ([\d.]+)"
    )
    epochs = [tuple(float(x) for x in m) for m in re.findall(line, proc.stdout)]
    assert [(e[0], e[3]) for e in epochs] == [(0, 120), (1, 120)], proc.stdout
    for _, steps, updates, _, _ in epochs:
        assert updates == -(-steps // 4), proc.stdout  # windows of 4 steps, the last short
    assert epochs[1][4] < epochs[0][4], proc.stdout
    assert "done on 2 ranks" in proc.stdout
