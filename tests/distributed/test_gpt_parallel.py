"""A whole small GPT with all four targets wrapped: TP=2 (SP off/on, default and fully
sharded) and DP=2 against TP=1.

The reference run is TP=1 on the same weights; gradients go through megatron's
DistributedDataParallel and finalize_model_grads, the path training uses (it sums the
sequence-parallel partial gradients and averages over data-parallel ranks).
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

import megatron_multilora as mm
from megatron_multilora.layers.factors import A
from megatron_multilora.models.gpt_config import DeltaNetConfig
from megatron_multilora.training.step.grad_sync import SlotGradSync
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from megatron_multilora.validation import TARGETS
from tests.distributed.conftest import assert_all_ranks, compare
from tests.distributed.harness import (
    ALPHAS,
    DIM,
    RANKS,
    N,
    build,
    load_full_state,
    local_view,
    micro_batch,
    step,
    trainable_grads,
)
from tests.models import tiny_gpt

CFG = tiny_gpt(
    gated_linear_unit=True,
)
COUNTS = [5, 0, 7, 4]  # a zero-token slot; slot 2 spans the SP window boundary
REL = 2e-5


def reference(layout, targets=TARGETS, cfg=CFG):
    layout(tp=1)
    ddp = build(cfg, targets=targets)
    with torch.no_grad():  # attention sinks (zero as built): a value per head
        for name, p in ddp.module.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.linspace(-2.0, 2.0, p.numel()))
    state = {k: v.clone() for k, v in ddp.module.state_dict().items() if torch.is_tensor(v)}
    ddp.zero_grad_buffer()
    losses = step(ddp, micro_batch(0, COUNTS, cfg.vocab_size))
    finalize_model_grads([ddp])
    grads = trainable_grads(ddp)
    mm.destroy_parallel()
    return state, losses, grads


@pytest.mark.parametrize(
    ("sp", "fully", "targets"),
    [
        (False, False, TARGETS),
        (False, True, TARGETS),
        (True, False, TARGETS),
        (True, True, TARGETS),
        (True, False, (*TARGETS, "output_layer")),  # the output layer too (vocab-parallel)
    ],
    ids=[
        "sp_off-default",
        "sp_off-fully_sharded",
        "sp_on-default",
        "sp_on-fully_sharded",
        "sp_on-unembed",
    ],
)
def test_tp2_gpt_matches_tp1(layout, sp, fully, targets):
    state, ref_losses, ref_grads = reference(layout, targets)
    layout(tp=2, sp=sp)
    ddp = build(CFG, sp, fully_sharded=fully, targets=targets)
    load_full_state(ddp, state, CFG)
    ddp.zero_grad_buffer()
    losses = step(ddp, micro_batch(0, COUNTS, CFG.vocab_size))
    finalize_model_grads([ddp])
    failures: list[str] = []
    compare(failures, losses, ref_losses, REL, "per-slot loss")
    like = ddp.module.state_dict(keep_vars=True)
    grads = trainable_grads(ddp)
    if set(grads) != set(ref_grads):
        failures.append(f"trainable sets differ: {sorted(set(grads) ^ set(ref_grads))[:4]}")
    for k, g in grads.items():
        compare(failures, g, local_view(k, ref_grads, like[k], CFG), REL, k)
    # The clipping norm (every shard counted once, on every rank), from the step's gradient
    # matrices holding DDP's gradients.
    ddp_grads = [[p.main_grad.clone() for p in mm.slot_parameters(ddp.module, i)] for i in range(N)]
    sync = SlotGradSync(SlotAdamW.of(ddp.module).rows)
    for i in range(N):
        for p, g in zip(mm.slot_parameters(ddp.module, i), ddp_grads[i]):
            p.main_grad.copy_(g)
    norms = sync.norms()
    for i in range(N):
        want = torch.stack(
            [g.norm() for k, g in ref_grads.items() if f".adapters.{i}." in k]
        ).norm()
        compare(failures, norms[i], want, REL, f"slot {i} grad norm")
    assert_all_ranks(failures)


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_tp2_attention_sinks_and_a_window_match_tp1(layout, sp):
    """gpt-oss's attention: a learned sink per head (split with the heads) and a window
    shorter than the sequence."""
    cfg = dataclasses.replace(CFG, softmax_type="learnable", sliding_window=4)
    state, ref_losses, ref_grads = reference(layout, cfg=cfg)
    assert any(k.endswith("softmax_offset") and v.abs().sum() > 0 for k, v in state.items())
    check_tp2_against(layout, cfg, sp, state, ref_losses, ref_grads)


def check_tp2_against(layout, cfg, sp, state, ref_losses, ref_grads) -> None:
    """TP=2 on the reference's weights: its per-slot losses and every trainable gradient."""
    layout(tp=2, sp=sp)
    ddp = build(cfg, sp)
    load_full_state(ddp, state, cfg)
    ddp.zero_grad_buffer()
    losses = step(ddp, micro_batch(0, COUNTS, cfg.vocab_size))
    finalize_model_grads([ddp])
    failures: list[str] = []
    compare(failures, losses, ref_losses, REL, "per-slot loss")
    like = ddp.module.state_dict(keep_vars=True)
    for k, g in trainable_grads(ddp).items():
        compare(failures, g, local_view(k, ref_grads, like[k], cfg), REL, k)
    assert_all_ranks(failures)


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_tp2_delta_net_and_gated_attention_match_tp1(layout, sp):
    """Qwen3.5's layers: a Gated DeltaNet (its key heads, their value heads, convolution
    channels, decays and gated norm split over TP; in_proj and out_proj adapted through the
    default targets), then attention with an output gate per head."""
    cfg = dataclasses.replace(
        CFG,
        layer_types=["linear_attention", "full_attention"],
        linear_attention=DeltaNetConfig(2, 4, 8, 12, 4),
        attention_output_gate=True,
        rotary_percent=0.25,
    )
    state, ref_losses, ref_grads = reference(layout, cfg=cfg)
    assert any(".in_proj.adapters." in k for k in ref_grads)
    check_tp2_against(layout, cfg, sp, state, ref_losses, ref_grads)


def test_dp2_grads_equal_one_process_on_both_micro_batches(layout):
    layout(tp=1)  # world 2: DP=2
    dp_rank = parallel_state.get_data_parallel_rank()
    batches = [
        micro_batch(10, [9, 0, 3, 4], CFG.vocab_size),
        micro_batch(11, [0, 6, 6, 4], CFG.vocab_size),
    ]

    ref = build(CFG, ddp=False)
    for batch in batches:  # one process, both micro-batches, gradients averaged
        step(ref, batch)
    want = {k: g / 2 for k, g in trainable_grads(ref).items()}

    ddp = build(CFG)
    ddp.zero_grad_buffer()
    step(ddp, batches[dp_rank])
    finalize_model_grads([ddp])
    failures: list[str] = []
    for k, g in trainable_grads(ddp).items():
        compare(failures, g, want[k], REL, k)
    assert_all_ranks(failures)


@pytest.mark.parametrize("fully", [False, True], ids=["default", "fully_sharded"])
def test_dist_checkpoint_saved_at_tp1_loads_at_tp2(layout, tmp_path, fully):
    """Base and adapter tensors reshard through megatron's dist_checkpointing, into either
    TP mode."""
    layout(tp=1)
    path = [str(tmp_path)]
    dist.broadcast_object_list(path, src=0)  # one folder for all ranks
    model = build(CFG, ddp=False)
    full = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    dist_checkpointing.save(model.sharded_state_dict(), path[0])
    mm.destroy_parallel()

    layout(tp=2)
    torch.manual_seed(99)  # different weights until the checkpoint loads
    model = mm.apply_multi_lora(mm.build_gpt_model(CFG), N, DIM, 1.0, fully_sharded=fully)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path[0]))
    like = model.state_dict(keep_vars=True)
    failures = [
        k
        for k, v in full.items()
        if not torch.equal(like[k].detach(), local_view(k, full, like[k], CFG))
    ]
    want = torch.tensor(ALPHAS) / torch.tensor(RANKS)
    if any(not torch.equal(layer.adapters.scale, want) for layer in mm.multi_lora_modules(model)):
        failures.append(
            f"slot scales not restored: {mm.multi_lora_modules(model)[0].adapters.scale}"
        )
    assert_all_ranks(failures)


def test_fully_sharded_checkpoint_and_export_equal_default_mode(layout, tmp_path):
    """A fully sharded TP=2 model saves a checkpoint the default TP=1 layout loads exactly,
    exports the same adapters, and masks a newly bound rank on the right global rank rows
    (A's rank dim is split over TP ranks)."""
    from megatron_multilora.layers.lifecycle import named_multi_lora_modules
    from megatron_multilora.layers.slot_tensors import get_slot_tensors

    layout(tp=1)
    path = [str(tmp_path)]
    dist.broadcast_object_list(path, src=0)
    want = [get_slot_tensors(build(CFG, ddp=False), i) for i in range(N)]
    mm.destroy_parallel()

    layout(tp=2)
    model = build(CFG, ddp=False, fully_sharded=True)
    failures: list[str] = []
    for i in range(N):
        got = get_slot_tensors(model, i)
        failures += [f"slot {i} export {k}" for k in want[i] if not torch.equal(got[k], want[i][k])]
    mm.clear_adapter_slot(model, 0, init_key="fresh")
    mm.init_adapter_slot(model, 0, 3, 6.0)
    for path_name, layer in named_multi_lora_modules(model):
        a = layer.tp_layout.gather(A, layer.adapters[0].linear_in.weight.detach())
        if layer.tp_layout.rank_is_split and not (a[3:].abs().sum() == 0 and a[:3].abs().sum() > 0):
            failures.append(f"{path_name}: rank 3 not masked on the global rank rows")
    rank_split = [layer.tp_layout.rank_is_split for layer in mm.multi_lora_modules(model)]
    if not any(rank_split):
        failures.append("no layer splits A's rank dim: the test does not test fully sharded")
    exported = get_slot_tensors(model, 0)
    dist_checkpointing.save(model.sharded_state_dict(), path[0])
    mm.destroy_parallel()

    layout(tp=1)
    torch.manual_seed(99)
    model = mm.apply_multi_lora(mm.build_gpt_model(CFG), N, DIM, 1.0)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path[0]))
    loaded = get_slot_tensors(model, 0)
    failures += [f"checkpoint {k}" for k in exported if not torch.equal(loaded[k], exported[k])]
    assert_all_ranks(failures)
