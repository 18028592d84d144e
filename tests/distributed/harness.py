"""Shared pieces of the whole-model multi-process tests: build a wrapped GPT, run a packed
micro-batch, and map TP=1/EP=1 tensors to what this rank holds under another layout."""

from __future__ import annotations

import re

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

import megatron_multilora as mm
from megatron_multilora.ops.fused_rows import DeltaNetRows
from megatron_multilora.validation import TARGETS
from tests.models import with_slots

N, DIM = 4, 8
RANKS, ALPHAS = [8, 3, 1, 5], [16.0, 4.0, 2.0, 10.0]
SEQ = 16


def build(
    cfg: mm.GPTModelConfig,
    sp: bool = False,
    ddp: bool = True,
    fully_sharded: bool = False,
    targets: tuple[str, ...] = TARGETS,
    **config_overrides: object,
):
    """The wrapped model (megatron DDP around it unless ``ddp=False``); same weights each call.
    ``config_overrides``: further megatron TransformerConfig fields."""
    torch.manual_seed(0)  # base weights are drawn as full tensors: same on every build
    model = mm.build_gpt_model(cfg, sequence_parallel=sp, **config_overrides)
    with_slots(model, DIM, RANKS, ALPHAS, fully_sharded=fully_sharded, target_modules=targets)
    if not ddp:
        return model
    return DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )


def micro_batch(seed: int, counts: list[int], vocab: int):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (1, SEQ), generator=gen)
    return ids, labels, counts


def step(model: torch.nn.Module, batch) -> torch.Tensor:
    """Forward+backward one packed micro-batch; returns per-slot mean losses [N]."""
    ids, labels, counts = batch
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    mm.set_tokens_per_adapter_slot(inner, counts)
    token_loss = model(ids, torch.arange(SEQ)[None], None, labels=labels).view(-1)
    per_slot = torch.stack([s.mean() if len(s) else s.sum() for s in token_loss.split(counts)])
    per_slot.sum().backward()  # each adapter's loss normalised by its own tokens
    return per_slot.detach()


def trainable_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by state-dict key: DDP's ``main_grad`` when wrapped, else ``.grad`` (zeros
    for a slot that had no tokens, hence no gradient)."""
    ddp = isinstance(model, DistributedDataParallel)
    inner = model.module if ddp else model
    return {
        k: (p.main_grad if ddp else p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        for k, p in inner.state_dict(keep_vars=True).items()
        if isinstance(p, torch.nn.Parameter) and p.requires_grad
    }


_EXPERT_WEIGHT = re.compile(r"(.*\.experts\.linear_fc[12]\.weight)(\d+)$")


def full_key(key: str, cfg: mm.GPTModelConfig) -> str:
    """The TP=1/EP=1 model's key for this rank's ``key`` (local expert i -> global index)."""
    m = _EXPERT_WEIGHT.match(key)
    if not m:
        return key
    ep = parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * (cfg.num_moe_experts // ep)
    return f"{m.group(1)}{first + int(m.group(2))}"


def local_view(
    key: str, full: dict[str, torch.Tensor], like: torch.Tensor, cfg: mm.GPTModelConfig
) -> torch.Tensor:
    """What this rank holds of the TP=1/EP=1 tensor behind ``key``."""
    tensor = full[full_key(key, cfg)]
    if ".experts." in key and tensor.dim() == 3:  # expert LoRA factor [experts, ...]
        ep, rank = (
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_rank(),
        )
        return tensor.chunk(ep, 0)[rank]
    if not getattr(like, "tensor_model_parallel", False):
        return tensor
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    dim = like.partition_dim
    if key.endswith("conv1d.weight"):  # a Gated DeltaNet's q, k, v channels: part of each
        return torch.cat([tensor[span] for span in DeltaNetRows.of(cfg).channel_spans(rank, tp)])
    if (
        re.search(r"\.mlp\.(shared_experts\.)?linear_fc1\.", key)
        and cfg.gated_linear_unit
        and dim == 0
        and ".linear_in." not in key
    ):  # A's rank rows are not [gate; up]
        # megatron keeps [gate_shard; up_shard] per rank for a gated fc1.
        return torch.cat([h.chunk(tp, 0)[rank] for h in tensor.chunk(2, 0)])
    return tensor.chunk(tp, dim)[rank]


def load_full_state(
    model: torch.nn.Module, full: dict[str, torch.Tensor], cfg: mm.GPTModelConfig
) -> None:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    like = inner.state_dict(keep_vars=True)
    inner.load_state_dict(
        {k: local_view(k, full, v, cfg) if torch.is_tensor(v) else v for k, v in like.items()}
    )
