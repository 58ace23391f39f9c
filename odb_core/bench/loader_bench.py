"""The rank side of `odb bench`: a synthetic dataset, a trivially cheap model, and
timed epochs of a plain DataLoader and of ODBDataLoader on the same data.

Two ODB configurations run against `DataLoader(batch_size=8)`:
- `odb`: `max_samples=8` under a budget no batch reaches, so it takes the same
  steps with the same samples per step as the plain loader; the ratio of the two
  is the loader's own cost (the >= 0.95 target);
- `odb_memory`: the padded cost model with the budget set to the plain loader's
  largest padded batch (8 x its longest sample) in the epoch, i.e. the memory the
  plain loader needs; this is how a user sizes a token budget.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from odb_core.collective import Contribution
from odb_core.torch.loader import ODBDataLoader
from odb_core.torch.meta import scaled_loss

VOCAB = 512
BATCH = 8


class SyntheticText(Dataset[dict[str, torch.Tensor]]):
    """Map-style: sample i has a fixed log-normal length and costs `work_us` of CPU
    to produce (a stand-in for tokenisation and templating)."""

    def __init__(self, n: int, mean_len: int, work_us: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        sigma = 0.8
        mu = math.log(mean_len) - sigma * sigma / 2
        self.lengths = [
            max(1, min(8 * mean_len, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)
        ]
        self.work_s = work_us / 1e6

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        end = time.perf_counter() + self.work_s
        while time.perf_counter() < end:
            pass
        n = self.lengths[i]
        return {"input_ids": (torch.arange(n) * (i + 1)) % VOCAB}


def pad_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = [s["input_ids"] for s in samples]
    input_ids = nn.utils.rnn.pad_sequence(ids, batch_first=True)
    mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, s in enumerate(ids):
        mask[row, : len(s)] = True
    return {"input_ids": input_ids, "attention_mask": mask}


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pred = self.head(self.emb(input_ids)).squeeze(-1)
        m = attention_mask.float()
        loss: torch.Tensor = (((pred - 0.5) ** 2) * m).sum() / m.sum().clamp(min=1.0)
        return loss


def _epoch(loader: Any, model: nn.Module, opt: torch.optim.Optimizer, odb: bool) -> dict[str, Any]:
    dist.barrier()
    start = time.perf_counter()
    steps = samples = pads = 0
    ids: list[int] = []
    meta: list[tuple[int, int, int]] = []
    for batch in loader:
        loss = model(**batch)
        if odb:
            info = loader.step_info
            loss = scaled_loss(info, loss)
            samples += info.local_samples
            pads += info.is_pad
            ids.extend(info.sample_ids)
            meta.append((info.step, info.global_samples, info.global_tokens))
        else:
            samples += batch["input_ids"].shape[0]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
    wall = time.perf_counter() - start
    out: dict[str, Any] = {"wall": wall, "steps": steps, "samples": samples}
    if odb:
        es = loader.epoch_stats
        out.update(
            collective_stall=es.collective_stall_s,
            stall=es.stall_s,
            round_wait=list(es.round_wait_s),
            collectives=es.collectives,
            rounds=es.rounds,
            pads=pads,
            ids=ids,
            meta=meta,
        )
    return out


def run_rank(rank: int, world: int, params: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    ds = SyntheticText(params["samples"], params["mean_len"], params["work_us"])
    workers = params["workers"]
    ctx = params["start_method"] if workers > 0 else None
    common: dict[str, Any] = {
        "num_workers": workers,
        "collate_fn": pad_collate,
        "persistent_workers": workers > 0,
        "multiprocessing_context": ctx,
    }
    odb_kw = {**common, "peer_timeout": 60, "step_meta": False}  # model(**batch) as is
    sampler: DistributedSampler[dict[str, torch.Tensor]] = DistributedSampler(
        ds, shuffle=True, seed=0
    )
    plain: DataLoader[dict[str, torch.Tensor]] = DataLoader(
        ds, batch_size=BATCH, sampler=sampler, **common
    )
    odb = ODBDataLoader(
        ds, token_budget=BATCH * max(ds.lengths), max_samples=BATCH, shuffle=True, **odb_kw
    )
    odb_memory = ODBDataLoader(
        ds,
        token_budget=_peak_padded_batch(ds, sampler, world),
        cost_model="padded",
        buffer_size=256,  # a window of several batches of ~40 samples
        shuffle=True,
        **odb_kw,
    )
    model = DistributedDataParallel(TinyModel())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loaders: dict[str, Any] = {"plain": plain, "odb": odb, "odb_memory": odb_memory}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in loaders}
    latency = _allgather_latency(odb)
    ok = True
    for epoch in range(params["repeats"] + 1):  # epoch 0 warms workers up
        sampler.set_epoch(epoch)
        odb.set_epoch(epoch)
        odb_memory.set_epoch(epoch)
        for name, loader in loaders.items():
            r = _epoch(loader, model, opt, name != "plain")
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, r)
            if name != "plain":
                ok &= _consistent(gathered, len(ds))
            if epoch > 0:
                runs[name].append(_summarise(gathered, latency))
    result = _report(runs, ok)
    result["allgather_latency_us"] = round(latency * 1e6, 1)
    return result


def _allgather_latency(loader: ODBDataLoader, n: int = 200) -> float:
    """Seconds per all-gather of the loader's round vector on its gloo group, back to
    back on every rank (between epochs, so no protocol round is in flight)."""
    vector = [0] * Contribution.vector_length(loader.config.max_steps_per_round)
    dist.barrier()
    start = time.perf_counter()
    for i in range(n):
        loader.transport.start((0, 0, 0, i), vector).wait()
    elapsed = torch.tensor([(time.perf_counter() - start) / n])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _peak_padded_batch(ds: SyntheticText, sampler: Any, world: int) -> int:
    """The largest n x max_len among the plain loader's batches in the benched epochs,
    on any rank: the memory the plain loader must be able to hold."""
    peak = 0
    for epoch in range(8):
        sampler.set_epoch(epoch)
        idx = list(sampler)
        for start in range(0, len(idx), BATCH):
            chunk = idx[start : start + BATCH]
            peak = max(peak, len(chunk) * max(ds.lengths[i] for i in chunk))
    sampler.set_epoch(0)
    t = torch.tensor([peak])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _consistent(per_rank: list[dict[str, Any]], n: int) -> bool:
    steps = {r["steps"] for r in per_rank}
    metas = {tuple(r["meta"]) for r in per_rank}
    ids = sorted(i for r in per_rank for i in r["ids"])
    return len(steps) == 1 and len(metas) == 1 and ids == list(range(n))


def _summarise(per_rank: list[dict[str, Any]], latency_s: float) -> dict[str, Any]:
    wall = max(r["wall"] for r in per_rank)
    samples = sum(r["samples"] for r in per_rank)
    out = {"samples_per_s": samples / wall, "steps": per_rank[0]["steps"], "samples": samples}
    if "round_wait" in per_rank[0]:
        # The collectives' own cost, as if none of it overlapped training: rounds x the
        # latency of one all-gather on this group (measured back to back; the waits the
        # protocol thread sees also hold GIL hand-offs and slower peers' filling).
        out["collective_pct"] = 100.0 * per_rank[0]["rounds"] * latency_s / wall
        out["collective_stall_pct"] = max(
            100.0 * r["collective_stall"] / r["wall"] for r in per_rank
        )
        out["stall_pct"] = max(100.0 * r["stall"] / r["wall"] for r in per_rank)
        out["collectives_per_round"] = max(r["collectives"] / max(1, r["rounds"]) for r in per_rank)
        out["rounds"] = per_rank[0]["rounds"]
        out["pad_steps"] = sum(r["pads"] for r in per_rank)
    return out


def _report(runs: dict[str, list[dict[str, Any]]], ok: bool) -> dict[str, Any]:
    def med(name: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[name]))

    out: dict[str, Any] = {"ok": ok}
    for name in ("plain", "odb", "odb_memory"):
        steps = med(name, "steps")
        row: dict[str, Any] = {
            "samples_per_s": med(name, "samples_per_s"),
            "steps": int(steps),
            "samples_per_step": med(name, "samples") / max(1.0, steps),
            "runs_samples_per_s": [r["samples_per_s"] for r in runs[name]],
        }
        if name != "plain":
            row["collective_pct"] = med(name, "collective_pct")
            row["collective_stall_pct"] = med(name, "collective_stall_pct")
            row["stall_pct"] = med(name, "stall_pct")
            row["collectives_per_round"] = med(name, "collectives_per_round")
            row["rounds"] = int(med(name, "rounds"))
            row["pad_steps"] = int(med(name, "pad_steps"))
        out[name] = row
    out["ratio"] = out["odb"]["samples_per_s"] / out["plain"]["samples_per_s"]
    out["ratio_memory"] = out["odb_memory"]["samples_per_s"] / out["plain"]["samples_per_s"]
    return out
