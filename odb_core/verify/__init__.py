"""Verification of the protocol: apart from the runtime core, which never imports it.

`model` (the global state machine over `RankMachine`s), `invariants`, `checker`
(exhaustive BFS), `bugs` (deliberately broken variants), `conformance` (TLC's
state graph equals the Python one), `trace` (recorded runs, replayed) and `tlc`
(the TLC model checker, split by job).
"""
