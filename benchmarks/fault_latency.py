"""Peer-failure latency and orphan workers, per start method (docs/FAULTS.md).

    .venv/bin/python benchmarks/fault_latency.py [--trials 3]

For fork, spawn and forkserver workers (1 per rank, map-style), runs two gloo
ranks of tests/test_faults.py and reports the median over trials of: the time
from a kill -9 of rank 1 to rank 0's ODBPeerError, the time from a SIGSTOP of
rank 1 to rank 0's ODBPeerError (peer_timeout=3 s), and how many of the killed
rank's workers are alive 10 s after the kill.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_faults as tf

HUNG_TIMEOUT = 3.0  # the peer_timeout docs/FAULTS.md reports (the tests use a longer one)


def trial(method: str, kind: str, out: Path) -> tuple[float, int]:
    sig = "SIGKILL" if kind == "dead" else "SIGSTOP"
    victim = {"rank": 1, "step": 3, "signal": sig}
    spec = tf.map_spec(method, 1, victim=victim, step_s=0.05, warm=kind == "hung")
    if kind == "hung":
        spec["loader"].update(peer_timeout=HUNG_TIMEOUT, persistent_workers=True)
    run = tf.launch(spec, out, wait_for=(0,))
    res = run.res(0)
    if res.get("raised") != "ODBPeerError":
        raise SystemExit(f"{method} {kind}: rank 0 did not raise ODBPeerError: {res}")
    orphans = 0
    if kind == "dead":
        pids = run.workers(1)
        while any(tf.alive(p) for p in pids) and time.time() < run.fault_at + 10.0:
            time.sleep(0.1)
        orphans = sum(tf.alive(p) for p in pids)
    return run.latency(0), orphans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    print("| start method | dead peer -> error (s) | hung peer -> error (s) | orphans at 10 s |")
    print("|---|---|---|---|")
    for method in tf.START_METHODS:
        dead, hung, orphans = [], [], 0
        for i in range(args.trials):
            with tempfile.TemporaryDirectory() as d:
                lat, orph = trial(method, "dead", Path(d) / f"dead{i}")
                dead.append(lat)
                orphans += orph
            with tempfile.TemporaryDirectory() as d:
                hung.append(trial(method, "hung", Path(d) / f"hung{i}")[0])
        print(
            f"| {method} | {statistics.median(dead):.2f} (max {max(dead):.2f}) "
            f"| {statistics.median(hung):.2f} (max {max(hung):.2f}) | {orphans} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
