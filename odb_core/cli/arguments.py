"""What the subcommands' parsers share: argument types (each rejects a bad value by
naming it), the subcommand's parser, the output flags, and the progress bar."""

from __future__ import annotations

import argparse
import enum
import importlib
import math
import sys
from collections.abc import Callable
from typing import Any, TypeVar

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


def enum_choice(kind: type[E]) -> Callable[[str], E]:
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


def nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return v


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of integers >= 1, each rejected by `positive_int`."""
    return [positive_int(part.strip()) for part in text.split(",")]


def str_list(text: str) -> list[str]:
    """A comma-separated list, blanks dropped."""
    return [x.strip() for x in text.split(",") if x.strip()]


# ---- parsers ---------------------------------------------------------------------


def subcommand(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    name: str,
    run: Callable[[argparse.Namespace], int],
    *,
    help: str,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """The parser of subcommand `name`, which `run` runs."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
    p.set_defaults(run=run)
    return p


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_progress_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true")


def wants_progress(args: argparse.Namespace) -> bool:
    """A progress bar is shown on a terminal, unless --json or --no-progress."""
    return not args.json and not args.no_progress and sys.stderr.isatty()


def progress_bar(**kwargs: Any) -> Any:
    """A tqdm bar on stderr (`total`, `desc`, ...), or None where tqdm is not installed."""
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return None
    return tqdm(file=sys.stderr, leave=False, **kwargs)
