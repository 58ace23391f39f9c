"""ODBDataLoader's keyword arguments, grouped (odb_core.torch.options): every drop-in
name keeps working, belongs to exactly one group with the same default, and a bad
value fails in one place, naming it, before the loader does anything."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields
from typing import Any

import pytest

pytest.importorskip("torch")

from odb_core import ODBDataLoader
from odb_core.errors import ConfigError
from odb_core.torch import options as opts

#: DataLoader's own arguments that a token budget replaces (refused unless at default).
REPLACED = {"batch_size", "batch_sampler", "drop_last"}


def _signature() -> dict[str, Any]:
    params = inspect.signature(ODBDataLoader.__init__).parameters
    return {n: p.default for n, p in params.items() if n not in ("self", "dataset")}


def test_every_keyword_is_in_exactly_one_group_with_the_same_default() -> None:
    grouped: dict[str, Any] = {"peer_timeout": 300.0}
    for group in (
        opts.BatchOptions,
        opts.EpochOptions,
        opts.LossOptions,
        opts.OutputOptions,
        opts.WorkerOptions,
    ):
        for f in fields(group):
            assert f.name not in grouped, f"{f.name} in two groups"
            grouped[f.name] = inspect.Parameter.empty if f.default is MISSING else f.default
    signature = _signature()
    assert set(signature) - REPLACED == set(grouped)
    assert {n: signature[n] for n in grouped} == grouped


def test_the_loader_keeps_its_grouped_options() -> None:
    dl = ODBDataLoader(list(range(6)), token_budget=4, cost_fn=lambda s: 1, seed=3, label_shift=0)
    assert dl.options.batch.token_budget == 4 and dl.options.epoch.seed == 3
    assert dl.options.loss.label_shift == 0 and dl.options.output.step_meta is True
    with pytest.raises(AttributeError):
        dl.options.epoch.seed = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"batch_size": 3}, r"batch_size=3 conflicts"),
        ({"drop_last": True}, "drop_last=True"),
        ({"peer_timeout": float("inf")}, r"peer_timeout=inf"),
        ({"seed": -1}, r"seed=-1"),
        ({"samples_per_fetch": 0}, r"samples_per_fetch=0 must be >= 1"),
        ({"label_shift": -2}, r"label_shift=-2"),
        ({"ignore_index": 1.5}, r"ignore_index=1.5"),
        ({"step_meta": 1}, r"step_meta=1 must be a bool"),
        ({"loss_tokens_fn": 3}, r"loss_tokens_fn=3 is not callable"),
        ({"shuffle": True, "sampler": [0, 1]}, "mutually exclusive"),
    ],
)
def test_a_bad_value_is_named(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        opts.LoaderOptions.of(token_budget=4, **kw)
    with pytest.raises(ConfigError, match=match):
        ODBDataLoader(list(range(6)), token_budget=4, **kw)


def test_an_unknown_option_is_named() -> None:
    with pytest.raises(ConfigError, match=r"\['tokenbudget'\]"):
        opts.LoaderOptions.of(token_budget=4, tokenbudget=3)


def test_odb_arguments_are_loader_options_with_the_loaders_defaults() -> None:
    """`ODBArguments` (the HF adapter's) holds loader options under their names, at the
    loader's defaults, but for those whose default is the Trainer's."""
    pytest.importorskip("transformers")
    from odb_core.integrations.hf_args import ODBArguments

    trainers = {"cost_model", "shuffle", "seed", "label_shift"}
    own = {"token_budget", "lr_tokens", "loader_kwargs"}
    for f in fields(ODBArguments):
        if f.name in own:
            continue
        assert f.name in opts.OPTION_DEFAULTS, f.name
        if f.name not in trainers:
            assert f.default == opts.OPTION_DEFAULTS[f.name], f.name
    assert ODBArguments(token_budget=8).loader_options() == {
        "token_budget": 8,
        "cost_model": "padded",
    }


def test_odb_arguments_pass_on_every_value_set_that_the_loader_would_not_assume() -> None:
    """A field whose default is the Trainer's is passed on whenever set, also at the
    loader's own default (`shuffle=False` would otherwise fall to the Trainer's
    shuffle rule); a field at the loader's default, as the loader's, is left out."""
    pytest.importorskip("transformers")
    from odb_core.integrations.hf_args import ODBArguments

    got = ODBArguments(token_budget=8, shuffle=False, seed=0, buffer_size=None).loader_options()
    assert got["shuffle"] is False and got["seed"] == 0
    assert "buffer_size" not in got
    at_default = ODBArguments(token_budget=8, deterministic=False).loader_options()
    assert "deterministic" not in at_default
