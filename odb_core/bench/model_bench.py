"""`odb bench --model SIZE`: train a real LlamaForCausalLM on W gloo ranks with DDP,
one epoch per run (`--quality`: several), every strategy on the same data and init,
interleaved (A, B, C, A, B, C, ...), medians over the repeats.

Strategies (all under the same peak-token budget per step and rank):
- `standard`: DataLoader(batch_size=B) + DistributedSampler, padded; B is the
  largest fixed batch whose worst case (B x the longest possible sample) fits;
- `grouped`: HF Trainer's `group_by_length=True` at the same B, with HF's own
  `LengthGroupedSampler` sharded by Accelerate's `BatchSamplerShard`
  (`odb_core.bench.grouped`); its timed length pass is reported apart;
- `gmt`: an offline oracle: a timed length-cache pass over the dataset (reported
  apart), sort longest first, cut at the budget, deal the batches round-robin;
- `trl-packed`: TRL's `packing=True` (best-fit decreasing, `trl.data_utils.
  pack_dataset`) over the same pass's lengths into rows of the budget, one row
  per rank and step, packed like `odb-packed` (`odb_core.bench.trl_packing`); the
  pass and the packing are its precompute; text models only (TRL refuses
  packing for vision datasets);
- `odb-padded`, `odb-packed`: ODBDataLoader with the padded / packed cost model
  (`pad_collate` / `pack_collate`, varlen attention);
- `odb-ref`: the PyPI package `online-dynamic-batching` (import `odb`), only when
  it is installed, with its README's settings (exact loss scaling, join);
- `odb-sqrt-lr`, `odb-linear-lr`, `odb-parity` (`--quality` only): the documented
  learning-rate recipes (`odb_core.bench.recipes`).

`--quality`: `--epochs` epochs per run, a seed per repeat (init and data order;
`--regime finetune` first trains each seed's init one epoch on another
distribution), held-out loss every 1/4 epoch with its time left out of the
training time, every schedule linear to 0 at the run's last update (fixed-batch
strategies: LambdaLR over their exact step count; odb: `ProgressLR`), and the
time-to-target / held-out-gap summary of `odb_core.bench.quality`.

`--model qwen3-vl-tiny` (docs/VLM.md) adds `grouped-estimate` (LLaVA's
`group_by_modality_length`, no pass); `--lora` trains PEFT adapters only.

Every odb-core run must have equal steps on every rank and every id exactly once;
the bench raises otherwise. The model and the run are CPU-sized by default.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from odb_core.bench.gmt import gmt_plan
from odb_core.bench.recipes import RECIPES
from odb_core.bench.workload import MIN_LEN, SIZES, BenchCollate, LongTailText, TextWorkload

VLM_MODELS = ("qwen3-vl-tiny",)  # odb_core.bench.vlm_workload.VLM_SIZES (imported lazily)

STRATEGIES = (
    "standard",
    "grouped",
    "grouped-estimate",
    "gmt",
    "trl-packed",
    "odb-padded",
    "odb-packed",
    "odb-sqrt-lr",
    "odb-linear-lr",
    "odb-parity",
    "odb-ref",
)
ODB_STRATEGIES = tuple(RECIPES)
THROUGHPUT_DEFAULT = ("standard", "grouped", "gmt", "odb-padded", "odb-packed", "odb-ref")
VLM_DEFAULT = ("standard", "grouped", "grouped-estimate", "gmt", "odb-padded", "odb-packed")
VLM_QUALITY_DEFAULT = (*VLM_DEFAULT, "odb-linear-lr")
PLANNED = ("gmt", "grouped", "grouped-estimate", "trl-packed")  # offline plans (_Batches)
PACKED_PLANS = ("trl-packed",)
QUALITY_DEFAULT = tuple(
    s for s in STRATEGIES if s not in ("odb-ref", "grouped-estimate", "trl-packed")
)
REGIMES = ("scratch", "finetune")
WARMUP = 0.05  # of the run, every --quality schedule (linear to 0 at the last update)


def odb_ref_missing() -> str | None:
    """None if the comparator `online-dynamic-batching` is importable, else why not."""
    try:
        importlib.import_module("odb")
    except Exception as exc:
        return f"online-dynamic-batching not importable ({type(exc).__name__}: {exc})"
    return None


def validate(params: dict[str, Any]) -> list[str]:
    """Raise ValueError naming a bad option; returns the strategies to run."""
    vlm = params["model"] in VLM_MODELS
    if params["model"] not in SIZES and not vlm:
        known = ", ".join([*SIZES, *VLM_MODELS])
        raise ValueError(f"unknown --model {params['model']!r}; expected one of {known}")
    if vlm:
        _validate_vlm(params)
    elif params.get("lora"):
        raise ValueError(
            f"--lora is for a VLM --model ({', '.join(VLM_MODELS)}); --model "
            f"{params['model']} trains full"
        )
    if importlib.util.find_spec("transformers") is None:
        raise ValueError("--model needs transformers: pip install 'odb-core[hf]'")
    if params["max_len"] < MIN_LEN:
        raise ValueError(f"--max-len={params['max_len']} must be >= {MIN_LEN}")
    if params["budget"] < params["max_len"] and params["oversize"] == "error":
        raise ValueError(
            f"--budget={params['budget']} is under the longest sample (--max-len="
            f"{params['max_len']}): no batch could hold it; raise the budget, lower "
            "--max-len, or pass --oversize solo|truncate"
        )
    lr = params.get("lr", 1e-3)
    if not (isinstance(lr, float | int) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"--lr={lr!r} must be a finite number > 0")
    if params["eval_samples"] < 1:
        raise ValueError(f"--eval-samples={params['eval_samples']} must be >= 1")
    if params.get("regime", "scratch") not in REGIMES:
        raise ValueError(
            f"unknown --regime {params['regime']!r}; expected one of {', '.join(REGIMES)}"
        )
    if params.get("epochs", 1) < 1:
        raise ValueError(f"--epochs={params['epochs']} must be >= 1")
    if not params.get("quality") and (
        params.get("epochs", 1) != 1 or params.get("regime", "scratch") != "scratch"
    ):
        raise ValueError("--epochs and --regime finetune need --quality")
    unknown = [s for s in params["strategies"] if s not in STRATEGIES]
    if unknown:
        raise ValueError(
            f"unknown strategy {unknown[0]!r}; expected some of {', '.join(STRATEGIES)}"
        )
    chosen = [s for s in STRATEGIES if s in params["strategies"]]
    if not params.get("quality"):
        extra = [s for s in chosen if s in RECIPES and RECIPES[s].quality_only]
        if extra:
            raise ValueError(f"strategy {extra[0]!r} is a learning-rate recipe: it needs --quality")
    elif "odb-ref" in chosen:
        raise ValueError("odb-ref has no schedule on run progress: leave it out of --quality")
    if params.get("quality") and "standard" not in chosen:
        raise ValueError(
            "--quality needs 'standard' among the strategies (its final loss is the target)"
        )
    if "grouped-estimate" in chosen and not vlm:
        raise ValueError("strategy 'grouped-estimate' groups by modality: it needs a VLM --model")
    if "trl-packed" in chosen:
        if vlm:
            raise ValueError(
                "strategy 'trl-packed' is TRL's text packing: TRL refuses packing for "
                "vision datasets, so it needs a text --model"
            )
        if importlib.util.find_spec("trl") is None:
            raise ValueError("strategy 'trl-packed' needs trl: pip install 'odb-core[trl]'")
    for name in ("grouped", "grouped-estimate"):
        if name in chosen and importlib.util.find_spec("accelerate") is None:
            raise ValueError(
                f"strategy {name!r} needs accelerate (its DataLoader sharding): "
                "pip install accelerate"
            )
    if "odb-ref" in chosen and (vlm or odb_ref_missing() is not None):
        chosen.remove("odb-ref")
    if not chosen:
        raise ValueError("no strategy to run")
    return chosen


def _validate_vlm(params: dict[str, Any]) -> None:
    if importlib.util.find_spec("PIL") is None:
        raise ValueError(f"--model {params['model']} needs Pillow: pip install 'odb-core[vlm]'")
    if params.get("regime", "scratch") != "scratch":
        raise ValueError(
            f"--regime finetune is text-only; --model {params['model']} trains scratch"
        )
    if params.get("lora") and importlib.util.find_spec("peft") is None:
        raise ValueError("--lora needs peft: pip install 'odb-core[peft]'")


def workload_for(params: dict[str, Any]) -> Any:
    """The model, data and collate of `--model` (text or VLM)."""
    if params["model"] in VLM_MODELS:
        from odb_core.bench.vlm_workload import VLMWorkload

        return VLMWorkload(params["model"], params["max_len"], lora=bool(params.get("lora")))
    return TextWorkload(params["model"], params["max_len"])


def _shm_mb() -> float:
    """/dev/shm in use (machine-wide: DataLoader workers hand tensors through it)."""
    import shutil

    try:
        return shutil.disk_usage("/dev/shm").used / 2**20
    except OSError:
        return 0.0


class _Seconds:
    """Seconds a module's forward has taken since the last `pop`."""

    def __init__(self) -> None:
        self.total = 0.0
        self.started = 0.0

    def pop(self) -> float:
        out, self.total = self.total, 0.0
        return out


def _forward_timer(module: Any) -> _Seconds:
    """Time `module`'s forward passes (the vision tower's share of a step); held-out
    evaluation included, so `pop` before and after a run."""
    sec = _Seconds()
    if module is not None:

        def pre(*_: Any) -> None:
            sec.started = time.perf_counter()

        def post(*_: Any) -> None:
            sec.total += time.perf_counter() - sec.started

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return sec


# ---- the parent process ----------------------------------------------------------


def run_bench(params: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Validate, start W rank processes, return rank 0's report (raises on failure)."""
    import torch.multiprocessing as mp

    from odb_core.bench.launch import free_port

    strategies = validate(params)
    params = {**params, "strategies": strategies}
    with tempfile.TemporaryDirectory(prefix="odb-model-bench-") as tmp:
        out = Path(tmp) / "result.json"
        err = Path(tmp) / "error.txt"
        port = free_port()
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(r, params["ranks"], port, params, str(out), str(err), progress),
            )
            for r in range(params["ranks"])
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + params["timeout"]
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        if err.exists():
            raise RuntimeError(f"odb bench --model failed: {err.read_text()}")
        if hung or any(p.exitcode != 0 for p in procs) or not out.exists():
            codes = [p.exitcode for p in procs]
            raise RuntimeError(f"odb bench --model: ranks failed or timed out (exit codes {codes})")
        result: dict[str, Any] = json.loads(out.read_text())
    missing = odb_ref_missing()
    if missing and "odb-ref" in params.get("requested", STRATEGIES):
        result["notes"].append(f"odb-ref skipped: {missing}")
    return result


def _rank_main(
    rank: int,
    world: int,
    port: int,
    params: dict[str, Any],
    out: str,
    err: str,
    progress: bool,
) -> None:
    import torch.distributed as dist

    from odb_core.bench.launch import init_local_gloo, release_child_resources

    init_local_gloo(rank, world, port, timeout_s=300)
    try:
        result = run_rank(rank, world, params, progress)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    except BaseException as exc:
        if rank == 0 or not Path(err).exists():
            Path(err).write_text(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()
        release_child_resources()


# ---- the rank processes ----------------------------------------------------------


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Run:
    """One strategy's epoch on one rank: per-step timeline and totals."""

    def __init__(self) -> None:
        self.steps = 0
        self.updates = 0
        self.pads = 0
        self.samples = 0
        self.real_tokens = 0
        self.computed_tokens = 0
        self.loss_sum = 0.0
        self.loss_tokens = 0
        self.wait = 0.0
        self.collate = 0.0
        self.peak_rss = 0.0
        self.peak_shm = 0.0
        self.vision = 0.0
        self.epoch_ids: list[list[int]] = []
        self.epoch_steps: list[int] = []
        self.timeline: list[tuple[float, float, float, int, int, int, bool]] = []
        self.step_ids: list[list[int]] = []  # per timeline step (simulator/bench_fit.py)


class _Batches:
    """A batch sampler whose batches the oracle replaces every epoch (so its
    DataLoader, and its persistent workers, are built once like every other)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.batches))

    def __len__(self) -> int:
        return len(self.batches)


def _lengths_pass(ds: Any, rank: int, world: int) -> tuple[list[int], float]:
    """Every sample's length, read through `__getitem__` on all ranks (the pass an
    offline sampler needs), and its time (the slowest rank's)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    mine = {i: len(ds[i]["input_ids"]) for i in range(rank, len(ds), world)}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    lens = [0] * len(ds)
    for part in gathered:
        for i, n in part.items():
            lens[i] = n
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return lens, float(took.item())


def run_rank(rank: int, world: int, params: dict[str, Any], progress: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from odb_core.bench.grouped import grouped_plan
    from odb_core.schedule import (
        Schedule,
        Shape,
        TokenScaling,
        fixed_batch_tokens,
        match_fixed_batch,
    )
    from odb_core.torch.collate import check_packed_model
    from odb_core.torch.loader import ODBDataLoader
    from odb_core.torch.meta import causal_lm_loss, pop_step_meta
    from odb_core.torch.profile import sample_profile
    from odb_core.torch.schedule import ProgressLR

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    seed, budget, max_len = params["seed"], params["budget"], params["max_len"]
    quality = bool(params.get("quality"))
    epochs = int(params.get("epochs", 1))
    per_epoch_checks = int(params.get("checkpoints", 4)) if quality else 0
    wl = workload_for(params)
    ds = wl.dataset(params["samples"], seed)
    held_out = wl.dataset(params["eval_samples"], seed + 7919)
    workers = params["workers"]
    wkw: dict[str, Any] = {"num_workers": workers}
    if workers > 0:
        wkw.update(persistent_workers=True, multiprocessing_context="fork")
    fixed_batch = max(1, budget // max_len)
    model = wl.model(seed)
    strategies: list[str] = params["strategies"]
    if any(RECIPES[s].packed for s in strategies if s in RECIPES) or any(
        s in strategies for s in PACKED_PLANS
    ):
        check_packed_model(model)  # packed rows must attend within each sample only
    init_state = copy.deepcopy(model.state_dict())
    vision_s = _forward_timer(wl.vision_tower(model))
    ddp = DistributedDataParallel(model, find_unused_parameters=wl.find_unused_parameters)
    schedule = Schedule(Shape.LINEAR, warmup=WARMUP)
    odb_kw: dict[str, Any] = {
        "shuffle": True,
        "oversize": params["oversize"],
        "peer_timeout": 300,
        **wkw,
    }
    if params["buffer_size"]:
        odb_kw["buffer_size"] = params["buffer_size"]
    if params.get("former"):
        odb_kw["former"] = params["former"]
    profile = (
        sample_profile(ds)
        if any(s in RECIPES and RECIPES[s].quality_only for s in strategies)
        else None
    )

    def odb_loader(name: str, data_seed: int) -> Any:
        recipe = RECIPES[name]
        kw: dict[str, Any] = {"token_budget": budget, "seed": data_seed, **odb_kw}
        if recipe.parity:
            assert profile is not None
            kw["token_budget"] = max_len
            kw["tokens_per_update"] = match_fixed_batch(
                profile, batch_size=fixed_batch, world_size=world
            )
        return ODBDataLoader(
            ds, cost_model=recipe.cost_model, collate_fn=wl.collate(recipe.packed), **kw
        )

    loaders: dict[str, Any] = {}
    sampler: DistributedSampler[Any] = DistributedSampler(ds, shuffle=True, seed=seed)
    if "standard" in strategies:
        loaders["standard"] = DataLoader(
            ds, batch_size=fixed_batch, sampler=sampler, collate_fn=wl.collate(False), **wkw
        )
    if not quality:  # one loader for every repeat (its workers start once)
        for name in strategies:
            if name in RECIPES:
                loaders[name] = odb_loader(name, seed)
    planned = _Batches()
    for name in PLANNED:
        if name in strategies:
            loaders[name] = DataLoader(
                ds, batch_sampler=planned, collate_fn=wl.collate(name in PACKED_PLANS), **wkw
            )
    ref_sampler: DistributedSampler[Any] = DistributedSampler(ds, shuffle=True, seed=seed)
    if "odb-ref" in strategies:
        odb: Any = importlib.import_module("odb")
        loaders["odb-ref"] = odb.ODBDataLoader(
            ds,
            token_budget=budget,
            batch_size=1,
            sampler=ref_sampler,
            num_workers=max(1, workers),
            prefetch_factor=64,
            collate_fn=BenchCollate(False),
            loss_scaling="exact",
            join=True,
        )
    # The fine-tuning regime: every seed's init is first trained for one epoch on
    # another distribution (another response rule), at a fixed rate, then every
    # strategy fine-tunes that same model.
    pre_ds = (
        LongTailText(
            params["pretrain_samples"], max_len, SIZES[params["model"]][5], seed + 104729, rule=3
        )
        if params.get("regime") == "finetune"
        else None
    )

    def init_for(rep: int) -> dict[str, Any]:
        if not quality:
            return dict(init_state)
        state: dict[str, Any] = wl.model(seed + rep).state_dict()
        if pre_ds is None:
            return state
        ddp.module.load_state_dict(state)
        pre_sampler: DistributedSampler[Any] = DistributedSampler(
            pre_ds, shuffle=True, seed=seed + rep
        )
        pre = DataLoader(
            pre_ds, batch_size=fixed_batch, sampler=pre_sampler, collate_fn=BenchCollate(False)
        )
        opt = torch.optim.AdamW(ddp.parameters(), lr=params["lr"])
        for batch in pre:
            for k in ("bench_ids", "bench_collate_s", "use_cache"):
                batch.pop(k, None)
            labels = batch.pop("labels")
            logits = ddp(**batch, use_cache=False).logits
            F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            ).backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad(set_to_none=True)
        trained: dict[str, Any] = copy.deepcopy(ddp.module.state_dict())
        return trained

    def train(name: str, rep: int) -> tuple[_Run, float, float, float, list[Any]]:
        """`epochs` epochs of `name` from the repeat's init; held-out checkpoints in
        --quality runs (their time is not training time)."""
        run = _Run()
        precompute = 0.0
        plans: list[list[list[list[int]]]] = []
        if name in PLANNED:
            if name == "grouped-estimate":  # LLaVA's: text words from the stored data, no pass
                lens = ds.modality_lengths()
            else:
                lens, precompute = _lengths_pass(ds, rank, world)
            for e in range(epochs):
                ep_seed = seed + rep * epochs + e
                if name == "gmt":
                    plan = gmt_plan(lens, budget, world, ep_seed)
                elif name == "grouped":
                    plan = grouped_plan(lens, fixed_batch, world, ep_seed)
                elif name == "trl-packed":
                    from odb_core.bench.trl_packing import trl_bfd_plan

                    plan, packing_s = trl_bfd_plan(lens, budget, world, ep_seed)
                    precompute += packing_s
                else:
                    from odb_core.bench.vlm_grouped import grouped_estimate_plan

                    plan = grouped_estimate_plan(lens, fixed_batch, world, ep_seed)
                if any(not p for p in plan):
                    raise ValueError(
                        f"{name} formed {sum(map(len, plan))} batches for {world} ranks: "
                        "too few samples for this budget; raise --samples"
                    )
                plans.append(plan)
        loader = odb_loader(name, seed + rep) if quality and name in RECIPES else loaders[name]
        ddp.module.load_state_dict(init_states[rep])
        opt = torch.optim.AdamW(ddp.parameters(), lr=params["lr"])
        sched: Any = None
        if quality and name in RECIPES:
            recipe = RECIPES[name]
            tokens = None
            if recipe.lr_tokens is not None:
                assert profile is not None
                ref = fixed_batch_tokens(profile, batch_size=fixed_batch, world_size=world)
                tokens = TokenScaling(ref, recipe.lr_tokens)
            sched = ProgressLR(
                opt, loader, epochs=epochs, shape="linear", warmup=WARMUP, tokens=tokens
            )
        elif quality:
            per_epoch = len(loader) if name == "standard" else max(len(p) for p in plans[0])
            total = epochs * per_epoch
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda k: schedule.multiplier(min(1.0, k / total))
            )
        n = len(ds)
        checks = [n * k / per_epoch_checks for k in range(1, epochs * per_epoch_checks + 1)]
        curve: list[Any] = []
        consumed = 0
        eval_s = 0.0
        if quality:
            curve.append((0.0, 0, held_out_loss()))
        dist.barrier()
        shm0 = _shm_mb()
        vision_s.pop()
        start = time.perf_counter()
        for e in range(epochs):
            real_steps = -1
            global_per_step: list[int] = []
            if plans:
                plan = plans[e]
                mine_batches = plan[rank]
                real_steps = len(mine_batches)
                steps = max(len(p) for p in plan)
                global_per_step = [sum(len(p[s]) for p in plan if s < len(p)) for s in range(steps)]
                planned.batches = mine_batches + mine_batches[:1] * (steps - real_steps)
            sampler.set_epoch(rep * epochs + e)
            ref_sampler.set_epoch(rep * epochs + e)
            epoch_steps = 0
            epoch_ids: list[int] = []
            join = ddp.join() if name == "odb-ref" else contextlib.nullcontext()
            with join:
                it = iter(loader)
                while True:
                    t_wait = time.perf_counter()
                    try:
                        batch = next(it)
                    except StopIteration:
                        break
                    t_got = time.perf_counter()
                    scale: float | None = None
                    meta = None
                    is_pad = False
                    if name in RECIPES:
                        meta = pop_step_meta(batch)
                        is_pad = meta.is_pad
                    elif name == "odb-ref":
                        info = importlib.import_module("odb").pop_step_info(
                            batch, loss_scaling="exact"
                        )
                        scale = float(info.loss_scale)
                    elif plans:
                        is_pad = epoch_steps >= real_steps
                    ids = batch.pop("bench_ids")
                    run.collate += float(batch.pop("bench_collate_s"))
                    labels = batch.pop("labels")
                    batch.pop("use_cache", None)
                    sync = meta is None or meta.sync_gradients
                    ctx = contextlib.nullcontext() if sync else ddp.no_sync()
                    with ctx:
                        logits = ddp(**batch, use_cache=False).logits
                        if meta is not None:
                            loss = causal_lm_loss(meta, logits, labels)
                            tok = meta.local_loss_tokens
                            ce = (
                                0.0
                                if meta.is_pad or tok == 0
                                else (
                                    float(loss.detach()) * meta.window_loss_tokens / meta.world_size
                                )
                            )
                        else:
                            ce_t = F.cross_entropy(
                                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                labels[:, 1:].reshape(-1),
                                ignore_index=-100,
                                reduction="sum",
                            )
                            tok = int((labels[:, 1:] != -100).sum())
                            ce = float(ce_t.detach())
                            loss = (
                                ce_t
                                / max(1, tok)
                                * (0.0 if is_pad else (scale if scale is not None else 1.0))
                            )
                        loss.backward()  # type: ignore[no-untyped-call]
                    if sync:
                        run.updates += 1
                        opt.step()
                        if sched is not None:
                            sched.step()
                        opt.zero_grad(set_to_none=True)
                    t_done = time.perf_counter()
                    run.steps += 1
                    real = (
                        int(batch["attention_mask"].sum())
                        if "attention_mask" in batch
                        else int(batch["input_ids"].numel())
                    )
                    computed = int(batch["input_ids"].numel())
                    if is_pad:
                        run.pads += 1
                    else:
                        run.samples += len(ids)
                        epoch_ids.extend(int(i) for i in ids)
                        run.real_tokens += real
                        run.computed_tokens += computed
                        run.loss_sum += ce
                        run.loss_tokens += tok
                    run.wait += t_got - t_wait
                    run.peak_rss = max(run.peak_rss, _rss_mb())
                    run.peak_shm = max(run.peak_shm, _shm_mb() - shm0)
                    run.step_ids.append([int(i) for i in ids])
                    run.timeline.append(
                        (
                            t_wait - start - eval_s,
                            t_got - t_wait,
                            t_done - t_got,
                            real,
                            computed,
                            len(ids),
                            is_pad,
                        )
                    )
                    # the same global count on every rank, so every rank evaluates at
                    # the same step (the held-out loss is an all-reduce)
                    if meta is not None:
                        consumed += meta.global_samples
                    elif global_per_step:
                        consumed += global_per_step[epoch_steps]
                    else:
                        consumed += world * len(ids)
                    epoch_steps += 1
                    if quality and sync and checks and consumed >= checks[0]:
                        t_eval = time.perf_counter()
                        point = (t_eval - start - eval_s, consumed, held_out_loss())
                        curve.append(point)
                        while checks and consumed >= checks[0]:
                            checks.pop(0)
                        eval_s += time.perf_counter() - t_eval
            if name == "odb-ref":  # its iterator keeps its worker pids registered
                getattr(it, "_shutdown_workers", lambda: None)()
            del it
            run.epoch_steps.append(epoch_steps)
            run.epoch_ids.append(epoch_ids)
        wall = time.perf_counter() - start - eval_s
        run.vision = vision_s.pop()  # with --quality, held-out forwards included
        if quality and curve[-1][1] < consumed:
            curve.append((wall, consumed, held_out_loss()))
        allgather = 0.0
        if name in RECIPES:
            allgather = float(loader.epoch_stats.collective_stall_s)
        if sched is not None and hasattr(sched, "remove_hooks"):
            sched.remove_hooks()
        return run, wall, precompute, allgather, curve

    def held_out_loss() -> float:
        ddp.module.eval()
        total = torch.zeros(2, dtype=torch.float64)
        mine = list(range(rank, len(held_out), world))
        chunk: list[dict[str, Any]] = []
        used = 0
        with torch.no_grad():
            for i in [*mine, None]:
                s = held_out[i] if i is not None else None
                if s is not None and used + len(s["input_ids"]) <= max(budget, max_len):
                    chunk.append(s)
                    used += len(s["input_ids"])
                    continue
                if chunk:
                    b = wl.eval_batch(chunk)
                    labels = b.pop("labels")
                    logits = ddp.module(**b, use_cache=False).logits
                    total[0] += F.cross_entropy(
                        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                        labels[:, 1:].reshape(-1),
                        ignore_index=-100,
                        reduction="sum",
                    ).double()
                    total[1] += int((labels[:, 1:] != -100).sum())
                chunk = [s] if s is not None else []
                used = len(s["input_ids"]) if s is not None else 0
        dist.all_reduce(total)
        ddp.module.train()
        return float(total[0] / total[1].clamp(min=1))

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
    curves: dict[str, list[Any]] = {s: [] for s in strategies}
    timelines: dict[str, Any] = {}
    rank_steps: dict[str, Any] = {s: [] for s in strategies}  # per repeat: ranks, steps
    errors: list[str] = []
    init_states = [init_for(rep) for rep in range(params["repeats"])]
    for rep in range(params["repeats"]):
        for name in strategies:
            run, wall, precompute, allgather, curve = train(name, rep)
            eval_loss = curve[-1][2] if curve else held_out_loss()
            mine = {
                "steps": run.steps,
                "updates": run.updates,
                "pads": run.pads,
                "samples": run.samples,
                "real_tokens": run.real_tokens,
                "computed_tokens": run.computed_tokens,
                "loss_sum": run.loss_sum,
                "loss_tokens": run.loss_tokens,
                "wait": run.wait,
                "collate": run.collate,
                "vision": run.vision,
                "allgather": allgather,
                "wall": wall,
                "rss": run.peak_rss,
                "shm": run.peak_shm,
                "ids": run.epoch_ids,
                "epoch_steps": run.epoch_steps,
                "timeline": run.timeline,
                "step_ids": run.step_ids,
            }
            per_rank: list[Any] = [None] * world
            dist.all_gather_object(per_rank, mine)
            steps = [r["steps"] for r in per_rank]
            equal_steps = all(
                len({r["epoch_steps"][e] for r in per_rank}) == 1 for e in range(epochs)
            )
            exactly_once = True
            for e in range(epochs):
                ids = sorted(i for r in per_rank for i in r["ids"][e])
                once = ids == list(range(len(ds)))
                exactly_once = exactly_once and once
                if name in RECIPES and (not equal_steps or not once):
                    dup = len(ids) - len(set(ids))
                    lost = len(ds) - len(set(ids))
                    errors.append(
                        f"{name} repeat {rep} epoch {e}: steps per rank "
                        f"{[r['epoch_steps'][e] for r in per_rank]}, {dup} duplicated and "
                        f"{lost} lost ids"
                    )
            summary = _summarise(per_rank, precompute, eval_loss, len(ds))
            summary["equal_steps"] = equal_steps
            summary["exactly_once"] = exactly_once
            if quality:
                summary["curve"] = curve
            runs[name].append(summary)
            rank_steps[name].append(
                [{"timeline": r["timeline"], "ids": r["step_ids"]} for r in per_rank]
            )
            curves[name].append(curve)
            if rep == params["repeats"] - 1:
                timelines[name] = run.timeline if rank == 0 else None
            if rank == 0 and progress:
                print(
                    f"[odb bench] repeat {rep + 1}/{params['repeats']} {name:13} "
                    f"{summary['wall_s']:7.1f} s  {summary['samples_per_s']:7.2f} samples/s  "
                    f"steps/rank {steps}  padding {100 * summary['padding']:.1f}%  "
                    f"held-out loss {eval_loss:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
            if errors:
                raise RuntimeError("; ".join(errors))
    counts = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    result = _report({**params, **counts}, runs, timelines, fixed_batch)
    result["timeline_ranks"] = rank_steps
    if quality:
        from odb_core.bench.quality import summarise as quality_summary

        result["quality"] = {
            "regime": params.get("regime", "scratch"),
            "epochs": epochs,
            "checkpoints_per_epoch": per_epoch_checks,
            "schedule": f"linear to 0 at the last update, warmup {WARMUP:g} of the run",
            "strategies": quality_summary(curves, "standard", "grouped"),
        }
    return result


def _summarise(
    per_rank: list[dict[str, Any]], precompute: float, eval_loss: float, n: int
) -> dict[str, Any]:
    wall = max(r["wall"] for r in per_rank)
    samples = sum(r["samples"] for r in per_rank)
    real = sum(r["real_tokens"] for r in per_rank)
    computed = sum(r["computed_tokens"] for r in per_rank)
    return {
        "wall_s": wall,
        "precompute_s": precompute,
        "samples": samples,
        "samples_per_s": samples / wall,
        "samples_per_s_incl_precompute": samples / (wall + precompute),
        "tokens_per_s": real / wall,
        "padding": 1.0 - real / max(1, computed),
        "steps_per_rank": [r["steps"] for r in per_rank],
        "updates": per_rank[0]["updates"],
        "pad_steps": sum(r["pads"] for r in per_rank),
        "peak_rss_mb": max(r["rss"] for r in per_rank),
        "peak_rss_mb_per_rank": [r["rss"] for r in per_rank],
        "dev_shm_peak_mb": max(r["shm"] for r in per_rank),
        "data_wait_s": max(r["wait"] for r in per_rank),
        "collate_s": max(r["collate"] for r in per_rank),
        "vision_forward_s": max(r["vision"] for r in per_rank),
        "allgather_stall_s": max(r["allgather"] for r in per_rank),
        "train_loss_per_token": sum(r["loss_sum"] for r in per_rank)
        / max(1, sum(r["loss_tokens"] for r in per_rank)),
        "held_out_loss": eval_loss,
        "unique_ids": len({i for r in per_rank for i in r["ids"][-1]}),  # last epoch
        "dataset": n,
    }


MEDIAN_KEYS = (
    "wall_s",
    "precompute_s",
    "samples_per_s",
    "samples_per_s_incl_precompute",
    "tokens_per_s",
    "padding",
    "pad_steps",
    "peak_rss_mb",
    "dev_shm_peak_mb",
    "data_wait_s",
    "collate_s",
    "vision_forward_s",
    "allgather_stall_s",
    "train_loss_per_token",
    "held_out_loss",
)


def _paired(runs: dict[str, list[dict[str, Any]]], a: str, b: str, key_b: str) -> float | None:
    if a not in runs or b not in runs:
        return None
    ratios = [x["samples_per_s"] / y[key_b] for x, y in zip(runs[a], runs[b], strict=True)]
    return float(statistics.median(ratios))


def _report(
    params: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
    timelines: dict[str, Any],
    fixed_batch: int,
) -> dict[str, Any]:
    strategies: dict[str, Any] = {}
    for name, rs in runs.items():
        row: dict[str, Any] = {k: float(statistics.median(r[k] for r in rs)) for k in MEDIAN_KEYS}
        row["steps_per_rank"] = rs[-1]["steps_per_rank"]
        row["equal_steps"] = all(r["equal_steps"] for r in rs)
        row["exactly_once"] = all(r["exactly_once"] for r in rs)
        row["runs"] = rs
        strategies[name] = row
    ratios: dict[str, float | None] = {
        "grouped/standard": _paired(runs, "grouped", "standard", "samples_per_s")
    }
    for odb in ODB_STRATEGIES:
        ratios[f"{odb}/standard"] = _paired(runs, odb, "standard", "samples_per_s")
        ratios[f"{odb}/grouped"] = _paired(runs, odb, "grouped", "samples_per_s")
        ratios[f"{odb}/grouped_incl_length_pass"] = _paired(
            runs, odb, "grouped", "samples_per_s_incl_precompute"
        )
        ratios[f"{odb}/grouped-estimate"] = _paired(runs, odb, "grouped-estimate", "samples_per_s")
        ratios[f"{odb}/gmt"] = _paired(runs, odb, "gmt", "samples_per_s")
        ratios[f"{odb}/gmt_incl_precompute"] = _paired(
            runs, odb, "gmt", "samples_per_s_incl_precompute"
        )
        ratios[f"{odb}/odb-ref"] = _paired(runs, odb, "odb-ref", "samples_per_s")
        ratios[f"{odb}/trl-packed"] = _paired(runs, odb, "trl-packed", "samples_per_s")
        ratios[f"{odb}/trl-packed_incl_pass"] = _paired(
            runs, odb, "trl-packed", "samples_per_s_incl_precompute"
        )
    if "standard" in strategies:
        base = strategies["standard"]["held_out_loss"]
        for row in strategies.values():
            row["held_out_vs_standard"] = row["held_out_loss"] / base - 1.0
    ok = all(
        strategies[s]["equal_steps"] and strategies[s]["exactly_once"]
        for s in ODB_STRATEGIES
        if s in strategies
    )
    return {
        "ok": ok,
        "params": {**params, "fixed_batch": fixed_batch},
        "strategies": strategies,
        "ratios": {k: v for k, v in ratios.items() if v is not None},
        "timeline_rank0_last_repeat": timelines,
        "timeline_fields": [
            "t_s",
            "wait_s",
            "compute_s",
            "real_tokens",
            "computed_tokens",
            "samples",
            "is_pad",
        ],
        "notes": [],
    }
