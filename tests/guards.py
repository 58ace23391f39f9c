"""Hang guards: the only wall-clock limits a test may have.

A test must not fail because the machine is busy (the suite runs beside other
work, load 4-12 on 2 cores), so its limits bound work, not time. A wall-clock
limit is a hang guard only: far above the slowest run seen under load, so that
reaching it means something hung, never that the machine was slow.
"""

#: A subprocess, a set of ranks or a thread the test waits for: torchrun examples
#: take 1-2 min on a quiet 2-core box and 3-6 min beside a benchmark.
HANG_GUARD_S = 900

#: One TLC model run: the models are finite, so the work is bounded by the model;
#: the slowest (MCInductive_cross_*) take 8-10 min under load.
TLC_HANG_GUARD_S = 1800
