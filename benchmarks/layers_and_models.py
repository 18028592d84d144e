"""Rows 1-3: N slots vs 1 slot, multi-LoRA vs the frozen base, grouped GEMMs vs a naive loop; one
layer and whole models."""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

import megatron_multilora as mm
from benchmarks.report import Results, Row
from benchmarks.settings import Settings
from benchmarks.timing import Clock, medians, time_side_by_side
from benchmarks.workloads import (
    build_model,
    fwd_bwd,
    layer_config,
    model_config,
    slot_and_single_batches,
    timed_model_step,
)
from megatron_multilora.layers.slot_routing import build_expert_slot_routing
from megatron_multilora.models.torch_modules import TorchGroupedLinear
from megatron_multilora.ops.slot_layout import SlotLayout


def dense_layer_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """base, N slots, 1 slot and the naive loop over one frozen column-parallel linear."""
    h, n, tokens = s.layer_hidden, s.slots, s.layer_tokens
    base = ColumnParallelLinear(
        h,
        h,
        config=layer_config(s),
        init_method=torch.nn.init.xavier_normal_,
        bias=False,
        gather_output=False,
        skip_bias_add=True,
    ).to(device)
    base.weight.requires_grad_(False)

    def multi(slots: int) -> mm.MultiLoRALinear:
        layer = mm.MultiLoRALinear(
            base, slots, s.rank, s.alpha, f"bench.dense.{slots}", row_init_method="normal"
        )
        layer.slot_layout = SlotLayout(
            [tokens // slots + (i < tokens % slots) for i in range(slots)]
        )
        return layer

    multi_n, multi_1 = multi(n), multi(1)
    counts = list(multi_n.slot_layout.counts)

    def naive(x: torch.Tensor) -> torch.Tensor:
        y, _ = base(x)
        parts = []
        for slot, seg in zip(multi_n.adapters, torch.split(x.view(-1, h), counts)):
            scale = float(slot.alpha / slot.rank)
            parts.append((seg @ slot.linear_in.weight.t()) @ slot.linear_out.weight.t() * scale)
        return y + torch.cat(parts).view_as(y)

    x = torch.randn(tokens, 1, h, dtype=s.torch_dtype, device=device, requires_grad=True)
    grad = torch.randn(tokens, 1, h, dtype=s.torch_dtype, device=device)
    params_n, params_1 = list(multi_n.adapters.parameters()), list(multi_1.adapters.parameters())
    return {
        "base": fwd_bwd(lambda: base(x), [x], grad, []),
        f"lora-{n}": fwd_bwd(lambda: multi_n(x), [x], grad, params_n),
        "lora-1": fwd_bwd(lambda: multi_1(x), [x], grad, params_1),
        f"naive-{n}": fwd_bwd(lambda: naive(x), [x], grad, params_n),
    }


def moe_layer_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """The same four variants over a grouped expert linear; rows in the dispatcher's
    expert-major order, each row's slot drawn at random."""
    h, n, e, tokens = s.layer_hidden, s.slots, s.experts, s.layer_tokens
    base = TorchGroupedLinear(
        e,
        h,
        h,
        config=layer_config(s),
        init_method=torch.nn.init.xavier_normal_,
        bias=False,
        skip_bias_add=False,
        is_expert=True,
    ).to(device)
    base.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    m_splits = torch.bincount(torch.randint(0, e, (tokens,), generator=gen), minlength=e).tolist()

    def multi(slots: int) -> mm.MultiLoRAGroupedExpertLinear:
        layer = mm.MultiLoRAGroupedExpertLinear(
            base, slots, s.rank, s.alpha, f"bench.moe.{slots}", e, row_init_method="normal"
        )
        slot = torch.randint(0, slots, (tokens,), generator=torch.Generator().manual_seed(1))
        layer.routing = build_expert_slot_routing(
            slot.to(device), m_splits, tuple(range(slots)), slots, e
        )
        return layer

    multi_n, multi_1 = multi(n), multi(1)
    routing = multi_n.routing
    # One (slot, expert, rows) per group of the N-slot routing: what a per-pair loop visits.
    pairs = [
        (routing.slots[g // e], g % e, rows)
        for g, rows in enumerate(
            torch.split(routing.sort_idx, list(routing.segments.host_counts()))
        )
    ]

    def naive(x: torch.Tensor) -> torch.Tensor:
        y, _ = base(x, m_splits)
        delta = torch.zeros_like(y)
        for slot_idx, expert, rows in pairs:
            slot = multi_n.adapters[slot_idx]
            scale = float(slot.alpha / slot.rank)
            mid = x.index_select(0, rows) @ slot.linear_in.weight[expert].t()
            delta = delta.index_add(0, rows, (mid @ slot.linear_out.weight[expert].t()) * scale)
        return y + delta

    x = torch.randn(tokens, h, dtype=s.torch_dtype, device=device, requires_grad=True)
    grad = torch.randn(tokens, h, dtype=s.torch_dtype, device=device)
    params_n, params_1 = list(multi_n.adapters.parameters()), list(multi_1.adapters.parameters())
    return {
        "base": fwd_bwd(lambda: base(x, m_splits), [x], grad, []),
        f"lora-{n}": fwd_bwd(lambda: multi_n(x, m_splits), [x], grad, params_n),
        "lora-1": fwd_bwd(lambda: multi_1(x, m_splits), [x], grad, params_1),
        f"naive-{n}": fwd_bwd(lambda: naive(x), [x], grad, params_n),
    }


def model_variants(kind: str, s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """base, N slots and 1 slot over the same packed tokens of a whole GPT."""
    cfg = model_config(kind, s)
    many, one = slot_and_single_batches(s, cfg.vocab_size, device)
    base, multi_n, multi_1 = (
        build_model(cfg, s, None),
        build_model(cfg, s, s.slots),
        build_model(cfg, s, 1),
    )
    return {
        "base": timed_model_step(base, many),
        f"lora-{s.slots}": timed_model_step(multi_n, many),
        "lora-1": timed_model_step(multi_1, one),
    }


def timing_rows(
    group: str, kind: str, s: Settings, med: dict[str, float], naive: bool
) -> list[Row]:
    """Rows 1, 2 (and 3 for layers) of one group of timed variants, in ms."""
    n = s.slots
    index = {"layer dense": "a", "layer MoE": "b", "model dense": "c", "model MoE": "d"}[group]
    lora, rows = f"lora-{n}", []
    rows.append(
        Row(
            f"1{index}",
            f"{group}: {n} slots vs 1 slot",
            (
                f"{kind} step with the same tokens spread over {n} adapter slots vs all in 1 slot "
                "(what training many adapters at once costs over one)"
            ),
            f"{n} slots",
            "1 slot",
            "ms",
        )
    )
    leaf = "the embedding output" if group.startswith("model") else "the layer input"
    rows.append(
        Row(
            f"2{index}",
            f"{group}: multi-LoRA vs frozen base",
            (
                f"{kind} step with {n} slots vs the same step without adapters: all weights frozen "
                f"and {leaf} requiring grad, so backward computes input gradients through every "
                "frozen layer but no weight gradients"
            ),
            f"{n} slots",
            "base",
            "ms",
        )
    )
    rows[0].fill(med[lora] * 1e3, med["lora-1"] * 1e3)
    rows[1].fill(med[lora] * 1e3, med["base"] * 1e3)
    if naive:
        unit = "(slot, expert) pair" if "MoE" in group else "slot"
        rows.append(
            Row(
                f"3{index}",
                f"{group}: grouped GEMMs vs naive loop",
                (
                    f"{kind} step with {n} slots: the grouped LoRA GEMMs vs the base plus a Python loop "
                    f"of two matmuls per {unit} (PEFT-style)"
                ),
                "grouped",
                "naive loop",
                "ms",
            ).fill(med[lora] * 1e3, med[f"naive-{n}"] * 1e3)
        )
    return rows


def section_layers_models(
    section: str, s: Settings, device: torch.device, clock: Clock, out: Results
) -> None:
    for group, kind, make, naive in (
        ("layer dense", "one column-parallel linear's", dense_layer_variants, True),
        ("layer MoE", "one grouped expert linear's", moe_layer_variants, True),
        ("model dense", "dense GPT", lambda s_, d: model_variants("dense", s_, d), False),
        ("model MoE", "MoE GPT", lambda s_, d: model_variants("moe", s_, d), False),
    ):
        if ("layers" if group.startswith("layer") else "models") != section:
            continue
        clock.say(f"{group}: building")
        out.samples[group] = time_side_by_side(clock, group, make(s, device), s.rounds, s.warmup)
        out.rows += timing_rows(group, kind, s, medians(out.samples[group]), naive)
