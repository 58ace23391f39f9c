"""Bench harnesses (not part of the runtime; nothing in `odb_core.torch` or
`odb_core.integrations` imports them): `odb bench`'s rank side (`loader_bench`),
`odb bench --model` (`model_bench`, the runner: `model_options` validated,
`model_setup`, `model_train` and `model_rank` on each rank, `model_report` on the
gathered runs; built from `workload`, `gmt`, `grouped`, `recipes`, `quality` and
their output modules), and `launch`, the local gloo rank helpers of the bench and
the tests and the one launcher of both benches' ranks."""
