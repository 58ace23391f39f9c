"""Each trainer extra alone builds its trainer (`make extras-check`, run by CI).

`python tools/extras_check.py [EXTRA ...]` builds odb-core's wheel once, then for
each extra makes a fresh venv under `.venv-extras/<extra>`, installs
`odb-core[torch,<extra>]` and nothing else, and runs this file there with
`--build <extra>`: it builds that extra's trainer on a tiny model made from a
config (no download) and runs one optimizer update. A missing dependency of the
trainer (HF's Trainer without accelerate, say) fails the check, which the full
test venv, holding every extra, cannot see.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("hf", "accelerate", "lightning", "trl", "peft", "vlm")


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def _token_rows(n: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": [1, *range(3, 8 + i % 5), 2]} for i in range(n)]


def _hf_args(out: str, **kwargs: Any) -> dict[str, Any]:
    return {
        "output_dir": out,
        "report_to": [],
        "use_cpu": True,
        "max_steps": 1,
        "save_strategy": "no",
        **kwargs,
    }


def build_hf(out: str) -> None:
    from transformers import Trainer, TrainingArguments

    from odb_core.integrations.hf import ODBHFTrainer
    from odb_core.torch import pad_collate

    args = TrainingArguments(**_hf_args(out))
    Trainer(model=_llama(), args=args, train_dataset=_even_rows(8)).train()
    trainer = ODBHFTrainer(
        model=_llama(),
        args=args,
        train_dataset=[_as_tensors(r) for r in _token_rows(8)],
        data_collator=functools.partial(pad_collate, pad_token_id=0),
        odb={"token_budget": 64},
    )
    trainer.train()
    trainer.close_odb_loader()


def _even_rows(n: int) -> list[dict[str, Any]]:
    """Rows of one length, for the default collator of a plain Trainer."""
    return [_as_tensors({"input_ids": [1, 3 + i % 5, 4, 5, 2]}) for i in range(n)]


def _as_tensors(row: dict[str, Any]) -> dict[str, Any]:
    import torch

    ids = torch.tensor(row["input_ids"])
    return {"input_ids": ids, "labels": ids.clone()}


def build_accelerate(out: str) -> None:
    import torch
    from accelerate import Accelerator

    from odb_core.integrations.accelerate import prepare_odb_loader
    from odb_core.torch import ODBDataLoader, pad_collate

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rows = [_as_tensors(r) for r in _token_rows(8)]
    loader = ODBDataLoader(rows, token_budget=64, collate_fn=pad_collate, cost_model="padded")
    train = prepare_odb_loader(accelerator, loader)
    for batch in train:
        logits = model(batch["input_ids"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        break
    loader.close()


def build_lightning(out: str) -> None:
    import lightning
    import torch

    class Tiny(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    import odb_core.integrations.lightning  # noqa: F401  (its version check)

    data = torch.utils.data.TensorDataset(torch.randn(4, 4))
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2))


def build_trl(out: str) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    trainer = SFTTrainer(
        model=_llama(),
        args=SFTConfig(**_hf_args(out), max_length=32),
        train_dataset=Dataset.from_list(_token_rows(8)),
        processing_class=_tokenizer(),
    )
    trainer.train()
    from odb_core.integrations.trl import ODBSFTTrainer

    odb = ODBSFTTrainer(
        model=_llama(),
        args=SFTConfig(**_hf_args(out), max_length=32),
        train_dataset=Dataset.from_list(_token_rows(8)),
        processing_class=_tokenizer(),
        odb={"token_budget": 64},
    )
    odb.train()
    odb.close_odb_loader()


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 64)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def build_peft(out: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    model = get_peft_model(_llama(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(**_hf_args(out))
    Trainer(model=model, args=args, train_dataset=_even_rows(8)).train()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trained or not all("lora_" in n for n in trained):
        raise SystemExit(f"peft: expected only LoRA weights to train, got {trained}")


def build_vlm(out: str) -> None:
    """`odb bench --model qwen3-vl-tiny`'s parts: images decoded and processed by
    Qwen-VL's own processor, the chat template, transformers' Qwen3-VL; one update."""
    import torch

    from odb_core.bench.vlm_workload import VLMWorkload

    workload = VLMWorkload("qwen3-vl-tiny", max_len=2048)
    data = workload.dataset(4, seed=0)
    model = workload.model(seed=0)
    batch = workload.eval_batch([data[i] for i in range(len(data))])
    if "pixel_values" not in batch:
        raise SystemExit("vlm: the first 4 samples of the mix hold no image")
    loss = model(**batch).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()


BUILDERS = {
    "hf": build_hf,
    "accelerate": build_accelerate,
    "lightning": build_lightning,
    "trl": build_trl,
    "peft": build_peft,
    "vlm": build_vlm,
}


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, cwd=ROOT)


def check(extras: list[str], venvs: Path) -> None:
    with tempfile.TemporaryDirectory() as wheels:
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, str(ROOT)])
        (wheel,) = Path(wheels).glob("odb_core-*.whl")
        for extra in extras:
            start = time.monotonic()
            venv = venvs / extra
            shutil.rmtree(venv, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(venv)])
            python = str(venv / "bin" / "python")
            _run([python, "-m", "pip", "install", "-q", f"{wheel}[torch,{extra}]"])
            _run([python, str(Path(__file__).resolve()), "--build", extra])
            print(
                f"extras-check: [torch,{extra}] alone builds its trainer "
                f"({time.monotonic() - start:.0f} s)",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extras", nargs="*", choices=[*EXTRAS, []], help="default: all")
    parser.add_argument("--build", choices=EXTRAS, help="build one extra's trainer here")
    parser.add_argument("--venvs", type=Path, default=ROOT / ".venv-extras")
    args = parser.parse_args()
    if args.build is None:
        check(args.extras or list(EXTRAS), args.venvs)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with tempfile.TemporaryDirectory() as out:
        BUILDERS[args.build](out)
    print(f"extras-check: {args.build}: trainer built and stepped", flush=True)


if __name__ == "__main__":
    main()
