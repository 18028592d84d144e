"""A whole small GPT with all four targets wrapped: TP=2 (SP off/on) and DP=2 against TP=1.

The reference run is TP=1 on the same weights; gradients go through megatron's
DistributedDataParallel and finalize_model_grads, the path training uses (it sums the
sequence-parallel partial gradients and averages over data-parallel ranks).
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

import megatron_multilora as mm
from tests.distributed.conftest import assert_all_ranks, compare
from tests.distributed.harness import (ALPHAS, DIM, N, RANKS, build, load_full_state, local_view,
                                       micro_batch, step, trainable_grads)

CFG = mm.GPTModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=48, vocab_size=64, gated_linear_unit=True)
COUNTS = [5, 0, 7, 4]   # a zero-token slot; slot 2 spans the SP window boundary
REL = 2e-5


def reference(layout):
    layout(tp=1)
    ddp = build(CFG)
    state = {k: v.clone() for k, v in ddp.module.state_dict().items() if torch.is_tensor(v)}
    ddp.zero_grad_buffer()
    losses = step(ddp, micro_batch(0, COUNTS, CFG.vocab_size))
    finalize_model_grads([ddp])
    grads = trainable_grads(ddp)
    mm.destroy_parallel()
    return state, losses, grads


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_tp2_gpt_matches_tp1(layout, sp):
    state, ref_losses, ref_grads = reference(layout)
    layout(tp=2, sp=sp)
    ddp = build(CFG, sp)
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
    assert_all_ranks(failures)


def test_dp2_grads_equal_one_process_on_both_micro_batches(layout):
    layout(tp=1)  # world 2: DP=2
    dp_rank = parallel_state.get_data_parallel_rank()
    batches = [micro_batch(10, [9, 0, 3, 4], CFG.vocab_size),
               micro_batch(11, [0, 6, 6, 4], CFG.vocab_size)]

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


def test_dist_checkpoint_saved_at_tp1_loads_at_tp2(layout, tmp_path):
    """Base and adapter tensors reshard through megatron's dist_checkpointing."""
    path = [str(tmp_path)]
    dist.broadcast_object_list(path, src=0)  # one folder for all ranks
    layout(tp=1)
    model = build(CFG, ddp=False)
    full = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    dist_checkpointing.save(model.sharded_state_dict(), path[0])
    mm.destroy_parallel()

    layout(tp=2)
    torch.manual_seed(99)  # different weights until the checkpoint loads
    model = mm.apply_multi_lora(mm.build_gpt_model(CFG), N, DIM, 1.0)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path[0]))
    like = model.state_dict(keep_vars=True)
    failures = [k for k, v in full.items()
                if not torch.equal(like[k].detach(), local_view(k, full, like[k], CFG))]
    want = torch.tensor(ALPHAS) / torch.tensor(RANKS)
    if any(not torch.equal(layer.scale, want) for layer in mm.multi_lora_modules(model)):
        failures.append(f"slot scales not restored: {mm.multi_lora_modules(model)[0].scale}")
    assert_all_ranks(failures)
