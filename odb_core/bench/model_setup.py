"""What a rank of `odb bench --model` builds once, before any strategy trains: the
workload's data and held-out set, the model under DDP and every strategy's
initial state, every strategy's loader (their persistent workers start once), the
fine-tuning regime's first training, and the held-out loss."""

from __future__ import annotations

import copy
import importlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from odb_core.bench.model_options import PACKED_PLANS, PLANNED, WARMUP, workload_for
from odb_core.bench.recipes import RECIPES
from odb_core.bench.workload import BenchCollate


class Seconds:
    """Seconds a module's forward has taken since the last `pop`."""

    def __init__(self) -> None:
        self.total = 0.0
        self.started = 0.0

    def pop(self) -> float:
        out, self.total = self.total, 0.0
        return out


def _forward_timer(module: Any) -> Seconds:
    """Time `module`'s forward passes (the vision tower's share of a step); held-out
    evaluation included, so `pop` before and after a run."""
    sec = Seconds()
    if module is not None:

        def pre(*_: Any) -> None:
            sec.started = time.perf_counter()

        def post(*_: Any) -> None:
            sec.total += time.perf_counter() - sec.started

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return sec


class PlannedBatches:
    """A batch sampler whose batches the oracle replaces every epoch (so its
    DataLoader, and its persistent workers, are built once like every other)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.batches))

    def __len__(self) -> int:
        return len(self.batches)


class RankSetup:
    """One rank's data, model, loaders and inits, shared by every strategy's runs."""

    def __init__(self, rank: int, world: int, params: dict[str, Any]) -> None:
        from odb_core.schedule import Schedule, Shape

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        self.rank, self.world, self.params = rank, world, params
        self.seed, self.budget, self.max_len = params["seed"], params["budget"], params["max_len"]
        self.quality = bool(params.get("quality"))
        self.epochs = int(params.get("epochs", 1))
        self.per_epoch_checks = int(params.get("checkpoints", 4)) if self.quality else 0
        self.wl = workload_for(params)
        self.ds = self.wl.dataset(params["samples"], self.seed)
        self.held_out = self.wl.dataset(params["eval_samples"], self.seed + 7919)
        self.workers = params["workers"]
        self.wkw: dict[str, Any] = {"num_workers": self.workers}
        if self.workers > 0:
            self.wkw.update(persistent_workers=True, multiprocessing_context="fork")
        self.fixed_batch = max(1, self.budget // self.max_len)
        self.strategies: list[str] = params["strategies"]
        self._build_model()
        self.schedule = Schedule(Shape.LINEAR, warmup=WARMUP)
        self._build_loaders()
        # The fine-tuning regime: every seed's init is first trained for one epoch on
        # another distribution (another response rule), at a fixed rate, then every
        # strategy fine-tunes that same model.
        self.pre_ds = (
            self.wl.pretrain_dataset(params["pretrain_samples"], self.seed + 104729)
            if params.get("regime") == "finetune"
            else None
        )
        self.init_states: list[dict[str, Any]] = []

    def _build_model(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from odb_core.torch.collate import check_packed_model

        self.model = self.wl.model(self.seed)
        strategies = self.strategies
        if any(RECIPES[s].packed for s in strategies if s in RECIPES) or any(
            s in strategies for s in PACKED_PLANS
        ):
            check_packed_model(self.model)  # packed rows must attend within each sample only
        self.init_state = copy.deepcopy(self.model.state_dict())
        self.vision_s = _forward_timer(self.wl.vision_tower(self.model))
        self.ddp = DistributedDataParallel(
            self.model, find_unused_parameters=self.wl.find_unused_parameters
        )

    def _build_loaders(self) -> None:
        from torch.utils.data import DataLoader, DistributedSampler

        from odb_core.torch.profile import sample_profile

        params, ds, wkw, strategies = self.params, self.ds, self.wkw, self.strategies
        self.odb_kw: dict[str, Any] = {
            "shuffle": True,
            "oversize": params["oversize"],
            "peer_timeout": 300,
            **wkw,
        }
        if params["buffer_size"]:
            self.odb_kw["buffer_size"] = params["buffer_size"]
        if params.get("former"):
            self.odb_kw["former"] = params["former"]
        if params.get("early_form"):
            self.odb_kw["early_form"] = params["early_form"]
        self.profile = (
            sample_profile(ds)
            if any(s in RECIPES and RECIPES[s].quality_only for s in strategies)
            else None
        )
        self.loaders: dict[str, Any] = {}
        self.sampler: DistributedSampler[Any] = DistributedSampler(ds, shuffle=True, seed=self.seed)
        if "standard" in strategies:
            self.loaders["standard"] = DataLoader(
                ds,
                batch_size=self.fixed_batch,
                sampler=self.sampler,
                collate_fn=self.wl.collate(False),
                **wkw,
            )
        if not self.quality:  # one loader for every repeat (its workers start once)
            for name in strategies:
                if name in RECIPES:
                    self.loaders[name] = self.odb_loader(name, self.seed)
        self.planned = PlannedBatches()
        for name in PLANNED:
            if name in strategies:
                self.loaders[name] = DataLoader(
                    ds,
                    batch_sampler=self.planned,
                    collate_fn=self.wl.collate(name in PACKED_PLANS),
                    **wkw,
                )
        self.ref_sampler: DistributedSampler[Any] = DistributedSampler(
            ds, shuffle=True, seed=self.seed
        )
        if "odb-ref" in strategies:
            odb: Any = importlib.import_module("odb")
            self.loaders["odb-ref"] = odb.ODBDataLoader(
                ds,
                token_budget=self.budget,
                batch_size=1,
                sampler=self.ref_sampler,
                num_workers=max(1, self.workers),
                prefetch_factor=64,
                collate_fn=BenchCollate(False),
                loss_scaling="exact",
                join=True,
            )

    def odb_loader(self, name: str, data_seed: int) -> Any:
        from odb_core.schedule import match_fixed_batch
        from odb_core.torch.loader import ODBDataLoader

        recipe = RECIPES[name]
        kw: dict[str, Any] = {"token_budget": self.budget, "seed": data_seed, **self.odb_kw}
        if recipe.max_samples_fixed_batch:
            kw["max_samples"] = self.fixed_batch
        if recipe.parity:
            assert self.profile is not None
            kw["token_budget"] = self.max_len
            kw["tokens_per_update"] = match_fixed_batch(
                self.profile, batch_size=self.fixed_batch, world_size=self.world
            )
        return ODBDataLoader(
            self.ds, cost_model=recipe.cost_model, collate_fn=self.wl.collate(recipe.packed), **kw
        )

    def init_for(self, rep: int) -> dict[str, Any]:
        """The model state every strategy of repeat `rep` starts from."""
        if not self.quality:
            return dict(self.init_state)
        state: dict[str, Any] = self.wl.model(self.seed + rep).state_dict()
        if self.pre_ds is None:
            return state
        self._pretrain(state, rep)
        trained: dict[str, Any] = copy.deepcopy(self.ddp.module.state_dict())
        return trained

    def _pretrain(self, state: dict[str, Any], rep: int) -> None:
        """One epoch from `state` on the fine-tuning regime's other distribution."""
        import torch.nn.functional as F
        from torch.utils.data import DataLoader, DistributedSampler

        assert self.pre_ds is not None
        ddp = self.ddp
        ddp.module.load_state_dict(state)
        pre_sampler: DistributedSampler[Any] = DistributedSampler(
            self.pre_ds, shuffle=True, seed=self.seed + rep
        )
        pre = DataLoader(
            self.pre_ds,
            batch_size=self.fixed_batch,
            sampler=pre_sampler,
            collate_fn=self.wl.pretrain_collate(),
        )
        opt = torch.optim.AdamW(ddp.parameters(), lr=self.params["lr"])
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

    def held_out_loss(self) -> float:
        """The held-out loss per token, over every rank's share (an all-reduce)."""
        import torch.distributed as dist
        import torch.nn.functional as F

        ddp, held_out, world = self.ddp, self.held_out, self.world
        ddp.module.eval()
        total = torch.zeros(2, dtype=torch.float64)
        mine = list(range(self.rank, len(held_out), world))
        chunk: list[dict[str, Any]] = []
        used = 0
        with torch.no_grad():
            for i in [*mine, None]:
                s = held_out[i] if i is not None else None
                if s is not None and used + len(s["input_ids"]) <= max(self.budget, self.max_len):
                    chunk.append(s)
                    used += len(s["input_ids"])
                    continue
                if chunk:
                    b = self.wl.eval_batch(chunk)
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
