"""One strategy's run on one rank of `odb bench --model`: its offline plans (and
their timed length pass), its learning-rate schedule, the train loop over its
epochs (each step timed, with what it computed and who it held), and the held-out
checkpoints of `--quality` runs, whose time is not training time."""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass
from typing import Any

import torch

from odb_core.bench.gmt import gmt_plan
from odb_core.bench.model_options import PLANNED, WARMUP
from odb_core.bench.model_setup import RankSetup
from odb_core.bench.recipes import RECIPES

Plan = list[list[list[int]]]  # per rank, its batches of sample ids


def shm_mb() -> float:
    """/dev/shm in use (machine-wide: DataLoader workers hand tensors through it)."""
    import shutil

    try:
        return shutil.disk_usage("/dev/shm").used / 2**20
    except OSError:
        return 0.0


def rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class RunStats:
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
        self.loader: dict[str, Any] | None = None  # odb-core's: what was in force (describe)


@dataclass
class _Clock:
    """Where a run stands: its start, the samples consumed (the same global count on
    every rank), the held-out checkpoints still to come, the curve, evaluation time."""

    start: float
    shm0: float
    checks: list[float]
    curve: list[Any]
    consumed: int = 0
    eval_s: float = 0.0


@dataclass
class _Step:
    """What a trained step leaves for the record."""

    ids: Any
    meta: Any
    is_pad: bool
    sync: bool
    ce: float
    tok: int


def lengths_pass(ds: Any, rank: int, world: int) -> tuple[list[int], float]:
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


def plans_for(rs: RankSetup, name: str, rep: int) -> tuple[list[Plan], float]:
    """Every epoch's offline plan of `name` (none for an online strategy) and its
    precompute: the timed length pass, and TRL's packing."""
    from odb_core.bench.grouped import grouped_plan

    precompute = 0.0
    plans: list[Plan] = []
    if name not in PLANNED:
        return plans, precompute
    if name == "grouped-estimate":  # LLaVA's: text words from the stored data, no pass
        lens = rs.ds.modality_lengths()
    else:
        lens, precompute = lengths_pass(rs.ds, rs.rank, rs.world)
    world, budget, fixed_batch = rs.world, rs.budget, rs.fixed_batch
    for e in range(rs.epochs):
        ep_seed = rs.seed + rep * rs.epochs + e
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
    return plans, precompute


def _scheduler(rs: RankSetup, name: str, opt: Any, loader: Any, plans: list[Plan]) -> Any:
    """A `--quality` run's schedule, linear to 0 at its last update (None otherwise)."""
    if rs.quality and name in RECIPES:
        from odb_core.schedule import TokenScaling, fixed_batch_tokens
        from odb_core.torch.lr_scheduler import ProgressLR

        recipe = RECIPES[name]
        tokens = None
        if recipe.lr_tokens is not None:
            assert rs.profile is not None
            ref = fixed_batch_tokens(rs.profile, batch_size=rs.fixed_batch, world_size=rs.world)
            tokens = TokenScaling(ref, recipe.lr_tokens)
        return ProgressLR(
            opt, loader, epochs=rs.epochs, shape="linear", warmup=WARMUP, tokens=tokens
        )
    if rs.quality:
        per_epoch = len(loader) if name == "standard" else max(len(p) for p in plans[0])
        total = rs.epochs * per_epoch
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda k: rs.schedule.multiplier(min(1.0, k / total))
        )
    return None


def train(rs: RankSetup, name: str, rep: int) -> tuple[RunStats, float, float, float, list[Any]]:
    """`epochs` epochs of `name` from the repeat's init; held-out checkpoints in
    --quality runs (their time is not training time). Returns the run's stats, its
    wall time, its precompute, its all-gather stall and its held-out curve."""
    import torch.distributed as dist

    run = RunStats()
    plans, precompute = plans_for(rs, name, rep)
    quality = rs.quality
    loader = rs.odb_loader(name, rs.seed + rep) if quality and name in RECIPES else rs.loaders[name]
    rs.ddp.module.load_state_dict(rs.init_states[rep])
    opt = torch.optim.AdamW(rs.ddp.parameters(), lr=rs.params["lr"])
    sched = _scheduler(rs, name, opt, loader, plans)
    n, per_epoch_checks = len(rs.ds), rs.per_epoch_checks
    checks = [n * k / per_epoch_checks for k in range(1, rs.epochs * per_epoch_checks + 1)]
    curve: list[Any] = []
    if quality:
        curve.append((0.0, 0, rs.held_out_loss()))
    dist.barrier()
    shm0 = shm_mb()
    rs.vision_s.pop()
    clock = _Clock(start=time.perf_counter(), shm0=shm0, checks=checks, curve=curve)
    for e in range(rs.epochs):
        _epoch(rs, name, rep, e, loader, plans, run, clock, opt, sched)
    wall = time.perf_counter() - clock.start - clock.eval_s
    run.vision = rs.vision_s.pop()  # with --quality, held-out forwards included
    if quality and curve[-1][1] < clock.consumed:
        curve.append((wall, clock.consumed, rs.held_out_loss()))
    allgather = 0.0
    if name in RECIPES:
        allgather = float(loader.epoch_stats.collective_stall_s)
        run.loader = loader.describe()
    if sched is not None and hasattr(sched, "remove_hooks"):
        sched.remove_hooks()
    return run, wall, precompute, allgather, curve


def _epoch(
    rs: RankSetup,
    name: str,
    rep: int,
    e: int,
    loader: Any,
    plans: list[Plan],
    run: RunStats,
    clock: _Clock,
    opt: Any,
    sched: Any,
) -> None:
    """Epoch `e` of the run: every step trained, recorded, and checkpointed when due."""
    real_steps = -1
    global_per_step: list[int] = []
    if plans:
        plan = plans[e]
        mine_batches = plan[rs.rank]
        real_steps = len(mine_batches)
        steps = max(len(p) for p in plan)
        global_per_step = [sum(len(p[s]) for p in plan if s < len(p)) for s in range(steps)]
        rs.planned.batches = mine_batches + mine_batches[:1] * (steps - real_steps)
    rs.sampler.set_epoch(rep * rs.epochs + e)
    rs.ref_sampler.set_epoch(rep * rs.epochs + e)
    epoch_steps = 0
    epoch_ids: list[int] = []
    join = rs.ddp.join() if name == "odb-ref" else contextlib.nullcontext()
    with join:
        it = iter(loader)
        while True:
            t_wait = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            t_got = time.perf_counter()
            planned_pad = bool(plans) and epoch_steps >= real_steps
            step = _step(rs, name, batch, run, opt, sched, planned_pad)
            t_done = time.perf_counter()
            _record(run, clock, step, batch, epoch_ids, (t_wait, t_got, t_done))
            # the same global count on every rank, so every rank evaluates at
            # the same step (the held-out loss is an all-reduce)
            if step.meta is not None:
                clock.consumed += step.meta.global_samples
            elif global_per_step:
                clock.consumed += global_per_step[epoch_steps]
            else:
                clock.consumed += rs.world * len(step.ids)
            epoch_steps += 1
            if rs.quality and step.sync and clock.checks and clock.consumed >= clock.checks[0]:
                _checkpoint(rs, clock)
    if name == "odb-ref":  # its iterator keeps its worker pids registered
        getattr(it, "_shutdown_workers", lambda: None)()
    del it
    run.epoch_steps.append(epoch_steps)
    run.epoch_ids.append(epoch_ids)


def _step(
    rs: RankSetup,
    name: str,
    batch: dict[str, Any],
    run: RunStats,
    opt: Any,
    sched: Any,
    planned_pad: bool,
) -> _Step:
    """Forward and backward of one batch, and the update when its window closes."""
    from odb_core.torch.meta import pop_step_meta

    scale: float | None = None
    meta = None
    is_pad = False
    if name in RECIPES:
        meta = pop_step_meta(batch)
        is_pad = meta.is_pad
    elif name == "odb-ref":
        info = importlib.import_module("odb").pop_step_info(batch, loss_scaling="exact")
        scale = float(info.loss_scale)
    else:
        is_pad = planned_pad
    ids = batch.pop("bench_ids")
    run.collate += float(batch.pop("bench_collate_s"))
    labels = batch.pop("labels")
    batch.pop("use_cache", None)
    sync = meta is None or meta.sync_gradients
    ctx = contextlib.nullcontext() if sync else rs.ddp.no_sync()
    with ctx:
        logits = rs.ddp(**batch, use_cache=False).logits
        loss, ce, tok = _loss(meta, logits, labels, is_pad, scale)
        loss.backward()  # type: ignore[no-untyped-call]
    if sync:
        run.updates += 1
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
    return _Step(ids, meta, is_pad, sync, ce, tok)


def _loss(
    meta: Any, logits: torch.Tensor, labels: torch.Tensor, is_pad: bool, scale: float | None
) -> tuple[torch.Tensor, float, int]:
    """The step's loss to back-propagate, its summed cross-entropy and loss tokens."""
    import torch.nn.functional as F

    from odb_core.torch.meta import causal_lm_loss

    if meta is not None:
        loss = causal_lm_loss(meta, logits, labels)
        tok: int = meta.local_loss_tokens
        ce = (
            0.0
            if meta.is_pad or tok == 0
            else (float(loss.detach()) * meta.window_loss_tokens / meta.world_size)
        )
        return loss, ce, tok
    ce_t = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )
    tok = int((labels[:, 1:] != -100).sum())
    ce = float(ce_t.detach())
    loss = ce_t / max(1, tok) * (0.0 if is_pad else (scale if scale is not None else 1.0))
    return loss, ce, tok


def _record(
    run: RunStats,
    clock: _Clock,
    step: _Step,
    batch: dict[str, Any],
    epoch_ids: list[int],
    times: tuple[float, float, float],
) -> None:
    """A trained step into the run's totals and timeline."""
    t_wait, t_got, t_done = times
    run.steps += 1
    real = (
        int(batch["attention_mask"].sum())
        if "attention_mask" in batch
        else int(batch["input_ids"].numel())
    )
    computed = int(batch["input_ids"].numel())
    ids = step.ids
    if step.is_pad:
        run.pads += 1
    else:
        run.samples += len(ids)
        epoch_ids.extend(int(i) for i in ids)
        run.real_tokens += real
        run.computed_tokens += computed
        run.loss_sum += step.ce
        run.loss_tokens += step.tok
    run.wait += t_got - t_wait
    run.peak_rss = max(run.peak_rss, rss_mb())
    run.peak_shm = max(run.peak_shm, shm_mb() - clock.shm0)
    run.step_ids.append([int(i) for i in ids])
    run.timeline.append(
        (
            t_wait - clock.start - clock.eval_s,
            t_got - t_wait,
            t_done - t_got,
            real,
            computed,
            len(ids),
            step.is_pad,
        )
    )


def _checkpoint(rs: RankSetup, clock: _Clock) -> None:
    """A held-out point on the curve; its time is counted apart."""
    t_eval = time.perf_counter()
    point = (t_eval - clock.start - clock.eval_s, clock.consumed, rs.held_out_loss())
    clock.curve.append(point)
    while clock.checks and clock.consumed >= clock.checks[0]:
        clock.checks.pop(0)
    clock.eval_s += time.perf_counter() - t_eval
