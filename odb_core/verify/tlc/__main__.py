"""Maintenance: python -m odb_core.verify.tlc write | pin."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from odb_core.verify.tlc.install import spec_dir
from odb_core.verify.tlc.manifest import load_manifest, run_manifest, write_models
from odb_core.verify.tlc.run import TLCResult

# ---------------------------------------------------------------------------
# Maintenance: python -m odb_core.verify.tlc write | pin


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

    parser = argparse.ArgumentParser(prog="python -m odb_core.verify.tlc")
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
