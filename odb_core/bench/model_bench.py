"""`odb bench --model SIZE`: train a real LlamaForCausalLM on W gloo ranks with DDP,
one epoch per run (`--quality`: several), every strategy on the same data and init,
interleaved (A, B, C, A, B, C, ...), medians over the repeats.

Strategies (all under the same peak-token budget per step and rank):
- `standard`: DataLoader(batch_size=B) + DistributedSampler, padded; B is the
  largest fixed batch whose worst case (B x the longest possible sample) fits;
- `grouped`: HF Trainer's `group_by_length=True` at the same B, with HF's own
  `LengthGroupedSampler` sharded by Accelerate's `BatchSamplerShard`
  (`odb_core.bench.grouped`); its timed length pass is reported apart;
- `gmt`: an offline oracle: a timed length-cache pass over the dataset (reported
  apart), sort longest first, cut at the budget, deal the batches round-robin;
- `trl-packed`: TRL's `packing=True` (best-fit decreasing, `trl.data_utils.
  pack_dataset`) over the same pass's lengths into rows of the budget, one row
  per rank and step, packed like `odb-packed` (`odb_core.bench.trl_packing`); the
  pass and the packing are its precompute; text models only (TRL refuses
  packing for vision datasets);
- `odb-padded`, `odb-packed`: ODBDataLoader with the padded / packed cost model
  (`pad_collate` / `pack_collate`, varlen attention);
- `odb-max-samples`, `odb-max-samples-packed`: `odb-padded` / `odb-packed` with
  `max_samples` the fixed batch size B (the fixed run's steps, each formed from a
  window sorted by cost);
- `odb-ref`: the PyPI package `online-dynamic-batching` (import `odb`), only when
  it is installed, with its README's settings (exact loss scaling, join);
- `odb-sqrt-lr`, `odb-linear-lr`, `odb-parity` (`--quality` only): the documented
  learning-rate recipes (`odb_core.bench.recipes`).

`--quality`: `--epochs` epochs per run, a seed per repeat (init and data order;
`--regime finetune` first trains each seed's init one epoch on another
distribution), held-out loss every 1/4 epoch with its time left out of the
training time, every schedule linear to 0 at the run's last update (fixed-batch
strategies: LambdaLR over their exact step count; odb: `ProgressLR`), and the
time-to-target / held-out-gap summary of `odb_core.bench.quality`.

`--model qwen3-vl-tiny` (docs/VLM.md) adds `grouped-estimate` (LLaVA's
`group_by_modality_length`, no pass); `--lora` trains PEFT adapters only.

Every odb-core run must have equal steps on every rank and every id exactly once;
the bench raises otherwise. The model and the run are CPU-sized by default.
"""

from __future__ import annotations

from typing import Any

from odb_core.bench.model_options import STRATEGIES, odb_ref_missing, validate


def run_bench(params: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Validate, start W rank processes, return rank 0's report (raises on failure)."""
    from odb_core.bench.launch import run_ranks
    from odb_core.bench.model_rank import run_rank

    strategies = validate(params)
    params = {**params, "strategies": strategies}
    ran = run_ranks(
        run_rank,
        params["ranks"],
        params,
        progress,
        timeout=params["timeout"],
        gloo_timeout_s=300,
        prefix="odb-model-bench-",
    )
    if ran.error is not None:
        raise RuntimeError(f"odb bench --model failed: {ran.error}")
    if not ran.ok:
        raise RuntimeError(
            f"odb bench --model: ranks failed or timed out (exit codes {ran.exit_codes})"
        )
    result: dict[str, Any] = ran.result
    missing = odb_ref_missing()
    if missing and "odb-ref" in params.get("requested", STRATEGIES):
        result["notes"].append(f"odb-ref skipped: {missing}")
    return result
