"""Argument types shared by subcommands: each rejects a bad value by naming it."""

from __future__ import annotations

import argparse
import enum
from typing import TypeVar

E = TypeVar("E", bound=enum.Enum)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list non-negative integers")
    return values


def enum_choice(kind: type[E]) -> argparse._ActionsContainer | object:
    """argparse `type=` that maps a value to `kind`, listing the choices on error."""

    def parse(text: str) -> E:
        try:
            return kind(text)
        except ValueError:
            allowed = ", ".join(m.value for m in kind)
            raise argparse.ArgumentTypeError(
                f"unknown {kind.__name__} {text!r}; expected one of {allowed}"
            ) from None

    parse.__name__ = kind.__name__
    return parse
