"""Running TLC and reading its output: counts, depth, verdicts, counterexamples."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from odb_core.errors import ConfigError
from odb_core.verify.tlc.install import (
    EXIT_OK,
    EXIT_SPEC_PARSE,
    SPEC_MODULES,
    find_jar,
    find_java,
    spec_dir,
)
from odb_core.verify.tlc.values import parse_state, to_plain

# ---------------------------------------------------------------------------
# Running TLC and reading its output


@dataclass
class TraceState:
    """One state of a TLC counterexample and the action that led to it."""

    action: str
    state: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "state": {k: to_plain(v) for k, v in self.state.items()}}


@dataclass
class TLCResult:
    """What one TLC run found."""

    name: str
    exit_code: int
    result: str  # ok | deadlock | invariant | liveness | parse_error | error | timeout
    violated: str | None = None
    states_generated: int | None = None
    distinct_states: int | None = None
    depth: int | None = None
    elapsed_s: float = 0.0
    trace: list[TraceState] = field(default_factory=list)
    loop_to: int | None = None  # liveness: the lasso returns to this state (1-based)
    message: str = ""
    output: str = ""
    dot_path: Path | None = None

    @property
    def verdict(self) -> str:
        """`ok`, `deadlock`, `invariant:Name`, `liveness` etc.: what the manifest pins."""
        return f"{self.result}:{self.violated}" if self.violated else self.result

    def trace_labels(self) -> list[str]:
        return [t.action for t in self.trace]

    def to_json(self, *, with_trace: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "exit_code": self.exit_code,
            "result": self.verdict,
            "distinct_states": self.distinct_states,
            "states_generated": self.states_generated,
            "depth": self.depth,
            "elapsed_s": round(self.elapsed_s, 2),
        }
        if self.message:
            out["message"] = self.message
        if with_trace and self.trace:
            out["trace"] = [t.to_json() for t in self.trace]
            if self.loop_to is not None:
                out["loop_to"] = self.loop_to
        return out

    def format_trace(self, limit: int = 80) -> str:
        """A readable counterexample: the initial state in full, then each action
        with the variables it changed (per-rank entries by rank)."""
        lines: list[str] = []
        prev: dict[str, Any] | None = None
        for n, t in enumerate(self.trace[:limit], start=1):
            state = {k: to_plain(v) for k, v in _ordered(t.state).items()}
            if prev is None:
                lines.append(f"  {n:3}. {t.action}")
                lines.extend(f"         {k} = {json.dumps(v)}" for k, v in state.items())
            else:
                changes = _changes(prev, state)
                ranks = sorted({r for _, r, _, _ in changes if r is not None})
                who = f"({','.join(map(str, ranks))})" if len(ranks) == 1 else ""
                lines.append(f"  {n:3}. {t.action}{who}")
                for var, r, old, new in changes:
                    at = f"[{r}]" if r is not None else ""
                    lines.append(f"         {var}{at}: {json.dumps(old)} -> {json.dumps(new)}")
            prev = state
        if len(self.trace) > limit:
            lines.append(f"  ... {len(self.trace) - limit} more states")
        if self.loop_to is not None:
            lines.append(f"  (then back to state {self.loop_to}: the behaviour loops forever)")
        return "\n".join(lines)


_VAR_ORDER = (
    *("phase", "exhausted", "buffer", "ready", "steps", "pads", "round", "emitted"),
    *("contribution", "window_loss", "window_local", "windows"),
    *("pending", "inbox", "delivered", "ledger", "step_batches", "step_counts", "pc"),
)


def _ordered(state: Mapping[str, Any]) -> dict[str, Any]:
    known = [k for k in _VAR_ORDER if k in state]
    return {k: state[k] for k in [*known, *sorted(set(state) - set(known))]}


def _changes(
    before: Mapping[str, Any], after: Mapping[str, Any]
) -> list[tuple[str, int | None, Any, Any]]:
    out: list[tuple[str, int | None, Any, Any]] = []
    for var, new in after.items():
        old = before.get(var)
        if old == new:
            continue
        per_rank = var not in ("delivered", "ledger", "pc")
        if per_rank and isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
            pairs = enumerate(zip(old, new, strict=True))
            out.extend((var, r, o, v) for r, (o, v) in pairs if o != v)
        else:
            out.append((var, None, old, new))
    return out


_STATES = re.compile(
    r"(\d+) states generated, (\d+) distinct states found, (\d+) states left on queue"
)
_DEPTH = re.compile(r"The depth of the complete state graph search is (\d+)")
_STATE_HEAD = re.compile(r"^(\d+): (?:<(Initial predicate|\S+)(?: line [^>]*)?>|(Stuttering))\s*$")
_BACK_TO = re.compile(r"^Back to state (\d+)")


def parse_output(name: str, exit_code: int, output: str) -> TLCResult:
    """Interpret TLC's plain-text output and exit code."""
    res = TLCResult(name, exit_code, "error", output=output)
    states = _STATES.findall(output)
    if states:
        gen, distinct, _ = states[-1]
        res.states_generated, res.distinct_states = int(gen), int(distinct)
    depth = _DEPTH.findall(output)
    if depth:
        res.depth = int(depth[-1])
    m_inv = re.search(r"Error: Invariant (\w+) is violated", output)
    if exit_code == EXIT_OK and "No error has been found" in output:
        res.result = "ok"
    elif m_inv:
        res.result, res.violated = "invariant", m_inv.group(1)
    elif "Error: Deadlock reached" in output:
        res.result = "deadlock"
    elif "Temporal properties were violated" in output:
        res.result = "liveness"
    elif exit_code == EXIT_SPEC_PARSE or _is_parse_error(output):
        # TLC 2.15 exits 150 on a spec it cannot parse, but 255 (an "unexpected
        # exception") on a .cfg it cannot parse.
        res.result = "parse_error"
        res.message = _parse_error_message(output)
    else:
        res.message = _error_message(output)
    res.trace, res.loop_to = _parse_trace(output)
    if res.result in ("invariant", "deadlock", "liveness") and res.trace:
        # TLC reports the BFS depth only for complete runs; for a violation pin
        # the length of the (shortest) counterexample instead.
        res.depth = len(res.trace)
    return res


def action_name(label: str) -> str:
    """`D!Exhaust` (an action of an instantiated module) -> `Exhaust`."""
    return label.rsplit("!", 1)[-1]


def _is_parse_error(output: str) -> bool:
    return any(
        s in output
        for s in (
            "***Parse Error***",
            "Semantic error",
            "Fatal errors while parsing",
            "Lexical error",
            "error in the configuration file",
        )
    )


_SEMANTIC = re.compile(r"line (\d+), col (\d+) to line \d+, col \d+ of module (\w+)\s*\n\s*\n?(.+)")


def _parse_error_message(output: str) -> str:
    """`FILE, line L, column C: what` for SANY syntax and semantic errors and
    for errors in the .cfg file."""
    found: list[str] = []
    m = re.search(r"Could not parse module \w+ from file (\S+)", output)
    syntax = re.search(r"\*\*\*Parse Error\*\*\*\s*\n((?:.+\n?)+)", output)
    if syntax:
        what = " ".join(ln.strip() for ln in syntax.group(1).splitlines() if ln.strip())
        at = re.search(r"at line (\d+), column (\d+)", what)
        file_ = m.group(1) if m else "?"
        where = f"{file_}, line {at.group(1)}, column {at.group(2)}" if at else file_
        found.append(f"{where}: syntax error: {what}")
    lexical = re.search(r"Lexical error at line (\d+), column (\d+)\.(.*)", output)
    if lexical:
        file_ = m.group(1) if m else "?"
        found.append(
            f"{file_}, line {lexical.group(1)}, column {lexical.group(2)}: lexical error:"
            f"{lexical.group(3)}"
        )
    for line, col, module, what in _SEMANTIC.findall(output):
        found.append(f"{module}.tla, line {line}, column {col}: {what.strip()}")
    cfg = re.search(r"error in the configuration file at line (\d+)\s*\n(.+)", output)
    if cfg:
        found.append(f"configuration file (.cfg), line {cfg.group(1)}: {cfg.group(2).strip()}")
    if not found:
        return _error_message(output)
    return " | ".join(dict.fromkeys(found))


def _error_message(output: str) -> str:
    errs = [ln.strip() for ln in output.splitlines() if ln.startswith("Error") or "Exception" in ln]
    if errs:
        return " | ".join(errs[:6])
    lines = output.strip().splitlines()
    return lines[-1] if lines else "TLC printed nothing"


def _parse_trace(output: str) -> tuple[list[TraceState], int | None]:
    trace: list[TraceState] = []
    loop_to = None
    lines = output.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        back = _BACK_TO.match(line)
        if back:
            loop_to = int(back.group(1))
            i += 1
            continue
        if line.startswith("State "):
            m = _STATE_HEAD.match(line[len("State ") :])
            if m:
                action = m.group(2) or m.group(3)
                if action == "Initial predicate":
                    action = "Init"
                action = action_name(action)
                body: list[str] = []
                i += 1
                while i < len(lines) and lines[i].strip():
                    body.append(lines[i])
                    i += 1
                try:
                    state = parse_state("\n".join(body))
                except ValueError:
                    state = {}
                trace.append(TraceState(action, state))
                continue
        i += 1
    return trace, loop_to


#: For runs of seconds (the manifest's default models, trace replays): the JVM's
#: optimizing compiler (C2) costs more CPU than it saves there, so they stop at C1.
#: Measured on the 53 default models, two at a time: 190 s of CPU (98 s wall) with
#: C2, 109 s (62 s) with C1, the same counts. Long runs keep C2.
SHORT_RUN_JVM = ("-XX:TieredStopAtLevel=1",)


def run_tlc(
    name: str,
    files: Mapping[str, str],
    *,
    deadlock: bool = True,
    workers: int = 1,
    dump_dot: bool = False,
    timeout: float | None = 600,
    heap: str | None = None,
    keep_dir: Path | None = None,
    java_opts: Sequence[str] = (),
) -> TLCResult:
    """Run TLC on module `name` in a scratch directory holding the spec modules and
    `files` (file name -> text). `deadlock=False` passes `-deadlock` (no deadlock
    check). With `dump_dot`, the state graph is kept at `result.dot_path`, which
    lives under `keep_dir` (a fresh temporary directory if None, not removed).

    Liveness is checked once, on the complete state graph (`-lncheck final`):
    by default TLC checks it on a timer while it explores, so how far it got
    before a liveness violation stops it, and hence the states it reports,
    depended on the machine's load. With `final` every count is a function of
    the model alone."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers={workers!r} must be an integer >= 1")
    java, jar = find_java(), find_jar()
    src = spec_dir()
    work = Path(tempfile.mkdtemp(prefix=f"tlc-{name}-", dir=keep_dir))
    for mod in SPEC_MODULES:
        shutil.copy(src / mod, work / mod)
    for fname, text in files.items():
        (work / fname).write_text(text)
    meta = work / "meta"
    cmd = [java, "-XX:+UseParallelGC", f"-Djava.io.tmpdir={work}"]
    if heap:
        cmd.append(f"-Xmx{heap}")
    cmd += [*java_opts, "-cp", str(jar), "tlc2.TLC"]
    cmd += ["-workers", str(workers), "-metadir", str(meta), "-nowarning"]
    cmd += ["-lncheck", "final"]
    if not deadlock:
        cmd.append("-deadlock")
    dot = work / "states"
    if dump_dot:
        cmd += ["-dump", "dot,actionlabels", str(dot)]
    cmd += ["-config", f"{name}.cfg", f"{name}.tla"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=work, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else ""
        res = parse_output(name, -1, out)
        res.result, res.message = "timeout", f"TLC ran past {timeout}s"
        res.elapsed_s = time.perf_counter() - start
        return res
    res = parse_output(name, proc.returncode, proc.stdout + proc.stderr)
    res.elapsed_s = time.perf_counter() - start
    if dump_dot:
        for candidate in (dot.with_suffix(".dot"), dot):
            if candidate.is_file():
                res.dot_path = candidate
                break
    shutil.rmtree(meta, ignore_errors=True)
    if not dump_dot and keep_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return res
