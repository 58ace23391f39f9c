"""TRL's SFTTrainer on an ODBDataLoader (`ODBSFTTrainer`) on real processes, and the
SFTConfig values it refuses.

The data is what SFTTrainer users pass: a `datasets.Dataset` of prompt-completion
text rows, built here, with long-tailed lengths. TRL prepares it (tokenization by
a word-level `PreTrainedTokenizerFast` built here, BOS from its post-processor, EOS
appended to the completion, the completion-only label mask: prompt labels -100)
and collates it (`DataCollatorForLanguageModeling`, padded or, under
`padding_free=True`, one flattened row per batch with position ids restarting at
every sample). The model is `sft_support.tiny_llama` (float64), whose forward TRL
patches with its fused LM head.
`chat_packed_g2` is the chat form: two-turn conversations through a chat template
with `{% generation %}` markers and `assistant_only_loss=True` (both user turns
masked). `epochs` runs 2 epochs with checkpoints and resumes inside epoch 1.

Two gloo ranks run `trainer.train()` for each scenario, learning rate 0 but in
`epochs` (every window is compared against the seeded init); a callback records, at every
`on_pre_optimizer_step`, the window's sample ids and pad flags on each rank and
the gradient DDP left. The parent compares each window's gradient with one
process's per-token mean over the window's samples (each sample alone, unpadded,
its TRL-prepared labels): odb-padded and odb-packed, G=1 (uneven shards: rank 1
runs dry and pads) and G=2 (some completions fully masked, a short last window).

Each gradient check can fail: the normalisations TRL or DDP give without the
loader's scale (each rank's own per-token mean, DDP-averaged; each micro-step's
mean over G) miss the reference by more than 1e-4 on the same samples, and
`per_micro_step`, an ODBSFTTrainer that returns TRL's own loss for the micro-batch
divided by G (the loader's scale dropped), is run and caught.
"""

from __future__ import annotations

import os
import random
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from gloo_ranks import launch_entry, set_rank_env  # noqa: E402
from guards import HANG_GUARD_S  # noqa: E402
from sft_support import MODELS, Reference, flat_grad, rel_l2, tiny_llama  # noqa: E402
from trainer_windows import WindowRecorder  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from odb_core.bench.launch import init_local_gloo, release_child_resources  # noqa: E402
from odb_core.errors import ConfigError  # noqa: E402
from odb_core.integrations.trl import ODBArguments, ODBSFTTrainer  # noqa: E402
from odb_core.torch import pop_step_meta  # noqa: E402

pytestmark = [pytest.mark.torch]

WORLD = 2
TOL = 1e-6
WRONG = 1e-4
WORDS = 124  # w0..w123 after the four special tokens: sft_support's VOCAB of 128


def distributed(test: Any) -> Any:
    """A test that reads the 2-rank launch (one launch for all scenarios: about 40 s
    on 2 busy cores, most of it two processes importing TRL)."""
    return pytest.mark.slow(pytest.mark.procs(test))


# ---- data, tokenizer and trainer (built the same way on every process) --------------------


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `w0 .. w123` and four special tokens, BOS prepended
    (ids as in sft_support: <pad> 0, <s> 1, <unk> 2, </s> 3)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3}
    vocab.update({f"w{i}": 4 + i for i in range(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def prompt_completion(n: int, seed: int, skew: bool = False) -> Any:
    """`n` prompt-completion rows of words, long-tailed lengths; `skew`: even rows
    about three times longer (rank 0's shard of an unshuffled order)."""
    prompts, completions = [], []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        p = min(60, max(2, int(rng.lognormvariate(2.5, 0.7))))
        c = min(40, max(1, int(rng.lognormvariate(2.0, 0.8))))
        if skew and i % 2 == 0:
            p, c = 3 * p, 3 * c
        prompt = [rng.randrange(WORDS) for _ in range(p)]
        completion = [(prompt[-1] * 3 + 1) % WORDS]
        for _ in range(c - 1):  # a learnable chain
            completion.append((completion[-1] * 5 + 7) % WORDS)
        prompts.append(" ".join(f"w{w}" for w in prompt))
        completions.append(" " + " ".join(f"w{w}" for w in completion))
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions})


#: A chat template whose assistant turns are marked for TRL's assistant-only mask.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}</s>{% endgeneration %}{% else %}<s> {{ m['content'] }} {% endif %}"
    "{% endfor %}"
)


def chat_tokenizer() -> PreTrainedTokenizerFast:
    tok = word_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    return tok


def conversations(n: int, seed: int) -> Any:
    """`n` two-turn conversations (user, assistant, user, assistant) from the
    prompt-completion rows: the second user turn's labels are masked mid-sample."""
    rows = prompt_completion(2 * n, seed)
    turns = [
        [
            {"role": "user", "content": rows[i]["prompt"]},
            {"role": "assistant", "content": rows[i]["completion"].strip()},
            {"role": "user", "content": rows[n + i]["prompt"]},
            {"role": "assistant", "content": rows[n + i]["completion"].strip()},
        ]
        for i in range(n)
    ]
    return datasets.Dataset.from_dict({"messages": turns})


def sft_config(out: Path, **extra: Any) -> Any:
    from trl import SFTConfig

    options: dict[str, Any] = {
        "output_dir": str(out),
        "use_cpu": True,
        "bf16": False,  # SFTConfig's default is bf16 autocast
        "report_to": [],
        "disable_tqdm": True,
        "logging_strategy": "no",
        "save_strategy": "no",
        "max_grad_norm": 0.0,
        "weight_decay": 0.0,
        "learning_rate": 0.0,
        "num_train_epochs": 1,
        "seed": 0,
        "ddp_find_unused_parameters": False,
        "max_length": None,
    }
    return SFTConfig(**{**options, **extra})


SCENARIOS: dict[str, dict[str, Any]] = {
    "padded_g1": {
        "data": {"n": 40, "seed": 2, "skew": True},
        "odb": {"token_budget": 512, "cost_model": "padded", "shuffle": False},
        "args": {"gradient_accumulation_steps": 1},
    },
    "padded_g2": {
        "data": {"n": 52, "seed": 3},
        "odb": {"token_budget": 128, "cost_model": "padded", "seed": 11},
        "args": {"gradient_accumulation_steps": 2},
    },
    "packed_g1": {
        "data": {"n": 40, "seed": 4, "skew": True},
        "odb": {"token_budget": 384, "cost_model": "packed", "shuffle": False},
        "args": {"gradient_accumulation_steps": 1, "padding_free": True},
    },
    "packed_g2": {
        "data": {"n": 52, "seed": 5},
        "odb": {"token_budget": 160, "cost_model": "packed", "seed": 13},
        "args": {"gradient_accumulation_steps": 2, "padding_free": True},
    },
}
SCENARIOS["per_micro_step"] = {**SCENARIOS["padded_g2"], "broken": True}
# PEFT LoRA (`sft_support.lora_llama`, on the attention projections) through TRL.
SCENARIOS["packed_g2_lora"] = {**SCENARIOS["packed_g2"], "model": "lora"}
# 2 epochs, a real learning rate, a checkpoint every 2 updates: resumed inside epoch 1.
SCENARIOS["epochs"] = {
    "data": {"n": 64, "seed": 6},
    "odb": {"token_budget": 128, "cost_model": "padded", "seed": 5},
    "args": {
        "gradient_accumulation_steps": 2,
        "learning_rate": 1e-3,
        "num_train_epochs": 2,
        "save_strategy": "steps",
        "save_steps": 2,
    },
}
SAVE_EVERY = 2
# A chat dataset, TRL's chat template and assistant-only loss, packed, G=2.
SCENARIOS["chat_packed_g2"] = {
    "chat": True,
    "data": {"n": 64, "seed": 7},
    "odb": {"token_budget": 256, "cost_model": "packed", "seed": 17},
    "args": {"gradient_accumulation_steps": 2, "padding_free": True, "assistant_only_loss": True},
}
COMMON_ODB = {
    "deterministic": True,
    "buffer_size": 16,
    "max_steps_per_round": 4,
}


class PerMicroStep(ODBSFTTrainer):
    """Broken on purpose: TRL's own loss of the micro-batch (its per-token mean over
    this rank's micro-batch) divided by G, the loader's window scale dropped."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kw: Any) -> Any:
        pop_step_meta(inputs)
        from trl import SFTTrainer

        loss = SFTTrainer.compute_loss(self, model, inputs, return_outputs, None)
        return loss / self.args.gradient_accumulation_steps


def make_trainer(name: str, out: Path, **extra: Any) -> tuple[Any, WindowRecorder]:
    sc = SCENARIOS[name]
    rec = WindowRecorder()
    cls = PerMicroStep if sc.get("broken") else ODBSFTTrainer
    trainer = cls(
        model=MODELS[sc.get("model", "full")](seed=0),
        args=sft_config(out, ddp_backend="gloo", **{**sc["args"], **extra}),
        train_dataset=(conversations if sc.get("chat") else prompt_completion)(**sc["data"]),
        processing_class=chat_tokenizer() if sc.get("chat") else word_tokenizer(),
        odb=ODBArguments(**{**COMMON_ODB, **sc["odb"]}),
        callbacks=[rec],
    )
    rec.trainer = trainer
    return trainer, rec


def _rank_entry(rank: int, world: int, port: int, out: str) -> None:
    set_rank_env(rank, world, port, OMP_NUM_THREADS="1")
    init_local_gloo(rank, world, port, timeout_s=HANG_GUARD_S)
    warnings.simplefilter("ignore")
    try:
        result: dict[str, Any] = {}
        for name in SCENARIOS:
            t0 = time.perf_counter()
            trainer, rec = make_trainer(name, Path(out, name))
            trainer.train()
            prepared = trainer.train_dataset
            result[name] = {
                "windows": rec.windows,
                "samples": [(row["input_ids"], row["labels"]) for row in prepared],
                "collator": type(trainer.data_collator).__name__,
                "padding_free": bool(getattr(trainer.data_collator, "padding_free", False)),
                "time": time.perf_counter() - t0,
            }
        # Resume from the first checkpoint strictly inside epoch 1.
        windows = result["epochs"]["windows"]
        inside = [w["global_step"] + 1 for w in windows if w["epoch"] == 1][:-1]
        step = next(s for s in inside if s % SAVE_EVERY == 0)
        trainer, rec = make_trainer("epochs", Path(out, "resume"), save_strategy="no")
        trainer.train(resume_from_checkpoint=str(Path(out, "epochs", f"checkpoint-{step}")))
        result["resume"] = {"from": step, "windows": rec.windows}
        torch.save(result, Path(out, f"rank{rank}.pt"))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
    release_child_resources()
    os._exit(0)


def launch(out: Path, timeout: float = HANG_GUARD_S) -> list[dict[str, Any]]:
    return launch_entry(_rank_entry, WORLD, out, timeout=timeout)


# ---- the parent's view --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    out = launch(tmp_path_factory.mktemp("trl"))
    times = {k: round(v["time"], 1) for k, v in out[0].items() if "time" in v}
    print(f"\ntrl launch {time.perf_counter() - t0:.1f}s; per run {times}")
    return out


class Prepared(torch.utils.data.Dataset):  # type: ignore[misc]
    """The TRL-prepared samples as sft_support's Reference reads them."""

    def __init__(self, samples: list[tuple[list[int], list[int]]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids, labels = self.samples[i]
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


@pytest.fixture(scope="module")
def refs(ranks: list[dict[str, Any]]) -> dict[str, Reference]:
    models = {kind: build(seed=0) for kind, build in MODELS.items()}
    return {
        name: Reference(models[sc.get("model", "full")], Prepared(ranks[0][name]["samples"]))
        for name, sc in SCENARIOS.items()
    }


def window_ids(ranks: list[dict[str, Any]], name: str, w: int) -> list[int]:
    return [i for r in ranks for ids in r[name]["windows"][w]["ids"] for i in ids]


def rank_means(ref: Reference, ranks: list[dict[str, Any]], name: str, w: int) -> Any:
    """Each rank's per-token mean of its micro-batch, DDP-averaged, summed over the
    window's micro-steps (TRL's loss without num_items_in_batch, no /G)."""
    total = None
    for r in ranks:
        for ids in r[name]["windows"][w]["ids"]:
            g, n = ref.summed(ids)
            if n:
                total = g / n / WORLD if total is None else total + g / n / WORLD
    return total


def per_micro_step_mean(ref: Reference, ranks: list[dict[str, Any]], name: str, w: int) -> Any:
    """Each micro-step normalised by its own global loss tokens, then / G."""
    steps = len(ranks[0][name]["windows"][w]["ids"])
    total = None
    for t in range(steps):
        g, n = ref.summed(i for r in ranks for i in r[name]["windows"][w]["ids"][t])
        if n:
            total = g / n / steps if total is None else total + g / n / steps
    return total


@distributed
def test_trl_prepares_the_data_and_collates_it(ranks: list[dict[str, Any]]) -> None:
    """The samples are TRL's: BOS, prompt labels -100, the completion and EOS kept;
    the collator is TRL's, flattening under padding_free."""
    tok = word_tokenizer()
    for name, sc in SCENARIOS.items():
        run = ranks[0][name]
        assert run["collator"] == "DataCollatorForLanguageModeling"
        assert run["padding_free"] == bool(sc["args"].get("padding_free"))
        if sc.get("chat"):
            continue  # test_assistant_only_labels
        rows = prompt_completion(**sc["data"])
        assert len(run["samples"]) == len(rows)
        for (ids, labels), row in zip(run["samples"], rows, strict=True):
            prompt = tok(row["prompt"])["input_ids"]
            assert ids[: len(prompt)] == prompt and ids[0] == tok.bos_token_id
            assert ids[-1] == tok.eos_token_id
            assert labels[: len(prompt)] == [-100] * len(prompt)
            assert labels[len(prompt) :] == ids[len(prompt) :]


@distributed
def test_assistant_only_labels(ranks: list[dict[str, Any]]) -> None:
    """TRL's chat template and assistant-only mask: the labels kept are exactly the
    two assistant turns, each with its EOS; both user turns are -100."""
    tok = word_tokenizer()
    sc = SCENARIOS["chat_packed_g2"]
    convs = conversations(**sc["data"])
    samples = ranks[0]["chat_packed_g2"]["samples"]
    assert len(samples) == len(convs)
    for (ids, labels), conv in zip(samples, convs, strict=True):
        answers = [m["content"] for m in conv["messages"] if m["role"] == "assistant"]
        want = [t for a in answers for t in [*tok(a, add_special_tokens=False)["input_ids"], 3]]
        assert [x for x in labels if x != -100] == want
        first_user = len(tok(conv["messages"][0]["content"])["input_ids"])
        assert labels[:first_user] == [-100] * first_user and len(ids) > len(want) + first_user


@distributed
@pytest.mark.parametrize(
    "name",
    ["padded_g1", "padded_g2", "packed_g1", "packed_g2", "packed_g2_lora", "chat_packed_g2"],
)
def test_every_window_matches_the_single_process_mean(
    ranks: list[dict[str, Any]], refs: dict[str, Reference], name: str
) -> None:
    run0, run1 = ranks[0][name], ranks[1][name]
    ref = refs[name]
    g = SCENARIOS[name]["args"]["gradient_accumulation_steps"]
    n = SCENARIOS[name]["data"]["n"]
    windows = run0["windows"]
    assert len(windows) == len(run1["windows"])
    seen = sorted(i for w in range(len(windows)) for i in window_ids(ranks, name, w))
    assert seen == list(range(n)), "each sample once in the epoch"
    sizes = [len(w["ids"]) for w in windows]
    assert all(s <= g for s in sizes) and max(sizes) == g
    worst = 0.0
    for w, (a, b) in enumerate(zip(windows, run1["windows"], strict=True)):
        assert rel_l2(b["grad"], a["grad"]) <= 1e-12, "ranks hold different gradients"
        worst = max(worst, rel_l2(a["grad"], ref.mean(window_ids(ranks, name, w))))
    want = ref.mean(window_ids(ranks, name, 0))
    wrong = rel_l2(rank_means(ref, ranks, name, 0), want)
    print(f"[{name}] {len(windows)} windows, max rel L2 {worst:.3g}; rank means {wrong:.3g}")
    assert worst <= TOL < WRONG < wrong
    if g == 1:
        pads = [w for w, b in enumerate(run1["windows"]) if b["pads"][0]]
        assert pads, "rank 1 never padded: the shards are not uneven enough"
    else:
        assert len(windows) >= 4, sizes
        micro = rel_l2(per_micro_step_mean(ref, ranks, name, 0), want)
        print(f"[{name}] window 0, per-micro-step normalisation {micro:.3g}")
        assert micro > WRONG


def packed_rows_grad(ref: Reference, batches: list[list[int]], restart: bool) -> Any:
    """The per-token mean gradient of `batches`, each flattened into one row as TRL's
    padding-free collator does (each sample's first label masked), with position ids
    restarting per sample (`restart`) or running on across the row (one sequence:
    every sample attends to those before it)."""
    model, total, tokens = ref.model, None, 0
    for ids in batches:
        samples = [ref.dataset[i] for i in ids]
        row = torch.cat([s["input_ids"] for s in samples])[None]
        labels = torch.cat([torch.cat([torch.tensor([-100]), s["labels"][1:]]) for s in samples])
        if restart:
            pos = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])[None]
        else:
            pos = torch.arange(row.shape[1])[None]
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=row, position_ids=pos).logits[0]
        ce = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], reduction="sum")
        ce.backward()
        g = flat_grad(model)
        total = g if total is None else total + g
        tokens += int((labels[1:] != -100).sum())
    model.zero_grad(set_to_none=True)
    return total / tokens


@distributed
def test_packed_rows_keep_samples_apart(
    ranks: list[dict[str, Any]], refs: dict[str, Reference]
) -> None:
    """The check can see cross-sample attention: the same rows as one sequence each
    (positions not restarting) miss the reference; with restarts they match it."""
    ref = refs["packed_g1"]
    batches = [r["packed_g1"]["windows"][0]["ids"][0] for r in ranks]
    want = ref.mean(i for b in batches for i in b)
    apart = rel_l2(packed_rows_grad(ref, batches, restart=True), want)
    across = rel_l2(packed_rows_grad(ref, batches, restart=False), want)
    print(f"[packed_g1] rows, positions restarting {apart:.3g}; one sequence {across:.3g}")
    assert apart <= TOL < WRONG < across


@distributed
def test_lora_trains_the_adapter_weights_only(
    ranks: list[dict[str, Any]], refs: dict[str, Reference]
) -> None:
    model = refs["packed_g2_lora"].model
    adapter = torch.cat(
        [torch.full((p.numel(),), "lora_" in n) for n, p in model.named_parameters()]
    )
    for w in ranks[0]["packed_g2_lora"]["windows"]:
        assert (w["grad"][~adapter] == 0).all() and (w["grad"][adapter] != 0).any()


@distributed
def test_two_epochs_each_sample_once_and_resume_inside_epoch_1(
    ranks: list[dict[str, Any]],
) -> None:
    """Every sample once per epoch, the same updates on both ranks; resumed from a
    checkpoint inside epoch 1, the run trains exactly the updates the uninterrupted
    one had from there (the same windows: deterministic, same world size)."""
    n = SCENARIOS["epochs"]["data"]["n"]
    run0, run1 = ranks[0]["epochs"], ranks[1]["epochs"]
    assert [w["global_step"] for w in run0["windows"]] == [
        w["global_step"] for w in run1["windows"]
    ]
    for epoch in (0, 1):
        seen = [
            i
            for r in (run0, run1)
            for w in r["windows"]
            if w["epoch"] == epoch
            for ids in w["ids"]
            for i in ids
        ]
        assert sorted(seen) == list(range(n)), epoch
    for r, full in zip(ranks, (run0, run1), strict=True):
        res = r["resume"]
        assert res["windows"], "the resumed run trained nothing"
        assert res["windows"][0]["global_step"] == res["from"]
        assert [w["ids"] for w in res["windows"]] == [w["ids"] for w in full["windows"]][
            res["from"] :
        ]
        # A resume that restarted epoch 1 (the loader's state not loaded) would differ.
        epoch1 = [w["ids"] for w in full["windows"] if w["epoch"] == 1]
        assert [w["ids"] for w in res["windows"]] != epoch1
    print(f"[resume] from update {ranks[0]['resume']['from']} of {len(run0['windows'])}")


@distributed
def test_the_loss_without_the_loaders_scale_is_caught(
    ranks: list[dict[str, Any]], refs: dict[str, Reference]
) -> None:
    run = ranks[0]["per_micro_step"]
    assert [w["ids"] for w in run["windows"]] == [
        w["ids"] for w in ranks[0]["padded_g2"]["windows"]
    ]
    ref = refs["per_micro_step"]
    err = rel_l2(run["windows"][0]["grad"], ref.mean(window_ids(ranks, "per_micro_step", 0)))
    print(f"[per_micro_step] window 0 rel L2 {err:.3g}")
    assert err > WRONG


# ---- SFTConfig values an ODB run cannot honour ----------------------------------------


def build(tmp_path: Path, odb: dict[str, Any] | None = None, **args: Any) -> Any:
    return ODBSFTTrainer(
        model=tiny_llama(seed=0),
        args=sft_config(tmp_path, **args),
        train_dataset=prompt_completion(8, seed=0),
        processing_class=word_tokenizer(),
        odb=ODBArguments(**{"token_budget": 256, **(odb or {})}),
    )


@pytest.mark.parametrize(
    ("odb", "args", "names"),
    [
        ({}, {"packing": True, "max_length": 128}, ["packing=True", "padding_free=True"]),
        ({}, {"max_length": 512}, ["max_length=512", "token_budget=256", "max_length=None"]),
        (
            {"cost_model": "attention"},
            {"max_length": 256},
            ["max_length=256", "'attention'", "token_budget=256"],
        ),
        ({"cost_model": "packed"}, {"padding_free": True, "max_length": 128}, ["max_length=None"]),
        ({"cost_model": "padded"}, {"padding_free": True}, ["padding_free=True", "'packed'"]),
        ({"cost_model": "packed"}, {}, ["padding_free=False", "cost_model='padded'"]),
    ],
)
def test_a_config_odb_cannot_honour_raises_naming_the_option(
    tmp_path: Path, odb: dict[str, Any], args: dict[str, Any], names: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        build(tmp_path, odb, **args)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_samples_truncation_drops_raise_and_cuts_warn(tmp_path: Path) -> None:
    """TRL truncates to max_length and drops a sample left without a loss token: the
    drop raises naming max_length; samples cut to max_length are warned about; with
    max_length=None nothing is cut (the reference lengths)."""
    tok = word_tokenizer()
    rows = prompt_completion(8, seed=0)
    prompts = [len(tok(r["prompt"])["input_ids"]) for r in rows]
    full = [len(tok(r["prompt"] + r["completion"])["input_ids"]) + 1 for r in rows]  # + EOS
    with pytest.raises(ConfigError, match=r"max_length=4\): TRL's dataset preparation dropped"):
        build(tmp_path, max_length=4)
    cut_at = max(prompts) + 1
    assert cut_at < max(full), "no sample would be cut: the check would be vacuous"
    cut = sum(n >= cut_at for n in full)
    with pytest.warns(UserWarning, match=f"max_length={cut_at}\\): {cut} of 8 samples"):
        build(tmp_path, max_length=cut_at)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        kept = build(tmp_path, max_length=None)
    assert [len(r["input_ids"]) for r in kept.train_dataset] == full


def test_consistent_configs_build(tmp_path: Path) -> None:
    """The checks are not vacuous: the same trainer with consistent options builds."""
    padded = build(tmp_path, {"cost_model": "padded"}, max_length=256)
    assert not padded.data_collator.padding_free
    packed = build(tmp_path, {"cost_model": "packed"}, padding_free=True)
    assert packed.data_collator.padding_free
    lengths = [len(r["input_ids"]) for r in padded.train_dataset]
    assert lengths == [len(r["input_ids"]) for r in packed.train_dataset]


def test_args_must_be_an_sft_config(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    with pytest.raises(ConfigError, match="SFTConfig"):
        ODBSFTTrainer(
            model=tiny_llama(seed=0),
            args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True),
            train_dataset=prompt_completion(4, seed=0),
            processing_class=word_tokenizer(),
            odb=ODBArguments(token_budget=256),
        )


def test_trl_version_gate() -> None:
    """Inside the `[trl]` pin: no warning; outside it: one warning naming the range;
    a TRL without a member the adapter relies on: `ConfigError` naming it."""
    import trl
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from odb_core.integrations import trl as odb_trl
    from odb_core.integrations import versions

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert odb_trl.check_trl_version(trl.__version__)
    with pytest.warns(UserWarning, match="outside the range the odb-core trl adapter"):
        assert not odb_trl.check_trl_version("1.99.0")
    with pytest.raises(ConfigError, match=r"no SFTTrainer\.compute_loss"):
        versions.gate("trl", trl.__version__, {"SFTTrainer": object}, set())
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["trl"]
    (req,) = [Requirement(r) for r in extra if Requirement(r).name == "trl"]
    assert trl.__version__ in req.specifier and trl.__version__ in SpecifierSet(
        odb_trl.SUPPORTED_TRL
    )
