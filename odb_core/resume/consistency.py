"""The consistency of one progress record: what every state the loader writes
satisfies, whatever the dataset (the fit to this loader's dataset is `fit`)."""

from __future__ import annotations

from odb_core.errors import ResumeStateError
from odb_core.resume.record import ProgressRecord

# (lo, hi) pairs with lo <= hi in every state the loader writes.
_ORDERED = (
    ("start_step", "step"),
    ("start_emitted", "emitted"),
    ("start_window", "window"),
    ("start_window", "start_step"),
    ("window", "step"),
)


def check(p: ProgressRecord) -> None:
    """Raise `ResumeStateError` unless the fields of `p` are consistent with each other."""
    both = p.base_done & p.done
    if both:
        raise ResumeStateError(
            f"loader state: id {min(both)} is in both base_done and done ({len(both)} such ids)"
        )
    for lo, hi in _ORDERED:
        if getattr(p, lo) > getattr(p, hi):
            raise ResumeStateError(
                f"loader state has {lo}={getattr(p, lo)} > {hi}={getattr(p, hi)}: "
                "impossible in a state the loader wrote (a run starts before it ends, "
                "and a window holds at least one step)"
            )
    # Every aligned step has at least one real sample on some rank.
    if p.emitted - p.start_emitted < p.step - p.start_step:
        raise ResumeStateError(
            f"loader state has {p.step - p.start_step} steps since step "
            f"{p.start_step} but only {p.emitted - p.start_emitted} samples "
            "emitted in them: every step emits at least one sample"
        )
    if len(p.base_done) > p.start_emitted:
        raise ResumeStateError(
            f"loader state has {len(p.base_done)} base_done ids but only "
            f"start_emitted={p.start_emitted} samples were emitted before this run"
        )
    if len(p.base_done) + len(p.done) > p.emitted:
        raise ResumeStateError(
            f"loader state marks {len(p.base_done) + len(p.done)} ids done but "
            f"emitted={p.emitted}: ids never emitted are marked done (they would be "
            "lost)"
        )
    if p.is_global:
        run = (p.start_step, p.start_emitted, p.start_window)
        if p.done or run != (p.step, p.emitted, p.window) or len(p.base_done) != p.emitted:
            raise ResumeStateError(
                "loader state is a merged (all-rank) state but its fields are not those "
                "merge_states writes: done must be empty, start_step/start_emitted/"
                "start_window equal to step/emitted/window, and base_done hold exactly "
                f"emitted={p.emitted} ids (it holds {len(p.base_done)})"
            )
