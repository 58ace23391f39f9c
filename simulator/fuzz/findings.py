"""What a fuzz campaign found: every outcome added to a `FuzzReport`, its
violations, and the worst schedules (closest to the proven step and round
bounds, and the longest pad tail), as plain data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from simulator.fuzz.driver import Outcome


@dataclass
class FuzzReport:
    schedules: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    worst_steps: Outcome | None = None
    worst_rounds: Outcome | None = None
    worst_tail: Outcome | None = None
    max_world: int = 0
    total_samples: int = 0
    total_actions: int = 0
    elapsed_s: float = 0.0
    by_origin: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def add(self, o: Outcome) -> None:
        self.schedules += 1
        self.by_origin[o.schedule.origin] = self.by_origin.get(o.schedule.origin, 0) + 1
        self.max_world = max(self.max_world, o.schedule.world)
        self.total_samples += o.schedule.n
        self.total_actions += o.actions
        if not o.ok:
            self.violations.append(o.summary())
            return
        # Worst = closest to the bound; ties go to the larger world, then more steps.
        if self.worst_steps is None or _key(o, "steps") > _key(self.worst_steps, "steps"):
            self.worst_steps = o
        if self.worst_rounds is None or _key(o, "rounds") > _key(self.worst_rounds, "rounds"):
            self.worst_rounds = o
        if self.worst_tail is None or (o.tail, o.schedule.world) > (
            self.worst_tail.tail,
            self.worst_tail.schedule.world,
        ):
            self.worst_tail = o

    def to_json(self) -> dict[str, Any]:
        def worst(o: Outcome | None, key: str) -> dict[str, Any] | None:
            if o is None:
                return None
            s = o.summary()
            return {
                "value": s[key],
                "bound": s.get(f"{key}_bound"),
                "ratio_to_bound": round(bound_ratio(s[key], s.get(f"{key}_bound", 0)), 4)
                if f"{key}_bound" in s
                else None,
                "schedule": s,
            }

        return {
            "ok": not self.violations,
            "schedules": self.schedules,
            "by_origin": self.by_origin,
            "violations": len(self.violations),
            "violation_examples": self.violations[:10],
            "max_world_size": self.max_world,
            "samples": self.total_samples,
            "actions": self.total_actions,
            "elapsed_s": round(self.elapsed_s, 2),
            "bounds": {
                "steps": "steps <= max samples on any rank (odb_core.protocol.steps_bound)",
                "rounds": "rounds <= steps bound + 1 (odb_core.protocol.rounds_bound)",
            },
            "worst": {
                "steps": worst(self.worst_steps, "steps"),
                "rounds": worst(self.worst_rounds, "rounds"),
                "tail_steps": worst(self.worst_tail, "tail_steps"),
            },
        }


def _key(o: Outcome, what: str) -> tuple[float, int, int]:
    if what == "steps":
        return (bound_ratio(o.steps, o.steps_bound), o.schedule.world, o.steps)
    return (bound_ratio(o.rounds, o.rounds_bound), o.schedule.world, o.rounds)


def bound_ratio(v: int, bound: int) -> float:
    return v / bound if bound else 0.0


def worst_cases(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    r = FuzzReport()
    for o in outcomes:
        r.add(o)
    return r.to_json()["worst"]  # type: ignore[no-any-return]
