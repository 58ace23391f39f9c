"""`spec/manifest.json`: every model and bug model with its pinned result."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from odb_core.config import Mode, OversizePolicy, ProtocolConfig, Sharding, make_cost_model
from odb_core.cost import Budget
from odb_core.errors import ConfigError
from odb_core.protocol import RankMachine
from odb_core.verify.model import ModelConfig, round_robin_shards
from odb_core.verify.tlc.install import SPEC_INVARIANTS, SPEC_PROPERTIES, spec_dir
from odb_core.verify.tlc.render import CheckSpec, render_model
from odb_core.verify.tlc.run import SHORT_RUN_JVM, TLCResult, run_tlc

# ---------------------------------------------------------------------------
# The manifest of models


@dataclass(frozen=True)
class ManifestModel:
    """One entry of spec/manifest.json: a model, what it checks, and its pinned result."""

    name: str
    world_size: int
    costs: tuple[int, ...]
    buffer_size: int
    budget: int
    mode: str
    max_steps_per_round: int
    quota: int | None
    deterministic: bool
    cost_model: str
    bug: str | None
    check: CheckSpec
    conformance: bool
    expect: dict[str, Any]
    about: str
    generated: bool = True  # False: hand-written MC files (the inductive checks)
    # Minutes, not seconds, under TLC: `odb check` leaves it out unless --all-models
    # or --model names it; tests/test_tlc.py checks it like every other model.
    slow: bool = False
    loss: tuple[int, ...] | None = None  # per-sample loss tokens; None: all tokens count
    grad_accum_steps: int | None = None
    tokens_per_update: int | None = None
    visual: tuple[int, ...] | None = None  # per-sample visual tokens, part of the costs
    patches: tuple[int, ...] | None = None  # per-sample visual patches
    max_samples: int | None = None
    max_patches: int | None = None
    sharding: str = "static"  # "dynamic": Sharding.DYNAMIC over the plan 0 .. n-1
    assign_target: int | None = None
    carried: tuple[int, ...] = ()  # quota mode: ids carried in from the last pass's ledger
    early_form: int | None = None  # ProtocolConfig.early_form: FormEarly's least window
    # Dynamic sharding: a round's deal split by any placement agreed at AllGather
    # (ModelConfig.any_placement, the spec's AnyPlacement): an adversarial pricing.
    any_placement: bool = False
    # Dynamic sharding: the ranks start on any agreed split of the initial prefix
    # (ModelConfig.any_initial_split, the spec's AnyInitialSplit): priced initial shares.
    any_initial_split: bool = False

    @staticmethod
    def from_json(d: dict[str, Any]) -> ManifestModel:
        m = d["model"]
        c = d.get("check", {})
        return ManifestModel(
            name=str(d["name"]),
            world_size=int(m["world_size"]),
            costs=tuple(int(x) for x in m["costs"]),
            buffer_size=int(m["buffer_size"]),
            budget=int(m.get("budget", 4)),
            mode=str(m.get("mode", "join")),
            max_steps_per_round=int(m.get("max_steps_per_round", 2)),
            quota=m.get("quota"),
            deterministic=bool(m.get("deterministic", False)),
            cost_model=str(m.get("cost_model", "packed")),
            bug=d.get("bug"),
            check=CheckSpec(
                invariants=tuple(c.get("invariants", SPEC_INVARIANTS)),
                properties=tuple(c.get("properties", SPEC_PROPERTIES)),
                deadlock=bool(c.get("deadlock", True)),
                specification=str(c.get("specification", "Spec")),
            ),
            conformance=bool(d.get("conformance", False)),
            expect=dict(d["expect"]),
            about=str(d.get("about", "")),
            generated=bool(d.get("generated", True)),
            slow=bool(d.get("slow", False)),
            loss=None if m.get("loss") is None else tuple(int(x) for x in m["loss"]),
            grad_accum_steps=m.get("grad_accum_steps"),
            tokens_per_update=m.get("tokens_per_update"),
            visual=_ints_or_none(m.get("visual")),
            patches=_ints_or_none(m.get("patches")),
            max_samples=m.get("max_samples"),
            max_patches=m.get("max_patches"),
            sharding=str(m.get("sharding", "static")),
            assign_target=m.get("assign_target"),
            carried=tuple(int(x) for x in m.get("carried", ())),
            early_form=m.get("early_form"),
            any_placement=bool(m.get("any_placement", False)),
            any_initial_split=bool(m.get("any_initial_split", False)),
        )

    def model_config(self, machine: type[RankMachine] = RankMachine) -> ModelConfig:
        if not self.generated:
            raise ConfigError(f"{self.name} is a hand-written model, not a ModelConfig")
        cost = make_cost_model(self.cost_model)
        protocol = ProtocolConfig(
            world_size=self.world_size,
            budget=Budget(self.budget, self.max_samples, self.max_patches),
            cost_model=cost,
            buffer_size=self.buffer_size,
            mode=Mode(self.mode),
            max_steps_per_round=self.max_steps_per_round,
            quota=self.quota,
            deterministic=self.deterministic,
            oversize=OversizePolicy.SOLO,
            grad_accum_steps=self.grad_accum_steps,
            tokens_per_update=self.tokens_per_update,
            carried=frozenset(self.carried),
            early_form=self.early_form,
        )
        if self.sharding == "dynamic":
            protocol = replace(
                protocol,
                sharding=Sharding.DYNAMIC,
                plan=tuple(range(len(self.costs))),
                assign_target=self.assign_target,
            )
        shards = round_robin_shards(
            self.costs, self.world_size, self.loss, visual=self.visual, patches=self.patches
        )
        return ModelConfig(
            protocol,
            shards,
            machine=machine,
            any_placement=self.any_placement,
            any_initial_split=self.any_initial_split,
        )

    def render(self) -> tuple[str, str]:
        note = "spec/manifest.json" + (f": {self.about}" if self.about else "")
        return render_model(self.name, self.model_config(), self.check, bug=self.bug, note=note)

    @property
    def expected(self) -> str:
        return str(self.expect["result"])


def _ints_or_none(v: Any) -> tuple[int, ...] | None:
    return None if v is None else tuple(int(x) for x in v)


def load_manifest(path: Path | None = None) -> list[ManifestModel]:
    path = path or spec_dir() / "manifest.json"
    data = json.loads(path.read_text())
    return [ManifestModel.from_json(d) for d in data["models"]]


def write_models(models: Iterable[ManifestModel], directory: Path | None = None) -> list[Path]:
    """(Re)write the MC*.tla/.cfg wrappers of the manifest into spec/."""
    directory = directory or spec_dir()
    written = []
    for m in models:
        if not m.generated:
            continue
        tla, cfg = m.render()
        for suffix, text in ((".tla", tla), (".cfg", cfg)):
            path = directory / f"{m.name}{suffix}"
            path.write_text(text)
            written.append(path)
    return written


def run_model(
    m: ManifestModel,
    *,
    dump_dot: bool = False,
    workers: int = 1,
    timeout: float | None = 600,
    keep_dir: Path | None = None,
) -> TLCResult:
    """Run one manifest model from its committed MC files in spec/."""
    src = spec_dir()
    files = {f"{m.name}{s}": (src / f"{m.name}{s}").read_text() for s in (".tla", ".cfg")}
    return run_tlc(
        m.name,
        files,
        deadlock=m.check.deadlock,
        workers=workers,
        dump_dot=dump_dot,
        timeout=timeout,
        keep_dir=keep_dir,
        java_opts=() if m.slow else SHORT_RUN_JVM,
    )


def compare_with_manifest(m: ManifestModel, r: TLCResult) -> list[str]:
    """Differences between a run and its pins (empty when it matches)."""
    diffs = []
    if r.verdict != m.expected:
        diffs.append(f"result {r.verdict} != expected {m.expected}")
    for key, got in (("distinct_states", r.distinct_states), ("depth", r.depth)):
        want = m.expect.get(key)
        if want is not None and got != want:
            diffs.append(f"{key} {got} != pinned {want}")
    return diffs


def run_manifest(
    models: Sequence[ManifestModel] | None = None,
    *,
    parallel: int = 2,
    dump_dot: Callable[[ManifestModel], bool] = lambda m: m.conformance,
    keep_dir: Path | None = None,
    timeout: float | None = 600,
) -> dict[str, TLCResult]:
    """Run models concurrently (one TLC worker each), in manifest order of results."""
    todo = list(models) if models is not None else load_manifest()
    # Longest first, so the two lanes finish together.
    order = sorted(todo, key=lambda m: -(m.expect.get("distinct_states") or 0))
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {
            m.name: pool.submit(
                run_model, m, dump_dot=dump_dot(m), keep_dir=keep_dir, timeout=timeout
            )
            for m in order
        }
        return {m.name: futures[m.name].result() for m in todo}
