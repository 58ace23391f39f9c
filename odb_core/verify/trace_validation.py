"""Validating recorded protocol traces of real runs against the model.

Recording is the runtime's (`odb_core.trace`: a `TracingRankMachine` logs every
protocol event of one rank together with what the rank decided, its all-gather
vector and the ids of each emitted step; re-exported here). A trace
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

from dataclasses import dataclass, field, replace
from typing import Any

from odb_core.config import Mode, ProtocolConfig
from odb_core.errors import ConfigError
from odb_core.sample import Sample
from odb_core.step import StepInfo
from odb_core.trace import (
    TRACE_VERSION,
    ProtocolTrace,
    RankTrace,
    TracingRankMachine,
    cost_model_from_dict,
    cost_model_to_dict,
    protocol_from_dict,
    protocol_to_dict,
)
from odb_core.verify.invariants import INVARIANTS
from odb_core.verify.model import Action, GlobalModel, GlobalState, ModelConfig
from odb_core.window import WindowBuffer

__all__ = [
    "TRACE_VERSION",
    "ProtocolTrace",
    "RankTrace",
    "TraceReport",
    "TracingRankMachine",
    "cost_model_from_dict",
    "cost_model_to_dict",
    "plan_gaps",
    "protocol_from_dict",
    "protocol_to_dict",
    "scale_mismatch",
    "trace_model",
    "validate_trace",
]


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
    if protocol.dynamic:
        return _dynamic_trace_model(trace, protocol, observed)
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
    if protocol.window_bytes is not None and protocol.buffer_size > 1:
        # The trace records no sizes: a byte-bounded run is a behaviour of the spec
        # with EarlyForm = 1 (each byte-full form is a FormEarly it allows).
        protocol = replace(protocol, window_bytes=None, early_form=1)
    return ModelConfig(protocol, shards), id_map


def _dynamic_trace_model(
    trace: ProtocolTrace, protocol: ProtocolConfig, observed: list[list[Sample]]
) -> tuple[ModelConfig, dict[int, int]]:
    """`trace_model` of a dynamic-sharding run: the ids are the epoch's plan (the
    protocol's), renumbered 0..N-1 in id order with the plan's order kept; no rank
    owns a shard, so the shards are only the model's sample store (each id as its
    first observation records it, an id no rank observed costing 1, never read).
    Which rank may observe which id is the replay's to check, deal by deal: an id
    observed twice, or by a rank it was not dealt to, is rejected there
    (`TraceObservesDealt`), not here."""
    if not isinstance(trace.protocol.get("plan"), list):
        raise ConfigError(
            "a sharding='dynamic' trace without the epoch's plan (`protocol.plan`) cannot "
            "have its deals replayed; record the run again with this odb-core"
        )
    with_plan = [rt.rank for rt in trace.ranks if rt.plan is not None]
    if with_plan:
        raise ConfigError(
            f"ranks {with_plan} of a sharding='dynamic' trace carry an epoch plan of their "
            "own; with dynamic sharding the epoch's plan is the protocol's `plan`"
        )
    no_deal = [
        (rt.rank, k)
        for rt in trace.ranks
        for k, e in enumerate(rt.events)
        if e["action"] == "Receive" and e.get("dealt") is None
    ]
    if no_deal:
        r, k = no_deal[0]
        raise ConfigError(
            f"rank {r}'s Receive (event {k}) of a sharding='dynamic' trace records no `dealt` ids"
        )
    planned = set(protocol.plan)
    outside = sorted({s.id for shard in observed for s in shard} - planned)
    if outside:
        raise ConfigError(f"the ranks observed ids {outside[:10]} outside the epoch's plan")
    id_map = {old: new for new, old in enumerate(sorted(planned))}
    first: dict[int, tuple[int, Sample]] = {}
    for r, shard in enumerate(observed):
        for s in shard:
            first.setdefault(s.id, (r, s))
    shards: list[list[Sample]] = [[] for _ in range(protocol.world_size)]
    for i in sorted(planned):
        r, s = first.get(i, (0, Sample(i, 1)))
        shards[r].append(s._replace(id=id_map[i]))
    protocol = replace(
        protocol,
        plan=tuple(id_map[i] for i in protocol.plan),
        carried=frozenset(id_map[i] for i in protocol.carried if i in id_map),
    )
    return ModelConfig(protocol, tuple(tuple(s) for s in shards)), id_map


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

    original = {new: old for old, new in id_map.items()}
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
                if cfg.protocol.dynamic:
                    undealt = _undealt_event(event, r, cursors[r], state, cfg, id_map, original)
                    if undealt:
                        return fail(undealt)
                action = _action(event, r, id_map)
                if action not in model.enabled(state):
                    break
                before = state
                state = model.step(state, action)
                mismatch = _decision_mismatch(event, before, state, r, cfg, id_map, original)
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
    if name in ("Exhaust", "Form", "FormEarly", "Contribute", "Receive"):
        return Action(str(name), rank)
    raise ConfigError(f"unknown trace action {name!r}")


def _undealt_event(
    event: dict[str, Any],
    r: int,
    index: int,
    state: GlobalState,
    cfg: ModelConfig,
    id_map: dict[int, int],
    original: dict[int, int],
) -> str:
    """Dynamic sharding: the rank's next event reads its source beyond what it was
    dealt. Named as the trace module's invariants (`odb_core.verify.tlc.trace_check`),
    which TLC checks before the same event. Empty when it does not."""
    name = event.get("action")
    if name == "Observe":
        raw = int(event["sample"][0])
        i = id_map[raw]
        if i in state.pending[r]:
            return ""
        holders = [
            q
            for q, rs in enumerate(state.ranks)
            if i in state.pending[q]
            or any(s.id == i for s in rs.buffer)
            or any(i in b.ids for b in rs.ready)
            or any(i in batch for batch in state.step_batches[q])
        ]
        if holders:
            why = f"the deal gave it to rank {holders[0]}"
        else:
            why = "no deal gave it to any rank yet"
        return (
            f"TraceObservesDealt: rank {r} observes id {raw} (event {index}), which was "
            f"not dealt to it: {why}"
        )
    if name == "Exhaust":
        unread = sorted(original[i] for i in state.pending[r])
        left = len(cfg.protocol.plan) - state.ranks[r].cursor
        if unread or left:
            return (
                f"TraceExhaustsDealtOut: rank {r} exhausts its source (event {index}) with "
                f"{left} plan ids not dealt and dealt ids {unread[:10]} unread"
            )
    return ""


def _decision_mismatch(
    event: dict[str, Any],
    before: GlobalState,
    after: GlobalState,
    r: int,
    cfg: ModelConfig,
    id_map: dict[int, int],
    original: dict[int, int],
) -> str:
    name = event["action"]
    if name == "Contribute":
        c = after.ranks[r].contribution
        assert c is not None
        model_vector = c.to_vector(cfg.protocol.max_steps_per_round, cfg.protocol.dynamic)
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
        if cfg.protocol.dynamic:
            unread = set(before.ranks[r].queue)
            dealt = [original[i] for i in after.ranks[r].queue if i not in unread]
            if [int(i) for i in event["dealt"]] != dealt:
                return (
                    f"TraceDealMatches: recorded dealt ids {event['dealt']} but the round's "
                    f"deal gives rank {r} {dealt}"
                )
    return ""


def _first_violation(state: GlobalState, cfg: ModelConfig) -> str:
    for name, inv in INVARIANTS.items():
        reason = inv(state, cfg)
        if reason is not None:
            return f"{name}: {reason}"
    return ""
