"""Bench harness pieces for `odb bench --model` (not part of the runtime): the
HF `group_by_length` baseline (`grouped`), and the time-to-quality arithmetic
(`quality`)."""
