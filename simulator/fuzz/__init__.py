"""Adversarial schedules over W RankMachines, with every guarantee asserted.

A schedule (`schedules.py`) fixes the world size, each rank's samples and their
arrival order, a protocol config, and the timing knobs an adversary controls:
per-rank speeds, stragglers, how eagerly a waiting rank prefetches, when a dry rank
notices it is dry, and when each rank leaves the collective. The driver
(`driver.py`) interleaves the ranks' local actions at random under those knobs and
checks what the machines emit by the predicates of `odb_core.verify.invariants`;
it decides nothing. `campaign.py` runs many schedules and hypothesis searches,
`findings.py` sums them up.
"""

from simulator.fuzz.campaign import fuzz, hypothesis_search, replay
from simulator.fuzz.driver import Outcome, run_schedule
from simulator.fuzz.findings import FuzzReport, worst_cases
from simulator.fuzz.schedules import ORDERS, Schedule, random_schedule

__all__ = [
    "ORDERS",
    "FuzzReport",
    "Outcome",
    "Schedule",
    "fuzz",
    "hypothesis_search",
    "random_schedule",
    "replay",
    "run_schedule",
    "worst_cases",
]
