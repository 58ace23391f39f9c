"""Hypothesis stateful testing: arbitrary arrival orders, costs and exhaustion
timings drive the global model; invariants mirror the guarantees (spec names)."""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from odb_core.assign import dynamic_bounds
from odb_core.config import LossNormalization, Mode, OversizePolicy, ProtocolConfig, Sharding
from odb_core.cost import AttentionAware, Budget, PackedTokens, PaddedTokens
from odb_core.formers import FormerKind
from odb_core.protocol import RankMachine, rounds_bound, steps_bound
from odb_core.sample import Sample
from odb_core.step import StepInfo
from odb_core.verify.bugs import BugVariant
from odb_core.verify.invariants import INVARIANTS
from odb_core.verify.model import Action, GlobalModel, GlobalState, ModelConfig
from odb_core.window import WindowBuffer


@st.composite
def model_configs(draw: st.DrawFn) -> ModelConfig:
    world = draw(st.integers(1, 8))
    n = draw(st.integers(0, 300))
    budget = draw(st.integers(8, 400))
    lengths = draw(st.lists(st.integers(1, budget), min_size=n, max_size=n))
    # Loss tokens apart from cost (masked prompts), or unset (every token counts).
    masked = draw(st.booleans())
    loss = [
        rng_loss % (length + 1)
        for rng_loss, length in zip(
            draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n)), lengths, strict=True
        )
    ]
    # Uneven shards: each sample goes to a rank drawn with a skewed weight.
    weights = draw(st.lists(st.integers(1, 10), min_size=world, max_size=world))
    rng = random.Random(draw(st.integers(0, 2**32)))
    owners = rng.choices(range(world), weights=weights, k=n)
    mode = draw(st.sampled_from(list(Mode)))
    quota = draw(st.none() | st.integers(1, max(1, n))) if mode is Mode.QUOTA else None
    window = draw(st.sampled_from(["none", "steps", "tokens"]))
    # Dynamic sharding deals the ids of a shuffled plan; the shards then only hold
    # the samples.
    dynamic = draw(st.booleans())
    plan = tuple(rng.sample(range(n), n)) if dynamic else ()
    protocol = ProtocolConfig(
        world_size=world,
        budget=Budget(budget, max_samples=draw(st.none() | st.integers(1, 16))),
        cost_model=draw(
            st.sampled_from([PackedTokens(), PaddedTokens(), AttentionAware(alpha=1e-3)])
        ),
        buffer_size=draw(st.integers(1, 64)),
        mode=mode,
        former=draw(st.sampled_from(list(FormerKind))),
        max_steps_per_round=draw(st.integers(1, 8)),
        quota=quota,
        deterministic=draw(st.booleans()),
        # Lengths fit the packed budget but may not fit padded/attention costs:
        # exercise both admitting policies.
        oversize=draw(st.sampled_from([OversizePolicy.SOLO, OversizePolicy.TRUNCATE])),
        loss_normalization=draw(st.sampled_from(list(LossNormalization))),
        grad_accum_steps=draw(st.integers(1, 6)) if window == "steps" else None,
        tokens_per_update=draw(st.integers(1, 4 * budget)) if window == "tokens" else None,
        sharding=Sharding.DYNAMIC if dynamic else Sharding.STATIC,
        plan=plan,
        assign_target=draw(st.none() | st.integers(1, 16)) if dynamic else None,
    )
    shards = tuple(
        tuple(
            Sample(i, lengths[i], loss_tokens=loss[i] if masked else None)
            for i in range(n)
            if owners[i] == r
        )
        for r in range(world)
    )
    return ModelConfig(protocol, shards)


class DGAPMachine(RuleBasedStateMachine):
    model: GlobalModel
    state: GlobalState
    machine: type[RankMachine] = RankMachine

    @initialize(cfg=model_configs())
    def setup(self, cfg: ModelConfig) -> None:
        cfg = replace(cfg, machine=self.machine)
        self.cfg = cfg
        self.model = GlobalModel(cfg)
        self.state = self.model.init()
        self.emitted: dict[int, list[StepInfo]] = defaultdict(list)
        # What each rank's training loop gets: decided steps released, final, when
        # their optimizer window closes.
        self.buffers = [WindowBuffer(cfg.protocol) for _ in range(cfg.protocol.world_size)]
        self.released: list[list[StepInfo]] = [[] for _ in self.buffers]

    def _apply(self, action: Action) -> None:
        self.state, result = self.model.step_with_output(self.state, action)
        if result is not None:
            assert action.rank is not None
            for info in result.steps:
                self.emitted[info.step].append(info)
            self.released[action.rank].extend(self.buffers[action.rank].push(result))

    @precondition(lambda self: not self.state.all_done)
    @rule(data=st.data())
    def one_action(self, data: st.DataObject) -> None:
        enabled = self.model.enabled(self.state)
        assert enabled, "DeadlockFreedom: no action enabled before the epoch ended"
        self._apply(data.draw(st.sampled_from(enabled)))

    @precondition(lambda self: not self.state.all_done)
    @rule(seed=st.integers(0, 2**32), n=st.integers(1, 400), favour=st.integers(0, 7))
    def burst(self, seed: int, n: int, favour: int) -> None:
        """Many actions at once, biased to one rank: stragglers and sprinters."""
        rng = random.Random(seed)
        for _ in range(n):
            enabled = self.model.enabled(self.state)
            if not enabled:
                break
            mine = [a for a in enabled if a.rank == favour % self.model.world]
            pool = mine if mine and rng.random() < 0.8 else enabled
            self._apply(rng.choice(pool))

    @rule()
    def done_is_final(self) -> None:
        """Once every rank finished, no action is enabled (and before, some is)."""
        enabled = self.model.enabled(self.state)
        assert bool(enabled) != self.state.all_done

    @invariant()
    def guarantees_hold(self) -> None:
        for name, inv in INVARIANTS.items():
            reason = inv(self.state, self.cfg)
            assert reason is None, f"{name}: {reason}"

    @invariant()
    def exact_loss_scaling(self) -> None:
        world = self.model.world
        for step, infos in self.emitted.items():
            glob = {(i.global_samples, i.global_tokens, i.global_loss_tokens) for i in infos}
            assert len(glob) == 1, step
            if len(infos) == world:
                assert sum(i.local_samples for i in infos) == infos[0].global_samples
                assert sum(i.local_tokens for i in infos) == infos[0].global_tokens
                assert sum(i.local_loss_tokens for i in infos) == infos[0].global_loss_tokens

    @invariant()
    def window_alignment(self) -> None:
        """Released steps: every rank the same windows and boundaries; each closed
        window's DDP-averaged scaled loss is exactly the global mean over it."""
        world = self.model.world
        n = min(len(r) for r in self.released)
        views = [
            [
                (s.step, s.window, s.sync_gradients, s.window_samples, s.window_loss_tokens)
                for s in r[:n]
            ]
            for r in self.released
        ]
        assert all(v == views[0] for v in views), "ranks disagree on the windows"
        by_window: dict[int, list[StepInfo]] = defaultdict(list)
        for r in self.released:
            for s in r[:n]:
                assert s.final
                by_window[s.window].append(s)
        tokens = self.cfg.protocol.loss_normalization is LossNormalization.TOKENS
        for w, steps in by_window.items():
            # Per-token loss x(rank, step), constant within a batch: the global mean
            # over the window weights each batch by its loss tokens (or samples).
            x = {(s.rank, s.step): 1.0 + ((s.rank * 7919 + s.step * 104729) % 97) for s in steps}
            weight = [s.local_loss_tokens if tokens else s.local_samples for s in steps]
            total = sum(weight)
            assert total == (steps[0].window_loss_tokens if tokens else steps[0].window_samples)
            if total == 0:
                assert all(s.loss_scale == 0.0 for s in steps), w
                continue
            want = sum(wt * x[s.rank, s.step] for wt, s in zip(weight, steps, strict=True)) / total
            got = sum(x[s.rank, s.step] * s.loss_scale for s in steps) / world
            assert abs(got - want) <= 1e-9 * max(1.0, abs(want)), (w, got, want)

    def teardown(self) -> None:
        if not hasattr(self, "model"):
            return
        rng = random.Random(0)
        while not self.state.all_done:
            enabled = self.model.enabled(self.state)
            assert enabled, "DeadlockFreedom"
            self._apply(rng.choice(enabled))
            self.guarantees_hold()
        per_rank = self.cfg.samples_per_rank
        steps = {r.steps for r in self.state.ranks}
        assert len(steps) == 1, "StepAlignment at the end of the epoch"
        p = self.cfg.protocol
        if p.dynamic:
            sb, rb = dynamic_bounds(len(p.plan), p.world_size, p.target)
        else:
            sb, rb = steps_bound(per_rank), rounds_bound(per_rank)
        assert steps.pop() <= sb
        assert max(r.round for r in self.state.ranks) <= rb
        self.exact_loss_scaling()
        assert all(b.held == 0 for b in self.buffers), "a window outlived its epoch"
        assert len({len(r) for r in self.released}) == 1
        self.window_alignment()


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestDGAP = DGAPMachine.TestCase
TestDGAP.settings = SETTINGS


@pytest.mark.parametrize(
    "bug",
    [
        BugVariant.NO_PADS,
        BugVariant.DROP_LEFTOVERS,
        BugVariant.PAD_REPEATS_BATCH,
        BugVariant.IGNORE_BUDGET,
        BugVariant.SILENT_STOP,
        BugVariant.QUOTA_FORGETS_LEDGER,
        BugVariant.LOSS_BY_COST,
        BugVariant.WINDOW_BY_LOCAL,
        BugVariant.DEAL_OVERLAPS,
        BugVariant.RANK_LOCAL_PLACEMENT,
    ],
    ids=lambda b: b.value,
)
def test_state_machine_catches_broken_variants(bug: BugVariant) -> None:
    broken = type(f"Broken{bug.machine.__name__}", (DGAPMachine,), {"machine": bug.machine})
    # No shrinking: we only need to see that some schedule breaks the variant.
    fast = settings(SETTINGS, max_examples=300, database=None, phases=[Phase.generate])
    with pytest.raises(Exception) as info:
        run_state_machine_as_test(broken, settings=fast)
    # Any guarantee may be the first to notice (a lost id also breaks quota closure);
    # what matters is that an invariant assertion, not a crash, reports it.
    assert isinstance(info.value, AssertionError), str(info.value)
