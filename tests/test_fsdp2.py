"""FSDP2 (`torch.distributed.fsdp.fully_shard`) with uneven data, on real processes.

Two gloo ranks on CPU shard a tiny random-init `LlamaForCausalLM` (float64) with
`fully_shard` (each decoder layer, then the root). The data is skewed and
unshuffled (`ChatSFT(skew=True)`): rank 0 holds about three times rank 1's
tokens, so rank 1 runs out first and the loader gives it pad steps (scale 0),
whose forward and backward still run so FSDP's all-gathers and reduce-scatters
line up. Windows of two steps (`grad_accum_steps=2`):
`set_requires_gradient_sync(False)` on a window's first step, True on its last.

Before each optimizer step every rank records the full gradient (`full_tensor()`
of each sharded grad) and the full parameters it was computed at; the test
process loads those parameters into one model and computes the single-process
per-token mean over the window's samples. They agree within 1e-6 relative L2 on
every window: the first, the windows where rank 1 pads, and the short last one.

Both ranks must finish within a deadline (no hang). The wrong variants: a rank
that skips its pad steps leaves its peer waiting in FSDP's all-gather (it fails
when that rank leaves, or at the process-group timeout while it stays), and the
plain per-rank mean misses the reference.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
from guards import run_script

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip(
        "torch.distributed.fsdp.fully_shard (FSDP2) is not available", allow_module_level=True
    )

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from sft_support import COLLATES, ChatSFT, Reference, rel_l2, tiny_llama  # noqa: E402

from odb_core.bench.launch import free_port, release_child_resources  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORLD = 2
TOL = 1e-6
WRONG = 1e-4
LR = 0.5
DEADLINE = 120.0  # seconds for the correct run; it takes a few
DATA = {"n": 36, "seed": 2, "skew": True}
LOADER = {
    "cost_model": "packed",
    "token_budget": 320,
    "shuffle": False,
    "grad_accum_steps": 2,
    "deterministic": True,
    "buffer_size": 16,
    "max_steps_per_round": 4,
    "num_workers": 0,
}


# ---- what runs inside a rank ----------------------------------------------------------


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().reshape(-1)


def full_flat(module: torch.nn.Module, grads: bool) -> torch.Tensor:
    """Every parameter (or gradient), unsharded and flattened, in parameter order."""
    out = []
    for p in module.parameters():
        t = p.grad if grads else p
        out.append(torch.zeros(p.numel(), dtype=p.dtype) if t is None else _full(t))
    return torch.cat(out).clone()


def shard(model: Any) -> Any:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def train(rank: int, skip_pads: bool, peer_timeout: float) -> dict[str, Any]:
    from odb_core import ODBDataLoader
    from odb_core.torch import causal_lm_loss, pop_step_meta

    model = shard(tiny_llama(seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = ODBDataLoader(
        ChatSFT(**DATA), collate_fn=COLLATES["packed"], peer_timeout=peer_timeout, **LOADER
    )
    rows: list[dict[str, Any]] = []
    grads, params = [], []
    for batch in loader:
        meta = pop_step_meta(batch)
        rows.append(
            {
                "step": meta.step,
                "sync": meta.sync_gradients,
                "is_pad": meta.is_pad,
                "ids": [int(i) for i in loader.step_info.sample_ids],
            }
        )
        if skip_pads and meta.is_pad:
            continue  # the wrong variant: FSDP's collectives no longer line up
        model.set_requires_gradient_sync(meta.sync_gradients)
        labels = batch.pop("labels")
        causal_lm_loss(meta, model(**batch).logits, labels).backward()
        if meta.sync_gradients:
            grads.append(full_flat(model, grads=True))
            params.append(full_flat(model, grads=False))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    left = any(p.grad is not None for p in model.parameters())
    return {"rows": rows, "grads": grads, "params": params, "leftover_grads": left}


def _rank_entry(rank: int, port: int, out: str, skip_pads: bool, timeout_s: float) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        t0 = time.perf_counter()
        result = train(rank, skip_pads, peer_timeout=timeout_s)
        result["time"] = time.perf_counter() - t0
        torch.save(result, Path(out, f"rank{rank}.pt"))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
    release_child_resources()
    os._exit(0)  # a peer may be stuck: skip destroy_process_group's handshake


def launch(
    out: Path, *, skip_pads: bool = False, timeout_s: float = 60, deadline: float = DEADLINE
) -> dict[str, Any]:
    """Both ranks; returns what each wrote (result or error) and which were still
    running at the deadline (then killed)."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(r, port, str(out), skip_pads, timeout_s))
        for r in range(WORLD)
    ]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.1, t0 + deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results: list[Any] = []
    errors: list[str | None] = []
    for r in range(WORLD):
        err, res = out / f"rank{r}.err", out / f"rank{r}.pt"
        errors.append(err.read_text() if err.exists() else None)
        results.append(torch.load(res, weights_only=False) if res.exists() else None)
    return {
        "results": results,
        "errors": errors,
        "hung": hung,
        "wall": time.monotonic() - t0,
    }


def windows_of(rows: list[dict[str, Any]]) -> list[list[int]]:
    out: list[list[int]] = []
    for t in range(len(rows)):
        if not out or rows[t - 1]["sync"]:
            out.append([])
        out[-1].append(t)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    got = launch(tmp_path_factory.mktemp("fsdp2"))
    assert not got["hung"], f"ranks {got['hung']} still running after {DEADLINE}s"
    for r, err in enumerate(got["errors"]):
        assert err is None, f"rank {r} failed:\n{err}"
    print(f"\nfsdp2 launch {got['wall']:.1f}s (training {got['results'][0]['time']:.1f}s)")
    return got


def test_uneven_ranks_finish_aligned_every_sample_once(run: dict[str, Any]) -> None:
    r0, r1 = run["results"]
    assert len(r0["rows"]) == len(r1["rows"]), "step counts differ"
    for a, b in zip(r0["rows"], r1["rows"], strict=True):
        assert (a["step"], a["sync"]) == (b["step"], b["sync"])
    pads = [row["step"] for row in r1["rows"] if row["is_pad"]]
    assert pads, "rank 1 never padded: the data is not uneven enough"
    assert not any(row["is_pad"] for row in r0["rows"])
    ids = [i for r in (r0, r1) for row in r["rows"] for i in row["ids"]]
    assert sorted(ids) == list(range(DATA["n"]))
    windows = windows_of(r0["rows"])
    assert len(r0["grads"]) == len(r1["grads"]) == len(windows)  # every window stepped
    assert len(windows[-1]) == 1, "the epoch should end in a short window"
    assert not r0["leftover_grads"] and not r1["leftover_grads"]


def test_fsdp2_gradient_matches_single_process_per_token_mean(run: dict[str, Any]) -> None:
    r0, r1 = run["results"]
    dataset = ChatSFT(**DATA)
    init = tiny_llama(seed=0)
    start = torch.cat([p.detach().reshape(-1) for p in init.parameters()])
    assert rel_l2(r0["params"][0], start) == 0.0, "parameter order differs from the model's"
    windows = windows_of(r0["rows"])
    pad_windows = [
        w for w, steps in enumerate(windows) if any(r1["rows"][t]["is_pad"] for t in steps)
    ]
    errors, wrong = [], {}
    for w, steps in enumerate(windows):
        assert rel_l2(r1["grads"][w], r0["grads"][w]) <= 1e-12
        model = tiny_llama(seed=0)
        torch.nn.utils.vector_to_parameters(r0["params"][w], model.parameters())
        ref = Reference(model, dataset)
        ids = [i for t in steps for r in (r0, r1) for i in r["rows"][t]["ids"]]
        want = ref.mean(ids)
        errors.append(rel_l2(r0["grads"][w], want))
        if w in pad_windows:  # the plain per-rank mean, averaged over the ranks
            plain = torch.zeros_like(want)
            for t in steps:
                for r in (r0, r1):
                    if r["rows"][t]["ids"]:
                        g, n = ref.summed(r["rows"][t]["ids"])
                        plain += g / n / WORLD if n else 0 * g
            wrong[w] = rel_l2(plain, want)
    print(
        f"[fsdp2] first window {errors[0]:.3g}; pad windows "
        f"{ {w: f'{errors[w]:.3g}' for w in pad_windows} }; last {errors[-1]:.3g}; "
        f"max over {len(errors)} {max(errors):.3g}; plain mean at pad windows "
        f"{ {w: f'{v:.3g}' for w, v in wrong.items()} }"
    )
    assert pad_windows
    assert max(errors) <= TOL, errors
    assert min(wrong.values()) > WRONG


def test_skipping_pad_steps_stalls_fsdp(tmp_path: Path) -> None:
    """The wrong variant: rank 1 skips its pad steps' forward and backward. Rank 0
    then waits in FSDP's all-gather for a peer that never comes: it fails when
    rank 1 leaves (or, were rank 1 to stay, at the 8 s process-group timeout;
    without one, forever). With the pad steps run, the same data finishes."""
    got = launch(tmp_path / "skip", skip_pads=True, timeout_s=8, deadline=60)
    finished = [r for r in range(WORLD) if got["results"][r] is not None]
    print(
        f"\n[fsdp2 skip pads] wall {got['wall']:.1f}s, errors: "
        f"{[e.strip().splitlines()[-1] if e else None for e in got['errors']]}"
    )
    assert got["errors"][0] is not None or got["hung"], "skipping pad steps did not stall rank 0"
    assert finished != [0, 1]


def test_fsdp2_example_runs_under_torchrun(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_sft.py"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(example),
        *("--samples", "96", "--epochs", "2", "--token-budget", "768"),
    ]
    proc = run_script(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = (
        r"epoch (\d): (\d+) aligned steps, (\d+) optimizer updates, (\d+) samples "
        r".*pad steps \[(\d+), (\d+)\].*loss ([\d.]+)"
    )
    epochs = re.findall(line, proc.stdout)
    assert [(int(e[0]), int(e[3])) for e in epochs] == [(0, 96), (1, 96)], proc.stdout
    assert any(int(e[5]) > 0 for e in epochs), "rank 1 should pad on the uneven data"
    assert float(epochs[1][6]) < float(epochs[0][6]), proc.stdout
    assert "done on 2 ranks" in proc.stdout
