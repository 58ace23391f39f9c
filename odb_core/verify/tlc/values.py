"""TLA+ values as TLC prints them, parsed into Python values."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

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
