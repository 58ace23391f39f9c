"""Recorded protocol traces of real runs, and their validation against the model.

A `TracingRankMachine` logs every protocol event of one rank together with what
the rank decided (its all-gather vector, the ids of each emitted step). A trace
is the per-rank logs plus the protocol config: the vectors carry each offered
batch's samples, cost tokens and loss tokens, and each Receive the optimizer
window boundaries (`sync`). `validate_trace` linearises the
per-rank logs (ranks only interact through the all-gather, so any interleaving
that respects each rank's order and the rendezvous is a valid one), replays it
through `GlobalModel`, checks every action was enabled, every recorded decision
equals the model's, and every invariant holds (the etcd-raft habit of trace
validation). The same linearised action sequence can be handed to TLC.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from odb_core.config import Mode, ProtocolConfig
from odb_core.cost import AttentionAware, Budget, CostModel, Multimodal, PackedTokens, PaddedTokens
from odb_core.errors import ConfigError
from odb_core.protocol import Contribution, RankMachine, RoundResult, StepInfo
from odb_core.sample import Sample
from odb_core.verify.invariants import INVARIANTS
from odb_core.verify.model import Action, GlobalModel, GlobalState, ModelConfig
from odb_core.window import WindowBuffer

#: 2: the all-gather vector carries loss tokens (2 + 3M integers), Receives `sync`.
#: 3: each rank's epoch plan, each Receive's per-step global counts (`global`), and
#: the loss scale of every step the training loop received (`scales`).
TRACE_VERSION = 3


def cost_model_to_dict(model: CostModel) -> dict[str, Any]:
    out: dict[str, Any] = {"name": model.name}
    if isinstance(model, AttentionAware):
        out["alpha"] = model.alpha
    if isinstance(model, Multimodal):
        out["visual_weight"] = model.visual_weight
    return out


def cost_model_from_dict(d: dict[str, Any]) -> CostModel:
    name = d.get("name")
    if name == "packed":
        return PackedTokens()
    if name == "padded":
        return PaddedTokens()
    if name == "attention":
        return AttentionAware(float(d.get("alpha", 1.0 / 4096)))
    if name == "multimodal":
        return Multimodal(float(d.get("visual_weight", 1.0)))
    raise ConfigError(f"unknown cost model {name!r} in trace")


def protocol_to_dict(cfg: ProtocolConfig) -> dict[str, Any]:
    out = cfg.describe()
    out["cost_model"] = cost_model_to_dict(cfg.cost_model)
    if cfg.carried:
        out["carried"] = sorted(cfg.carried)
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
     "done": bool}.
    `plan`: the ids this rank must see this epoch (its shard, resume exclusions
    removed), or None when the driver does not know it (a stream): every planned
    id must be observed, except those a quota close carries unread. `scales`: the
    loss scale of each step the training loop received, in step order, or None
    when the driver does not record them.
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

    def observe(self, sample: Sample) -> None:
        super().observe(sample)
        self.trace.events.append({"action": "Observe", "sample": list(sample)})

    def exhaust(self) -> None:
        super().exhaust()
        self.trace.events.append({"action": "Exhaust"})

    def form(self) -> list[Any]:
        batches = super().form()
        self.trace.events.append({"action": "Form"})
        return batches

    def contribute(self) -> Contribution:
        c = super().contribute()
        vector = c.to_vector(self.config.max_steps_per_round)
        self.trace.events.append({"action": "Contribute", "vector": vector})
        return c

    def all_gather(self, contributions: Sequence[Contribution]) -> RoundResult:
        result = super().all_gather(contributions)
        self.trace.events.append(
            {
                "action": "Receive",
                "steps": [None if s.is_pad else list(s.sample_ids) for s in result.steps],
                "sync": [s.sync_gradients for s in result.steps],
                "global": [
                    [s.global_samples, s.global_tokens, s.global_loss_tokens] for s in result.steps
                ],
                "done": result.done,
            }
        )
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


@dataclass
class TraceReport:
    ok: bool
    actions: list[str]
    reason: str = ""
    model: ModelConfig | None = None
    id_map: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "actions": len(self.actions), "reason": self.reason}


def trace_model(trace: ProtocolTrace) -> tuple[ModelConfig, dict[int, int]]:
    """The model config a trace runs in: each rank's shard is what it observed.
    Sample ids are renumbered 0..N-1 (in id order) as the model requires."""
    protocol = protocol_from_dict(trace.protocol)
    if [r.rank for r in trace.ranks] != list(range(protocol.world_size)):
        raise ConfigError(
            f"trace has ranks {[r.rank for r in trace.ranks]} for world size {protocol.world_size}"
        )
    observed = [
        [Sample(*e["sample"]) for e in r.events if e["action"] == "Observe"] for r in trace.ranks
    ]
    ids = sorted(s.id for shard in observed for s in shard)
    if len(set(ids)) != len(ids):
        raise ConfigError("trace observes some sample id on two ranks or twice")
    # A planned id the rank never observed is still in its source: the model (and
    # the spec) hold it pending, so the trace is a behaviour only if the epoch may
    # end without reading it (a quota close carries it); its cost is never read.
    unread: list[list[Sample]] = []
    for r, (rt, shard) in enumerate(zip(trace.ranks, observed, strict=True)):
        if rt.plan is None:
            unread.append([])
            continue
        seen = {s.id for s in shard}
        outside = sorted(seen - set(rt.plan))
        if outside or len(set(rt.plan)) != len(rt.plan):
            raise ConfigError(
                f"rank {r} observed ids outside its epoch plan {outside[:10]}, or its plan "
                "lists an id twice"
            )
        unread.append([Sample(i, 1) for i in rt.plan if i not in seen])
    ids += [s.id for shard in unread for s in shard]
    if len(set(ids)) != len(ids):
        raise ConfigError("the ranks' epoch plans overlap")
    id_map = {old: new for new, old in enumerate(sorted(ids))}
    shards = tuple(
        tuple(s._replace(id=id_map[s.id]) for s in (*shard, *extra))
        for shard, extra in zip(observed, unread, strict=True)
    )
    if protocol.carried:  # carried ids are named like the samples: renumber them too
        carried = frozenset(id_map[i] for i in protocol.carried if i in id_map)
        protocol = replace(protocol, carried=carried)
    return ModelConfig(protocol, shards), id_map


def plan_gaps(trace: ProtocolTrace) -> dict[int, list[int]]:
    """Per rank, the ids of its epoch plan it never observed."""
    gaps: dict[int, list[int]] = {}
    for rt in trace.ranks:
        seen = {e["sample"][0] for e in rt.events if e["action"] == "Observe"}
        missing = [i for i in rt.plan or () if i not in seen]
        if missing:
            gaps[rt.rank] = missing
    return gaps


def scale_mismatch(trace: ProtocolTrace) -> str:
    """Whether each rank's recorded loss scales (what its training loop received)
    are the decided ones: its recorded steps, window boundaries and per-step global
    counts (validated against the model or the spec) put through `WindowBuffer`,
    which every driver releases steps by. Empty when they agree or were not recorded."""
    protocol = protocol_from_dict(trace.protocol)
    for rt in trace.ranks:
        if rt.scales is None:
            continue
        samples = {
            int(e["sample"][0]): Sample(*e["sample"]) for e in rt.events if e["action"] == "Observe"
        }
        buffer, decided, step, window = WindowBuffer(protocol), [], 0, 0
        for e in rt.events:
            if e["action"] != "Receive":
                continue
            if e.get("global") is None or e.get("sync") is None:
                return f"rank {rt.rank} recorded loss scales but not the counts they come from"
            infos = []
            for t, ids in enumerate(e["steps"]):
                batch = [samples[int(i)] for i in ids or ()]
                g = e["global"][t]
                infos.append(
                    StepInfo(
                        step, rt.rank, 0, ids is None, None,
                        len(batch), int(g[0]), sum(s.tokens for s in batch), int(g[1]),
                        sum(s.loss for s in batch), int(g[2]), window, bool(e["sync"][t]),
                    )
                )  # fmt: skip
                step += 1
                window += bool(e["sync"][t])
            decided += [s.loss_scale for s in buffer.push_steps(infos, done=bool(e["done"]))]
        if len(rt.scales) != len(decided):
            return (
                f"rank {rt.rank}: the training loop received {len(rt.scales)} steps, but "
                f"{len(decided)} were decided"
            )
        for k, (got, want) in enumerate(zip(rt.scales, decided, strict=True)):
            if got != want:
                return (
                    f"rank {rt.rank}: the training loop received loss scale {got} at step {k}, "
                    f"but the decided scale is {want}"
                )
    return ""


def validate_trace(trace: ProtocolTrace) -> TraceReport:
    """Replay a recorded trace through the model; see the module docstring."""
    try:
        cfg, id_map = trace_model(trace)
    except (ConfigError, KeyError, TypeError) as exc:
        return TraceReport(False, [], f"malformed trace: {exc}")
    model = GlobalModel(cfg)
    state = model.init()
    cursors = [0] * cfg.protocol.world_size
    labels: list[str] = []

    def fail(reason: str) -> TraceReport:
        return TraceReport(False, labels, reason, cfg, id_map)

    gaps = plan_gaps(trace)
    if gaps and cfg.protocol.mode is Mode.JOIN:
        r, missing = next(iter(gaps.items()))
        return fail(
            f"rank {r} never observed ids {missing[:10]} of its epoch plan: the run does not "
            "cover the epoch (a sampler or dataset dropped samples)"
        )

    while True:
        progressed = False
        for r, rt in enumerate(trace.ranks):
            while cursors[r] < len(rt.events):
                event = rt.events[cursors[r]]
                action = _action(event, r, id_map)
                if action not in model.enabled(state):
                    break
                before = state
                state = model.step(state, action)
                mismatch = _decision_mismatch(event, before, state, r, cfg, id_map)
                if mismatch:
                    labels.append(action.label)
                    return fail(f"{action.label} (event {cursors[r]} of rank {r}): {mismatch}")
                labels.append(action.label)
                cursors[r] += 1
                progressed = True
                broken = _first_violation(state, cfg)
                if broken:
                    return fail(f"after {action.label}: {broken}")
        if all(c == len(rt.events) for c, rt in zip(cursors, trace.ranks, strict=True)):
            break
        if not progressed:
            gather = Action("AllGather")
            if gather in model.enabled(state):
                state = model.step(state, gather)
                labels.append(gather.label)
                continue
            stuck = [
                f"rank {r}: {rt.events[cursors[r]]['action']} (event {cursors[r]})"
                for r, rt in enumerate(trace.ranks)
                if cursors[r] < len(rt.events)
            ]
            return fail("no recorded event is enabled: " + "; ".join(stuck))
    if not state.all_done:
        return fail("trace ends before every rank finished the epoch")
    wrong_scale = scale_mismatch(trace)
    if wrong_scale:
        return fail(wrong_scale)
    return TraceReport(True, labels, "", cfg, id_map)


def _action(event: dict[str, Any], rank: int, id_map: dict[int, int]) -> Action:
    name = event.get("action")
    if name == "Observe":
        return Action("Observe", rank, id_map[int(event["sample"][0])])
    if name in ("Exhaust", "Form", "Contribute", "Receive"):
        return Action(str(name), rank)
    raise ConfigError(f"unknown trace action {name!r}")


def _decision_mismatch(
    event: dict[str, Any],
    before: GlobalState,
    after: GlobalState,
    r: int,
    cfg: ModelConfig,
    id_map: dict[int, int],
) -> str:
    name = event["action"]
    if name == "Contribute":
        c = after.ranks[r].contribution
        assert c is not None
        model_vector = c.to_vector(cfg.protocol.max_steps_per_round)
        if list(event["vector"]) != model_vector:
            return f"recorded vector {event['vector']} but the model contributes {model_vector}"
    if name == "Receive":
        delta = [a - b for a, b in zip(after.delivered, before.delivered, strict=True)]
        recorded = [i for step in event["steps"] if step is not None for i in step]
        model_ids = sorted(i for i, d in enumerate(delta) for _ in range(d))
        unknown = [i for i in recorded if i not in id_map]
        if unknown:
            return f"recorded steps emit ids no rank observed: {unknown[:10]}"
        if sorted(id_map[i] for i in recorded) != model_ids:
            return "recorded steps emit different samples than the model"
        n_steps = after.ranks[r].steps - before.ranks[r].steps
        if n_steps != len(event["steps"]):
            return f"recorded {len(event['steps'])} steps but the model runs {n_steps}"
        pads = after.ranks[r].pads - before.ranks[r].pads
        if pads != sum(1 for s in event["steps"] if s is None):
            return "recorded pad steps differ from the model's"
        sync = event.get("sync")
        if sync is not None:
            ends = {w.end for w in after.ranks[r].windows}
            base = before.ranks[r].steps
            model_sync = [base + t + 1 in ends for t in range(n_steps)]
            if [bool(x) for x in sync] != model_sync:
                return (
                    f"recorded optimizer-window boundaries {sync} but the model closes "
                    f"windows at {model_sync}"
                )
        recorded_counts = event.get("global")
        if recorded_counts is not None:
            counts = after.step_counts[r][len(before.step_counts[r]) :]
            if [tuple(int(x) for x in c) for c in recorded_counts] != list(counts):
                return (
                    f"recorded per-step global counts {recorded_counts} but the model decides "
                    f"{[list(c) for c in counts]}"
                )
        if bool(event["done"]) != (after.ranks[r].phase.value == "done"):
            return "recorded end of epoch differs from the model's"
    return ""


def _first_violation(state: GlobalState, cfg: ModelConfig) -> str:
    for name, inv in INVARIANTS.items():
        reason = inv(state, cfg)
        if reason is not None:
            return f"{name}: {reason}"
    return ""
