"""A seeded, per-module random sample of the mutants `make mutants` has not run yet.

A full mutmut run over the runtime core takes hours on two cores. To measure a
score in less time, run a uniform sample of each module's pending mutants and
report it as a sample (tools/mutation_score.py counts what was run and what was
not). The sample is a function of the seed and mutmut's result files, so a rerun
picks the same mutants.

    python tools/mutant_sample.py --fraction 0.4 --seed 0 [--skip odb_core.protocol]
    mutmut run $(python tools/mutant_sample.py --fraction 0.4)
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutation_score import read_results


def sample(
    results: dict[str, dict[str, int | None]], fraction: float, seed: int, skip: list[str]
) -> list[str]:
    if not 0 < fraction <= 1:
        raise SystemExit(f"--fraction {fraction!r} must be in (0, 1]")
    picked: list[str] = []
    for module, codes in sorted(results.items()):
        dotted = module[: -len(".py")].replace("/", ".")
        if any(dotted == s or dotted.startswith(s + ".") for s in skip):
            continue
        pending = sorted(name for name, code in codes.items() if code is None)
        k = math.ceil(fraction * len(pending))
        picked += sorted(random.Random(f"{seed}:{module}").sample(pending, k))
    return picked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=Path, default=Path("mutants"))
    ap.add_argument("--fraction", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", action="append", default=[], help="a module (dotted) to leave out")
    args = ap.parse_args(argv)
    names = sample(read_results(args.mutants), args.fraction, args.seed, args.skip)
    print("\n".join(names))
    print(f"{len(names)} mutants sampled", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
