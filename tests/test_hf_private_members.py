"""The HF adapter's `PRIVATE_MEMBERS` (`versions.PRIVATE_MEMBERS["transformers"]`, what
its version gate checks on an upgrade) names every transformers member the adapter
relies on that is not documented API, read from the syntax of
`odb_core/integrations/hf.py` and its callback's module, `hf_callback.py`:

- `self.X` (or `getattr(self, "X", ...)`) in `ODBHFTrainer` and `self.trainer.X` in
  its callback, X a `Trainer` member (a class attribute, or an attribute Trainer's
  source sets on `self`);
- a method or class attribute `ODBHFTrainer` defines that overrides a `Trainer`
  one (the loop calls it);
- `state.X` in the callback's hooks (and `state = self.state`), X a `TrainerState`
  member; `getattr(callback, "X")` on `ProgressCallback`.

Each one is either in `PUBLIC` (documented: an argument or an "Important attribute"
of Trainer's docstring, a documented override hook, a `TrainerState` field) or in
`PRIVATE_MEMBERS`. Removing any listed member from `PRIVATE_MEMBERS` fails the check
(the broken variants, one per member); so does a listed member the code no longer uses."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import Trainer, TrainerState
from transformers.trainer_callback import ProgressCallback

from odb_core.integrations import versions

ADAPTER = Path(__file__).resolve().parents[1] / "odb_core" / "integrations"
#: The HF adapter's source: the trainer and its callback.
HF_SOURCE = "\n".join((ADAPTER / name).read_text() for name in ("hf.py", "hf_callback.py"))
OWNERS = {"Trainer": Trainer, "TrainerState": TrainerState, "ProgressCallback": ProgressCallback}

#: Documented transformers API the adapter uses (transformers 5.24 docs / docstrings).
PUBLIC = {
    # Trainer(...) arguments, stored under the same name (the class docstring's Args)
    "Trainer.args",
    "Trainer.model",
    "Trainer.train_dataset",
    "Trainer.data_collator",
    "Trainer.compute_loss_func",
    # the optimizer of `optimizers=(optimizer, lr_scheduler)`, named in create_scheduler's doc
    "Trainer.optimizer",
    # the Trainer's state, documented with TrainerState
    "Trainer.state",
    # documented methods to override ("subclass and override" in the Trainer docs)
    "Trainer.train",
    "Trainer.training_step",
    "Trainer.compute_loss",
    "Trainer.create_scheduler",
    "Trainer.get_train_dataloader",
    # TrainerState's documented fields
    "TrainerState.global_step",
    "TrainerState.max_steps",
    "TrainerState.epoch",
}


def _attr_chain(node: ast.expr) -> list[str]:
    """`self.trainer.x` -> ["self", "trainer", "x"]; [] for anything else."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return []


def used_members(source: str) -> set[str]:
    """The transformers members `source` (hf.py) relies on, as "Owner.member"."""
    tree = ast.parse(source)
    used: set[str] = set()
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        trainer_class = any(_attr_chain(b) == ["Trainer"] for b in cls.bases)
        if trainer_class:  # overrides
            for item in cls.body:
                names = []
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names = [item.name]
                elif isinstance(item, ast.Assign):
                    names = [t.id for t in item.targets if isinstance(t, ast.Name)]
                names = [n for n in names if not n.startswith("__")]  # __init__ etc.
                used |= {f"Trainer.{n}" for n in names if versions.has_member(Trainer, n)}
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute):
                chain = _attr_chain(node)
                if trainer_class and chain[:1] == ["self"] and len(chain) >= 2:
                    name = chain[1]
                elif chain[:2] == ["self", "trainer"] and len(chain) >= 3:
                    name = chain[2]
                elif chain[:1] == ["state"] and len(chain) >= 2:
                    if versions.has_member(TrainerState, chain[1]):
                        used.add(f"TrainerState.{chain[1]}")
                    continue
                else:
                    continue
                if versions.has_member(Trainer, name):
                    used.add(f"Trainer.{name}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                name, target = node.args[1].value, _attr_chain(node.args[0])
                if trainer_class and target == ["self"] and versions.has_member(Trainer, name):
                    used.add(f"Trainer.{name}")  # getattr(self, "X", default)
                elif versions.has_member(ProgressCallback, name):
                    used.add(f"ProgressCallback.{name}")
    return used


def unlisted(private: dict[str, str], source: str) -> set[str]:
    """Members the code relies on that are neither documented nor in `private`."""
    return used_members(source) - PUBLIC - set(private)


def test_every_undocumented_member_the_hf_adapter_uses_is_listed() -> None:
    private = versions.PRIVATE_MEMBERS["transformers"]
    used = used_members(HF_SOURCE)
    assert unlisted(private, HF_SOURCE) == set()
    # ... and nothing stale: every listed member is used, and exists where it is gated
    assert set(private) <= used, sorted(set(private) - used)
    for name in private:
        owner, member = name.split(".")
        assert versions.has_member(OWNERS[owner], member), name
    assert not PUBLIC & set(private)


@pytest.mark.parametrize("member", sorted(versions.PRIVATE_MEMBERS["transformers"]))
def test_a_member_left_out_of_the_list_is_caught(member: str) -> None:
    private = dict(versions.PRIVATE_MEMBERS["transformers"])
    del private[member]
    assert unlisted(private, HF_SOURCE) == {member}


def test_the_scan_sees_each_kind_of_use() -> None:
    source = """
class T(Trainer):
    def get_batch_samples(self): ...
    loss_is_scaled_for_ga = True
    def f(self):
        self.label_smoother, self.odb_x = None, self.args
        getattr(self, "is_deepspeed_enabled", False)
class C(TrainerCallback):
    def on_step_end(self, args, state, control):
        state.compute_steps(args, 1)
        self.trainer.callback_handler.callbacks
        getattr(cb, "training_bar", None)
"""
    assert used_members(source) == {
        "Trainer.get_batch_samples",
        "Trainer.loss_is_scaled_for_ga",
        "Trainer.label_smoother",
        "Trainer.args",
        "Trainer.is_deepspeed_enabled",
        "TrainerState.compute_steps",
        "Trainer.callback_handler",
        "ProgressCallback.training_bar",
    }
