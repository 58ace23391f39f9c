"""Accelerator step-time, memory and collective models, from public figures.

Every parameter is a field with a default from docs/SIMULATOR.md (which gives the
source of each value) and is settable on the `odb simulate` command line. Nothing
here is fitted to a throughput target.

Step time of one DDP step (all ranks synchronise in the gradient all-reduce):

    gpu_r      = max(launch_floor, flops(batch_r) / achieved(tokens_r))
    step_time  = max_r gpu_r + exposed_allreduce + optimizer

with flops(batch) = c * (N * T + L * d * sum(len^2)), c = 6 (fwd + bwd) or 8 with
activation checkpointing (one more forward); T counts padded tokens for padded
batches. Achieved throughput is peak * mfu * min(1, hbm_bw * AI(T) / peak), the
roofline of a [T x d] x [d x d] GEMM, so small batches under-fill the accelerator.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from odb_core.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Accelerator:
    name: str = "h100"
    peak_flops: float = 989.4e12  # dense BF16 tensor-core peak, FLOP/s
    hbm_bytes: float = 80 * GB
    hbm_bw: float = 3.35e12  # bytes/s
    mfu: float = 0.40  # model FLOPs utilisation at saturation
    launch_floor_s: float = 9e-3  # ~2,300 kernels x ~4 us CPU launch each
    # NCCL all-reduce bus bandwidth at large sizes (nccl-tests busbw): 8 GPUs on
    # NVLink 4 / NVSwitch, and 2 such nodes with 8 x 400 Gb/s InfiniBand NDR each.
    nvlink_busbw: float = 460 * GB
    internode_busbw: float = 400 * GB

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "name":
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"accelerator {f.name}={v!r} must be a finite number > 0")
        if self.mfu > 1:
            raise ConfigError(f"accelerator mfu={self.mfu!r} must be <= 1")


ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(),
    # The ODB paper's hardware: H20 (96 GB HBM3, 4.0 TB/s, 148 TFLOPS dense BF16, NVLink 900 GB/s).
    "h20": Accelerator(name="h20", peak_flops=148e12, hbm_bytes=96 * GB, hbm_bw=4.0e12),
}


@dataclass(frozen=True)
class ModelSpec:
    """A 2B-parameter VLM (Qwen3-VL-2B class: 28 layers, d_model 2,048, vocab 151,936)."""

    params: float = 2.0e9
    layers: int = 28
    d_model: int = 2048
    vocab: int = 151_936
    activation_checkpointing: bool = True
    # Bytes per parameter of weights + grads + Adam state (mixed precision, ZeRO paper: 16).
    state_bytes_per_param: float = 16.0
    # Optimizer step traffic: fused AdamW reads and writes ~32 bytes per parameter.
    optimizer_bytes_per_param: float = 32.0
    # Gradient all-reduce payload per parameter (bf16 gradient communication).
    grad_bytes_per_param: float = 2.0
    # CUDA context, allocator fragmentation, workspace.
    reserved_bytes: float = 8 * GB
    # PyTorch DDP default bucket_cap_mb=25: the last bucket is never overlapped.
    last_bucket_bytes: float = 25 * 2**20

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "activation_checkpointing":
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"model {f.name}={v!r} must be a finite number > 0")

    @property
    def flops_factor(self) -> float:
        return 8.0 if self.activation_checkpointing else 6.0

    @property
    def activation_bytes_per_token(self) -> float:
        """Korthikanti et al. 2022: 34*d bytes per token per layer with flash attention
        (no s^2 term); with full checkpointing only each layer's 2*d-byte input is kept,
        plus one layer recomputed at a time. Logits: bf16 logits + fp32 loss copy."""
        per_layer = 34 * self.d_model
        if self.activation_checkpointing:
            body = self.layers * 2 * self.d_model + per_layer
        else:
            body = self.layers * per_layer
        return float(body + self.vocab * (2 + 4))


@dataclass(frozen=True)
class Network:
    """Latency/bandwidth (alpha-beta) model of the two kinds of collective.

    ODB's round all-gather runs on a gloo (TCP) group: ring all-gather, (W-1) hops of
    alpha + bytes/beta. The gradient all-reduce runs on NCCL: ring, 2(W-1)/W * bytes /
    busbw + 2(W-1) * alpha_nccl.
    """

    nodes: int = 1
    gloo_alpha_s: float = 25e-6  # per hop, TCP within a node
    gloo_alpha_internode_s: float = 60e-6  # per hop that crosses nodes
    gloo_beta: float = 1.0 * GB  # bytes/s of one TCP stream
    nccl_alpha_s: float = 5e-6
    nccl_alpha_internode_s: float = 15e-6
    collective_timeout_s: float = 600.0  # torch.distributed NCCL default (10 min)

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ConfigError(f"nodes={self.nodes!r} must be an integer >= 1")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "nodes" and not (math.isfinite(v) and v > 0):
                raise ConfigError(f"network {f.name}={v!r} must be a finite number > 0")

    def allgather_s(self, world: int, bytes_per_rank: int) -> float:
        if world <= 1:
            return 0.0
        hops = world - 1
        cross = min(hops, self.nodes - 1) if self.nodes > 1 else 0
        per_hop = bytes_per_rank / self.gloo_beta
        return (hops - cross) * (self.gloo_alpha_s + per_hop) + cross * (
            self.gloo_alpha_internode_s + per_hop
        )


@dataclass(frozen=True)
class HardwareModel:
    accelerator: Accelerator = Accelerator()
    model: ModelSpec = ModelSpec()
    network: Network = Network()

    @property
    def free_activation_bytes(self) -> float:
        m = self.model
        return self.accelerator.hbm_bytes - m.params * m.state_bytes_per_param - m.reserved_bytes

    @property
    def token_capacity(self) -> int:
        """Tokens one step can hold in memory before OOM."""
        free = self.free_activation_bytes
        if free <= 0:
            raise ConfigError(
                f"model state ({self.model.params:.3g} params x {self.model.state_bytes_per_param}"
                f" B) does not fit in {self.accelerator.hbm_bytes / GB:g} GB of HBM"
            )
        return int(free // self.model.activation_bytes_per_token)

    def default_budget(self) -> int:
        """A token budget a practitioner would set: memory capacity rounded down to 1,024."""
        cap = self.token_capacity
        return max(1024, cap - cap % 1024)

    def achieved_flops(self, tokens: float) -> float:
        a, d = self.accelerator, self.model.d_model
        ai = tokens * d / (2 * tokens + d) if tokens > 0 else 0.0  # FLOP per byte, bf16 GEMM
        return a.peak_flops * a.mfu * min(1.0, a.hbm_bw * ai / a.peak_flops)

    def compute_s(self, tokens: float, sum_sq: float) -> float:
        """GPU time of forward + backward for `tokens` (padded if padded) and sum(len^2)."""
        if tokens <= 0:
            return self.accelerator.launch_floor_s
        m = self.model
        flops = m.flops_factor * (m.params * tokens + m.layers * m.d_model * sum_sq)
        return max(self.accelerator.launch_floor_s, flops / self.achieved_flops(tokens))

    def backward_fraction(self) -> float:
        # Backward is 2 of the 3 forward-equivalents (plus the recomputed forward).
        return 6.0 / 8.0 if self.model.activation_checkpointing else 4.0 / 6.0

    def allreduce_s(self, world: int) -> float:
        if world <= 1:
            return 0.0
        m, a, net = self.model, self.accelerator, self.network
        payload = m.params * m.grad_bytes_per_param
        busbw = a.internode_busbw if net.nodes > 1 else a.nvlink_busbw
        alpha = net.nccl_alpha_internode_s if net.nodes > 1 else net.nccl_alpha_s
        return 2 * (world - 1) / world * payload / busbw + 2 * (world - 1) * alpha

    def last_bucket_s(self) -> float:
        a, net = self.accelerator, self.network
        busbw = a.internode_busbw if net.nodes > 1 else a.nvlink_busbw
        return self.model.last_bucket_bytes / busbw

    def optimizer_s(self) -> float:
        m = self.model
        return m.params * m.optimizer_bytes_per_param / self.accelerator.hbm_bw

    def fits_memory(self, tokens_in_memory: int) -> bool:
        return tokens_in_memory <= self.token_capacity

    def describe(self) -> dict[str, Any]:
        return {
            "accelerator": asdict(self.accelerator),
            "model": asdict(self.model),
            "network": asdict(self.network),
            "derived": {
                "token_capacity": self.token_capacity,
                "activation_bytes_per_token": self.model.activation_bytes_per_token,
                "optimizer_s": round(self.optimizer_s(), 6),
                "launch_floor_s": self.accelerator.launch_floor_s,
            },
        }


def make_hardware(
    gpu: str = "h100",
    nodes: int = 1,
    overrides: dict[str, float | bool] | None = None,
) -> HardwareModel:
    """Build a HardwareModel from a preset plus `field=value` overrides (any field of
    Accelerator, ModelSpec or Network)."""
    if gpu not in ACCELERATORS:
        raise ConfigError(f"unknown gpu {gpu!r}; expected one of {', '.join(ACCELERATORS)}")
    acc, model, net = ACCELERATORS[gpu], ModelSpec(), Network(nodes=nodes)
    groups: list[dict[str, Any]] = [{}, {}, {}]
    names = [{f.name for f in fields(x)} for x in (acc, model, net)]
    for key, value in (overrides or {}).items():
        for i, known in enumerate(names):
            if key in known and key not in ("name", "nodes"):
                groups[i][key] = value
                break
        else:
            raise ConfigError(f"unknown hardware parameter {key!r}")
    return HardwareModel(
        replace(acc, **groups[0]), replace(model, **groups[1]), replace(net, **groups[2])
    )


def hardware_parameters() -> dict[str, tuple[type, Any]]:
    """Every tunable hardware parameter with its type and default, for the CLI."""
    out: dict[str, tuple[type, Any]] = {}
    for obj in (Accelerator(), ModelSpec(), Network()):
        for f in fields(obj):
            if f.name in ("name", "nodes"):
                continue
            v = getattr(obj, f.name)
            out[f.name] = (type(v), v)
    return out
