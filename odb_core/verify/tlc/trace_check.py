"""Trace validation: a recorded run, replayed through the spec by TLC."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from odb_core.collective import Contribution
from odb_core.errors import ConfigError, ODBError
from odb_core.verify.model import ModelConfig
from odb_core.verify.tlc.install import SPEC_INVARIANTS, SpecUnsupported
from odb_core.verify.tlc.render import spec_constants, tla_value
from odb_core.verify.tlc.run import SHORT_RUN_JVM, TLCResult, run_tlc
from odb_core.verify.trace_validation import ProtocolTrace, TraceReport, scale_mismatch, trace_model

# ---------------------------------------------------------------------------
# Trace validation: a recorded run, replayed through the spec by TLC

TRACE_MODULE = "TraceDGAP"

_TRACE_DEFS = r"""NoVec == [offered |-> 0, final |-> FALSE, samples |-> <<>>, tokens |-> <<>>,
          loss_tokens |-> <<>>, unread |-> 0, held |-> 0, held_work |-> 0]
\* y: for each step of a Receive, whether an optimizer window closed at it
\* (its sync_gradients); yk: y was recorded (older traces lack it).
\* g: for each step, its global <<samples, cost tokens, loss tokens>>; gk: recorded.
\* dl: dynamic sharding, the plan ids the round's deal gave the rank; dk: recorded.
Ev(a, r, i, c, s, y, yk, g, gk, d, dl, dk) ==
    [a |-> a, r |-> r, i |-> i, c |-> c, s |-> s, y |-> y, yk |-> yk, g |-> g, gk |-> gk,
     d |-> d, dl |-> dl, dk |-> dk]
Obs(r, i) == Ev("Observe", r, i, NoVec, <<>>, <<>>, FALSE, <<>>, FALSE, FALSE, {}, FALSE)
Exh(r) == Ev("Exhaust", r, 0, NoVec, <<>>, <<>>, FALSE, <<>>, FALSE, FALSE, {}, FALSE)
Frm(r) == Ev("Form", r, 0, NoVec, <<>>, <<>>, FALSE, <<>>, FALSE, FALSE, {}, FALSE)
FrE(r) == Ev("FormEarly", r, 0, NoVec, <<>>, <<>>, FALSE, <<>>, FALSE, FALSE, {}, FALSE)
ConD(r, o, f, s, t, l, u, h, w) ==
    Ev("Contribute", r, 0,
       [offered |-> o, final |-> f, samples |-> s, tokens |-> t, loss_tokens |-> l,
        unread |-> u, held |-> h, held_work |-> w],
       <<>>, <<>>, FALSE, <<>>, FALSE, FALSE, {}, FALSE)
Con(r, o, f, s, t, l) == ConD(r, o, f, s, t, l, 0, 0, 0)
Gat == Ev("AllGather", 0, 0, NoVec, <<>>, <<>>, FALSE, <<>>, FALSE, FALSE, {}, FALSE)
Rcv(r, s, d) == Ev("Receive", r, 0, NoVec, s, <<>>, FALSE, <<>>, FALSE, d, {}, FALSE)
RcvW(r, s, y, d) == Ev("Receive", r, 0, NoVec, s, y, TRUE, <<>>, FALSE, d, {}, FALSE)
RcvG(r, s, y, g, d) == Ev("Receive", r, 0, NoVec, s, y, TRUE, g, TRUE, d, {}, FALSE)
RcvD(r, s, y, g, d, dl) == Ev("Receive", r, 0, NoVec, s, y, TRUE, g, TRUE, d, dl, TRUE)
"""

_TRACE_SPEC = r"""
\* Receive: the recorded steps are the spec's, batch by batch (a pad is {}),
\* the recorded window boundaries and per-step global counts (when recorded)
\* are the spec's, and the recorded end of epoch is the spec's.
Ends(r) == {windows'[r][i].end : i \in DOMAIN windows'[r]}
Emits(e) ==
    /\ steps'[e.r] = steps[e.r] + Len(e.s)
    /\ \A t \in 1 .. Len(e.s) :
        e.s[t] = IF t <= Len(ready[e.r]) THEN ready[e.r][t] ELSE {}
    /\ e.yk =>
        /\ Len(e.y) = Len(e.s)
        /\ \A t \in 1 .. Len(e.y) : e.y[t] = (steps[e.r] + t \in Ends(e.r))
    /\ e.gk =>
        /\ Len(e.g) = Len(e.s)
        /\ \A t \in 1 .. Len(e.g) : step_counts'[e.r][steps[e.r] + t] = e.g[t]
    /\ (phase'[e.r] = "done") = e.d
    /\ e.dk => pending'[e.r] \ pending[e.r] = e.dl

TraceStep(e) ==
    CASE e.a = "Observe" -> Observe(e.r, e.i)
      [] e.a = "Exhaust" -> Exhaust(e.r)
      [] e.a = "Form" -> Form(e.r)
      [] e.a = "FormEarly" -> FormEarly(e.r)
      [] e.a = "Contribute" -> Contribute(e.r) /\ contribution'[e.r] = e.c
      [] e.a = "AllGather" -> AllGather
      [] e.a = "Receive" -> Receive(e.r) /\ Emits(e)

\* Dynamic sharding: the next event of the log reads no further than the deals
\* (checked in the state before it, so TLC names the event; the Python replay
\* checks the same under the same names, odb_core.verify.trace_validation).
NextEv == Log[pc + 1]
NextIs(a) == Dynamic /\ pc < Len(Log) /\ NextEv.a = a
\* A rank observes only an id dealt to it and not yet observed.
TraceObservesDealt == NextIs("Observe") => NextEv.i \in pending[NextEv.r]
\* A rank finds its source dry only when it read all it was dealt and the plan
\* is dealt out.
TraceExhaustsDealtOut ==
    NextIs("Exhaust") => pending[NextEv.r] = {} /\ cursor[NextEv.r] = Len(Plan)
\* The ids a rank records as dealt are its slice of the round's Deal.
TraceDealMatches ==
    (NextIs("Receive") /\ NextEv.dk /\ inbox[NextEv.r] # NoValue)
        => NextEv.dl = InboxSlice(NextEv.r)

TraceInit == Init /\ pc = 0
TraceNext == pc < Len(Log) /\ TraceStep(Log[pc + 1]) /\ pc' = pc + 1
\* The only way to stop without a deadlock: the whole log replayed, epoch over.
TraceEnd == pc = Len(Log) /\ AllDone /\ UNCHANGED <<vars, pc>>
TraceNextOrEnd == TraceNext \/ TraceEnd
"""


@dataclass(frozen=True)
class TraceEvent:
    """One event of the linearised trace: rank (None for AllGather), its index in
    the rank's log, the event, and its model action label."""

    rank: int | None
    index: int
    event: dict[str, Any]
    label: str


def linearize(ranks: Sequence[Sequence[dict[str, Any]]]) -> list[tuple[int | None, int]]:
    """A total order of per-rank logs that respects each rank's order and the
    rendezvous: each rank up to its next Contribute, then AllGather, then each
    rank up to its next Receive, and again. Ranks interact only through the
    all-gather, so a legal trace is legal in this order. Returns (rank, index)
    pairs; (None, -1) is an AllGather."""
    cursors = [0] * len(ranks)
    order: list[tuple[int | None, int]] = []

    def run_until(r: int, action: str) -> bool:
        events = ranks[r]
        moved = False
        while cursors[r] < len(events):
            name = events[cursors[r]].get("action")
            order.append((r, cursors[r]))
            cursors[r] += 1
            moved = True
            if name == action:
                break
        return moved

    while any(c < len(e) for c, e in zip(cursors, ranks, strict=True)):
        before = list(cursors)
        for r in range(len(ranks)):
            run_until(r, "Contribute")
        contributed = any(
            cursors[r] > before[r] and ranks[r][cursors[r] - 1].get("action") == "Contribute"
            for r in range(len(ranks))
        )
        if contributed:
            order.append((None, -1))
        for r in range(len(ranks)):
            run_until(r, "Receive")
        if cursors == before:
            break
    return order


#: The trace module's own invariants (dynamic sharding), checked before each event;
#: the Python replay rejects the same events under the same names.
TRACE_INVARIANTS: dict[str, str] = {
    "TraceObservesDealt": "observes an id that was not dealt to its rank",
    "TraceExhaustsDealtOut": "finds the source dry with dealt ids unread or plan ids not dealt",
    "TraceDealMatches": "records dealt ids other than its slice of the round's deal",
}


def _trace_log(
    trace: Any, id_map: Mapping[int, int], max_steps: int, dynamic: bool = False
) -> tuple[list[TraceEvent], list[str]]:
    """The linearised events and their TLA+ literals."""
    fresh = max(id_map.values(), default=-1) + 1
    unknown: dict[int, int] = {}

    def sid(raw: Any) -> int:
        i = int(raw)
        if i in id_map:
            return id_map[i]
        return unknown.setdefault(i, fresh + len(unknown))  # no such sample: TLC rejects

    logs = [rt.events for rt in trace.ranks]
    events: list[TraceEvent] = []
    literals: list[str] = []
    for r, idx in linearize(logs):
        if r is None:
            events.append(TraceEvent(None, -1, {"action": "AllGather"}, "AllGather"))
            literals.append("Gat")
            continue
        e = logs[r][idx]
        name = e.get("action")
        if name == "Observe":
            i = sid(e["sample"][0])
            events.append(TraceEvent(r, idx, e, f"Observe({r},{i})"))
            literals.append(f"Obs({r}, {i})")
            continue
        events.append(TraceEvent(r, idx, e, f"{name}({r})"))
        if name == "Exhaust":
            literals.append(f"Exh({r})")
        elif name == "Form":
            literals.append(f"Frm({r})")
        elif name == "FormEarly":
            literals.append(f"FrE({r})")
        elif name == "Contribute":
            c = Contribution.from_vector(e["vector"], max_steps, dynamic)
            head = (
                f"{r}, {c.offered}, {tla_value(c.final)}, {tla_value(c.samples)}, "
                f"{tla_value(c.tokens)}, {tla_value(c.loss_tokens)}"
            )
            if dynamic:
                literals.append(f"ConD({head}, {c.unread}, {c.held}, {c.held_work})")
            else:
                literals.append(f"Con({head})")
        elif name == "Receive":
            steps = [set() if s is None else {sid(i) for i in s} for s in e["steps"]]
            seq, done = _tla_seq_of_sets(steps), tla_value(bool(e["done"]))
            if dynamic:  # trace_model requires dealt ids; sync and global come with them
                sync = tla_value([bool(x) for x in e["sync"]])
                counts = tla_value([[int(x) for x in c] for c in e["global"]])
                dealt = tla_value(frozenset(sid(i) for i in e["dealt"]))
                literals.append(f"RcvD({r}, {seq}, {sync}, {counts}, {done}, {dealt})")
            elif e.get("sync") is None:
                literals.append(f"Rcv({r}, {seq}, {done})")
            elif e.get("global") is None:
                sync = tla_value([bool(x) for x in e["sync"]])
                literals.append(f"RcvW({r}, {seq}, {sync}, {done})")
            else:
                sync = tla_value([bool(x) for x in e["sync"]])
                counts = tla_value([[int(x) for x in c] for c in e["global"]])
                literals.append(f"RcvG({r}, {seq}, {sync}, {counts}, {done})")
        else:
            raise ConfigError(f"unknown trace action {name!r} (rank {r}, event {idx})")
    return events, literals


def _tla_seq_of_sets(steps: Sequence[set[int]]) -> str:
    return "<<" + ", ".join(tla_value(frozenset(s)) for s in steps) + ">>"


def render_trace_module(cfg: ModelConfig, literals: Sequence[str]) -> tuple[str, str]:
    """TraceDGAP.tla/.cfg: DGAP constrained to follow the given event literals."""
    consts = spec_constants(cfg)
    header = (
        "\\* Generated by odb_core.verify.tlc: a recorded protocol trace, linearised; do not edit."
    )
    log = "Log == <<\n    " + ",\n    ".join(literals) + "\n>>" if literals else "Log == <<>>"
    tla = "\n".join(
        [
            f"---- MODULE {TRACE_MODULE} ----",
            header,
            "EXTENDS DGAP",
            "",
            "VARIABLE pc",
            "",
            *(f"MC{k} == {v}" for k, v in consts.definitions.items()),
            "",
            _TRACE_DEFS,
            log,
            _TRACE_SPEC,
            "====",
            "",
        ]
    )
    lines = [header, "CONSTANTS"]
    lines += [f"    {k} = {v}" for k, v in consts.scalars.items()]
    lines += [f"    {k} <- MC{k}" for k in consts.definitions]
    lines += ["INIT TraceInit", "NEXT TraceNextOrEnd", "INVARIANT"]
    lines += [f"    {i}" for i in SPEC_INVARIANTS]
    if cfg.protocol.dynamic:
        lines += [f"    {i}" for i in TRACE_INVARIANTS]
    return tla, "\n".join(lines) + "\n"


@dataclass
class TraceCheck:
    """TLC's verdict on a recorded trace."""

    ok: bool
    reason: str
    events: list[TraceEvent]
    tlc: TLCResult | None
    model: ModelConfig | None = None
    id_map: dict[int, int] = field(default_factory=dict)


def check_trace(trace: Any, *, timeout: float | None = 600) -> TraceCheck:
    """Replay a `trace.ProtocolTrace` through DGAP with TLC. The trace is accepted
    when TLC can take every event in order, each recorded decision (the vector,
    the steps, the end of the epoch) equals the spec's, every invariant holds and
    the epoch is over at the end."""
    try:
        cfg, id_map = trace_model(trace)
        p = cfg.protocol
        events, literals = _trace_log(trace, id_map, p.max_steps_per_round, p.dynamic)
        tla, cfg_text = render_trace_module(cfg, literals)
    except SpecUnsupported as exc:
        return TraceCheck(False, f"the spec does not model this run: {exc}", [], None)
    except (ODBError, KeyError, TypeError, ValueError, IndexError) as exc:
        return TraceCheck(False, f"malformed trace: {type(exc).__name__}: {exc}", [], None)
    res = run_tlc(
        TRACE_MODULE,
        {f"{TRACE_MODULE}.tla": tla, f"{TRACE_MODULE}.cfg": cfg_text},
        deadlock=True,
        timeout=timeout,
        java_opts=SHORT_RUN_JVM,
    )
    check = TraceCheck(False, "", events, res, cfg, dict(id_map))
    pc = None
    if res.trace:
        last = res.trace[-1].state.get("pc")
        pc = last if isinstance(last, int) else None
    if res.result == "ok":
        check.ok, check.reason = True, ""
    elif res.result == "deadlock" and pc is not None:
        if pc >= len(events):
            check.reason = "the trace ends before every rank finished the epoch"
        else:
            ev = events[pc]
            where = "AllGather" if ev.rank is None else f"rank {ev.rank}'s event {ev.index}"
            check.reason = (
                f"event {pc + 1} of {len(events)}, {ev.label} ({where}), is not a step of "
                "DGAP here: it is not enabled, or its recorded decision differs from the spec's"
            )
    elif res.result == "invariant" and res.violated in TRACE_INVARIANTS and pc is not None:
        ev = events[pc]  # checked before the event it names
        where = "AllGather" if ev.rank is None else f"rank {ev.rank}'s event {ev.index}"
        check.reason = (
            f"{res.violated}: event {pc + 1} of {len(events)}, {ev.label} ({where}), "
            f"{TRACE_INVARIANTS[res.violated]}"
        )
    elif res.result == "invariant":
        at = f" after event {pc} ({events[pc - 1].label})" if pc else ""
        check.reason = f"invariant {res.violated} is violated{at}"
    else:
        check.reason = f"TLC {res.result}: {res.message}"
    return check


def validate_trace_tlc(trace: ProtocolTrace, *, timeout: float | None = 600) -> TraceReport:
    """Replay a recorded trace through spec/DGAP.tla with the TLC model checker.

    The per-rank logs are linearised without the Python model (each rank up to
    its Contribute, AllGather, each rank up to its Receive, and so on) and inlined
    into a Trace module; TLC accepts the trace when every event is a step of the
    spec, every recorded decision equals the spec's, every invariant holds and the
    epoch ends with the log. Needs Java and tla2tools.jar (see odb_core.verify.tlc).
    """
    result = check_trace(trace, timeout=timeout)
    labels = [e.label for e in result.events]
    if result.ok:
        # TLC accepted the steps, window boundaries and global counts; the scales
        # the loop received are a function of those (WindowBuffer).
        wrong_scale = scale_mismatch(trace)
        if wrong_scale:
            return TraceReport(False, labels, wrong_scale, result.model, result.id_map)
    return TraceReport(result.ok, labels, result.reason, result.model, result.id_map)
