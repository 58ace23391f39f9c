"""The mutation score of a `make mutants` run, per module, read from mutmut's results.

mutmut 3 keeps one `<module>.py.meta` JSON file per mutated module under
`mutants/`, mapping each mutant's name to the exit code of its test run. This
prints, per module, how many mutants were killed, timed out, survived, had no
covering test or were not run, and the score over the non-equivalent mutants:
the mutants listed in `docs/equivalent_mutants.txt` (one name per line, then
the reason; docs/VERIFICATION.md argues each) are set apart. A listed name that
mutmut no longer generates, or that the tests now kill, is reported as stale.

    python tools/mutation_score.py [--mutants mutants] [--equivalent FILE] [--survivors]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

# mutmut 3.8's meaning of an exit code (mutmut/stats.py, `status_by_exit_code`).
KILLED = {1, 3}
SURVIVED = {0}
NO_TESTS = {5, 33}
TIMEOUT = {36, 24, -24, 152, 255}
STATUSES = ("killed", "timeout", "survived", "equivalent", "no tests", "not run", "other")


def status(exit_code: int | None) -> str:
    if exit_code is None:
        return "not run"
    if exit_code in KILLED:
        return "killed"
    if exit_code in SURVIVED:
        return "survived"
    if exit_code in NO_TESTS:
        return "no tests"
    if exit_code in TIMEOUT:
        return "timeout"
    return "other"


def read_equivalent(path: Path) -> dict[str, str]:
    """`name  reason` per line; blank lines and lines starting with # are skipped."""
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(" ")
        if not reason.strip():
            raise SystemExit(f"{path}:{n}: {name!r} has no reason; say why it is equivalent")
        if name in out:
            raise SystemExit(f"{path}:{n}: {name!r} is listed twice")
        out[name] = reason.strip()
    return out


def read_results(mutants: Path) -> dict[str, dict[str, int | None]]:
    """Module path (odb_core/x.py) -> {mutant name: exit code}."""
    metas = sorted(mutants.glob("**/*.py.meta"))
    if not metas:
        raise SystemExit(f"no mutmut results under {mutants}/: run `make mutants` first")
    results: dict[str, dict[str, int | None]] = {}
    for meta in metas:
        data = json.loads(meta.read_text(encoding="utf-8"))
        codes = data.get("exit_code_by_key")
        if not isinstance(codes, dict):
            raise SystemExit(f"{meta}: no exit_code_by_key; not a mutmut 3 result file")
        if codes:
            results[str(meta.relative_to(mutants))[: -len(".meta")]] = codes
    return results


def tally(
    results: dict[str, dict[str, int | None]], equivalent: dict[str, str]
) -> tuple[dict[str, Counter[str]], list[str], list[str]]:
    """Per-module counts, the survivors not listed as equivalent, and stale listings."""
    per_module: dict[str, Counter[str]] = {}
    survivors: list[str] = []
    seen: dict[str, str] = {}
    for module, codes in results.items():
        counts: Counter[str] = Counter()
        for name, code in codes.items():
            s = status(code)
            seen[name] = s
            if name in equivalent and s == "survived":
                s = "equivalent"
            elif s == "survived":
                survivors.append(name)
            counts[s] += 1
        per_module[module] = counts
    stale = [
        f"{name} ({seen.get(name, 'not generated')})"
        for name in equivalent
        if seen.get(name) not in ("survived", "not run")
    ]
    return per_module, survivors, stale


def score(counts: Counter[str]) -> tuple[int, int]:
    """Killed (timeouts count as killed, as in mutmut) over every non-equivalent run mutant."""
    killed = counts["killed"] + counts["timeout"]
    return killed, killed + counts["survived"] + counts["no tests"] + counts["other"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=Path, default=Path("mutants"))
    ap.add_argument("--equivalent", type=Path, default=Path("docs/equivalent_mutants.txt"))
    ap.add_argument("--survivors", action="store_true", help="list the survivors")
    args = ap.parse_args(argv)
    equivalent = read_equivalent(args.equivalent) if args.equivalent.exists() else {}
    per_module, survivors, stale = tally(read_results(args.mutants), equivalent)
    total: Counter[str] = Counter()
    print(f"{'module':32} " + " ".join(f"{s:>10}" for s in STATUSES) + "      score")
    for module, counts in sorted(per_module.items()):
        total += counts
        k, n = score(counts)
        pct = f"{100.0 * k / n:6.1f}%" if n else "      -"
        print(f"{module:32} " + " ".join(f"{counts[s]:10d}" for s in STATUSES) + f"    {pct}")
    k, n = score(total)
    print(
        f"mutation score: {k} of {n} non-equivalent mutants killed = "
        f"{100.0 * k / max(n, 1):.1f}% ({total['equivalent']} equivalent, "
        f"{total['not run']} not run)"
    )
    if args.survivors and survivors:
        print("survivors:\n  " + "\n  ".join(sorted(survivors)))
    if stale:
        print(
            f"{args.equivalent}: stale entries (killed now, or no longer generated):\n  "
            + "\n  ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
