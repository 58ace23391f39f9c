"""Recording a rank's protocol events: the trace a real run leaves behind.

A `TracingRankMachine` logs every protocol event of one rank together with what
the rank decided (its all-gather vector, the ids of each emitted step); a
`ProtocolTrace` is the per-rank logs plus the protocol config, as plain JSON.
Recording is part of the runtime (`ODBDataLoader(trace_dir=...)` writes one file
per rank and epoch); validating a trace against the model or the spec is
verification's job (`odb_core.verify.trace_validation.validate_trace`,
`odb_core.verify.tlc.validate_trace_tlc`). The only I/O here is writing and
reading a trace file when asked to.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from odb_core.collective import Contribution
from odb_core.config import ProtocolConfig, make_cost_model
from odb_core.cost import AttentionAware, Budget, CostModel, Multimodal
from odb_core.errors import ConfigError
from odb_core.protocol import RankMachine, RoundResult
from odb_core.sample import Sample
from odb_core.step import StepInfo

#: 2: the all-gather vector carries loss tokens (2 + 3M integers), Receives `sync`.
#: 3: each rank's epoch plan, each Receive's per-step global counts (`global`), and
#: the loss scale of every step the training loop received (`scales`).
#: Dynamic sharding (`sharding='dynamic'`) adds, within version 3, the protocol's
#: epoch `plan`, the vector's held tail (unread, held, held work) and each Receive's
#: `dealt` ids; static-sharding traces are unchanged by it.
TRACE_VERSION = 3


def cost_model_to_dict(model: CostModel) -> dict[str, Any]:
    out: dict[str, Any] = {"name": model.name}
    if isinstance(model, AttentionAware):
        out["alpha"] = model.alpha
    if isinstance(model, Multimodal):
        out["visual_weight"] = model.visual_weight
    return out


def cost_model_from_dict(d: dict[str, Any]) -> CostModel:
    """The cost model `cost_model_to_dict` wrote; an unknown name raises ConfigError."""
    kind: Any = d.get("name")
    return make_cost_model(
        kind,
        alpha=float(d.get("alpha", 1.0 / 4096)),
        visual_weight=float(d.get("visual_weight", 1.0)),
    )


def protocol_to_dict(cfg: ProtocolConfig) -> dict[str, Any]:
    out = cfg.describe()
    out["cost_model"] = cost_model_to_dict(cfg.cost_model)
    if cfg.dynamic:  # the epoch's plan: every rank deals from it (not in describe())
        out["plan"] = list(cfg.plan)
    if cfg.carried:
        out["carried"] = sorted(cfg.carried)
    if cfg.window_bytes is not None:
        out["window_bytes"] = cfg.window_bytes
    return out


def protocol_from_dict(d: dict[str, Any]) -> ProtocolConfig:
    return ProtocolConfig(
        world_size=int(d["world_size"]),
        budget=Budget(d["budget_tokens"], d.get("max_samples"), d.get("max_patches")),
        cost_model=cost_model_from_dict(d["cost_model"]),
        buffer_size=int(d["buffer_size"]),
        mode=d["mode"],
        former=d["former"],
        oversize=d["oversize"],
        max_steps_per_round=int(d["max_steps_per_round"]),
        quota=d.get("quota"),
        deterministic=bool(d.get("deterministic", False)),
        loss_normalization=d.get("loss_normalization", "tokens"),
        grad_accum_steps=d.get("grad_accum_steps"),
        tokens_per_update=d.get("tokens_per_update"),
        carried=frozenset(int(i) for i in d.get("carried", ())),
        early_form=d.get("early_form"),
        window_bytes=d.get("window_bytes"),
        sharding=d.get("sharding", "static"),
        plan=tuple(int(i) for i in d.get("plan", ())),
        assign_target=d.get("assign_target"),
    )


@dataclass
class RankTrace:
    """The events of one rank, in its own order. Each event is a plain dict:
    {"action": "Observe", "sample": [id, tokens, visual_tokens, patches, loss_tokens]},
    {"action": "Exhaust"}, {"action": "Form"},
    {"action": "Contribute", "vector": [...]} (`Contribution.to_vector`: offered,
    final, then samples, cost tokens and loss tokens of each offered batch),
    {"action": "Receive", "steps": [[ids...] | null (pad), ...],
     "sync": [bool, ...] (an optimizer window closed at the step),
     "global": [[samples, cost tokens, loss tokens], ...] (each step's global counts),
     "dealt": [ids...] (dynamic sharding only: the plan ids the round's deal gave
     this rank, in plan order), "done": bool}.
    With dynamic sharding the vector ends with the held tail (`Contribution.
    to_vector(M, dynamic=True)`: unread, held, held work).
    `plan`: the ids this rank must see this epoch (its shard, resume exclusions
    removed), or None when the driver does not know it (a stream, or dynamic
    sharding: the epoch's plan is the protocol's `plan`, dealt as the run goes):
    every planned id must be observed, except those a quota close carries
    unread. `scales`: the loss scale of each step the training loop received, in
    step order, or None when the driver does not record them.
    A 4-field sample (no loss_tokens: every text token counts) and a Receive
    without `sync` or `global` (not checked) are accepted."""

    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    plan: list[int] | None = None
    scales: list[float] | None = None


class TracingRankMachine(RankMachine):
    """A RankMachine that records its events; behaviour is unchanged."""

    def __init__(
        self, rank: int, config: ProtocolConfig, plan: Iterable[int] | None = None
    ) -> None:
        super().__init__(rank, config)
        self.trace = RankTrace(rank, plan=None if plan is None else [int(i) for i in plan])

    def received(self, steps: Iterable[StepInfo]) -> None:
        """Record the final steps handed to the training loop (their loss scales)."""
        if self.trace.scales is None:
            self.trace.scales = []
        self.trace.scales.extend(float(s.loss_scale) for s in steps)

    def observe(self, sample: Sample, nbytes: int = 0) -> None:
        super().observe(sample, nbytes)
        self.trace.events.append({"action": "Observe", "sample": list(sample)})

    def exhaust(self) -> None:
        super().exhaust()
        self.trace.events.append({"action": "Exhaust"})

    def form(self) -> list[Any]:
        batches = super().form()
        self.trace.events.append({"action": "Form"})
        return batches

    def form_early(self) -> list[Any]:
        batches = super().form_early()
        self.trace.events.append({"action": "FormEarly"})
        return batches

    def contribute(self) -> Contribution:
        c = super().contribute()
        vector = c.to_vector(self.config.max_steps_per_round, self.config.dynamic)
        self.trace.events.append({"action": "Contribute", "vector": vector})
        return c

    def all_gather(self, contributions: Sequence[Contribution]) -> RoundResult:
        unread = set(self.queue) if self.config.dynamic else set()
        result = super().all_gather(contributions)
        event: dict[str, Any] = {
            "action": "Receive",
            "steps": [None if s.is_pad else list(s.sample_ids) for s in result.steps],
            "sync": [s.sync_gradients for s in result.steps],
            "global": [
                [s.global_samples, s.global_tokens, s.global_loss_tokens] for s in result.steps
            ],
            "done": result.done,
        }
        if self.config.dynamic:
            event["dealt"] = [i for i in self.queue if i not in unread]
        self.trace.events.append(event)
        return result


@dataclass
class ProtocolTrace:
    protocol: dict[str, Any]
    ranks: list[RankTrace]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": TRACE_VERSION,
            "protocol": self.protocol,
            "ranks": [
                {"rank": r.rank, "events": r.events, "plan": r.plan, "scales": r.scales}
                for r in self.ranks
            ],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> ProtocolTrace:
        if d.get("version") != TRACE_VERSION:
            raise ConfigError(
                f"trace version {d.get('version')!r}, expected {TRACE_VERSION}: version 2 "
                "traces carry no epoch plan, per-step global counts or loss scales, and "
                "version 1 traces no loss tokens in the all-gather vector; record the run "
                "again with this odb-core"
            )
        ranks = [
            RankTrace(
                int(r["rank"]),
                list(r["events"]),
                None if r.get("plan") is None else [int(i) for i in r["plan"]],
                None if r.get("scales") is None else [float(x) for x in r["scales"]],
            )
            for r in d["ranks"]
        ]
        return ProtocolTrace(dict(d["protocol"]), sorted(ranks, key=lambda r: r.rank))

    @staticmethod
    def from_machines(machines: Iterable[TracingRankMachine]) -> ProtocolTrace:
        ms = sorted(machines, key=lambda m: m.rank)
        if not ms:
            raise ConfigError("a trace needs at least one rank")
        if ms[0].config.dynamic:
            # No rank has a plan of its own: the protocol's plan is dealt as the run
            # goes (a driver may have set a rank's first share here).
            return ProtocolTrace(
                protocol_to_dict(ms[0].config),
                [RankTrace(m.trace.rank, m.trace.events, None, m.trace.scales) for m in ms],
            )
        return ProtocolTrace(protocol_to_dict(ms[0].config), [m.trace for m in ms])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))

    @staticmethod
    def load(path: str | Path) -> ProtocolTrace:
        return ProtocolTrace.from_json(json.loads(Path(path).read_text()))

    @staticmethod
    def merge(paths: Iterable[str | Path]) -> ProtocolTrace:
        """Merge per-rank trace files (each holding one or more ranks) of one run."""
        parts = [ProtocolTrace.load(p) for p in paths]
        if not parts:
            raise ConfigError("no trace files to merge")
        if any(p.protocol != parts[0].protocol for p in parts):
            raise ConfigError("trace files come from runs with different protocol configs")
        return ProtocolTrace(parts[0].protocol, [r for p in parts for r in p.ranks])
