"""A whole small GPT with all four targets wrapped: TP=2 (SP off/on) and DP=2 against TP=1.

The reference run is TP=1 on the same weights; gradients go through megatron's
DistributedDataParallel and finalize_model_grads, the path training uses (it sums the
sequence-parallel partial gradients and averages over data-parallel ranks).
"""

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

import megatron_multilora as mm
from tests.distributed.conftest import assert_all_ranks, compare

CFG = mm.GPTModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=48, vocab_size=64, gated_linear_unit=True)
N, DIM = 4, 8
RANKS, ALPHAS = [8, 3, 1, 5], [16.0, 4.0, 2.0, 10.0]
SEQ = 16
REL = 2e-5


def build(sp: bool = False) -> DistributedDataParallel:
    torch.manual_seed(0)  # base weights are drawn as full tensors: same on every build
    model = mm.build_gpt_model(CFG, sequence_parallel=sp)
    # Non-zero B so that every factor gets a gradient.
    mm.apply_multi_lora(model, N, DIM, 1.0, row_init_method="normal")
    for i, (r, a) in enumerate(zip(RANKS, ALPHAS)):
        mm.init_adapter_slot(model, i, r, a)
    return DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), model)


def micro_batch(seed: int, counts: list[int]):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (1, SEQ), generator=gen)
    labels = torch.randint(0, CFG.vocab_size, (1, SEQ), generator=gen)
    return ids, labels, counts


def step(ddp: DistributedDataParallel, batch) -> torch.Tensor:
    """Forward+backward one packed micro-batch; returns per-slot mean losses [N]."""
    ids, labels, counts = batch
    mm.set_tokens_per_adapter_slot(ddp.module, counts)
    token_loss = ddp(ids, torch.arange(SEQ)[None], None, labels=labels).view(-1)
    per_slot = torch.stack([s.mean() if len(s) else s.sum()
                            for s in token_loss.split(counts)])
    per_slot.sum().backward()  # each adapter's loss normalised by its own tokens
    return per_slot.detach()


def adapter_grads(ddp: DistributedDataParallel) -> dict[str, torch.Tensor]:
    return {k: p.main_grad.clone() for k, p in ddp.module.state_dict(keep_vars=True).items()
            if isinstance(p, torch.nn.Parameter) and p.requires_grad}


def shard_for_this_rank(name: str, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Slice a TP=1 tensor the way ``like`` (a parameter of the TP>1 model) is split."""
    if not getattr(like, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    dim = like.partition_dim
    if ".mlp.linear_fc1." in name and CFG.gated_linear_unit and dim == 0:
        # megatron keeps [gate_shard; up_shard] per rank for the fused fc1.
        return torch.cat([h.chunk(tp, 0)[rank] for h in full.chunk(2, 0)])
    return full.chunk(tp, dim)[rank]


def load_full_state(ddp: DistributedDataParallel, full: dict[str, torch.Tensor]) -> None:
    like = ddp.module.state_dict(keep_vars=True)
    ddp.module.load_state_dict({k: shard_for_this_rank(k, v, like[k]) if torch.is_tensor(v) else v
                                for k, v in full.items()})


COUNTS = [5, 0, 7, 4]   # a zero-token slot; slot 2 spans the SP window boundary


def reference(layout):
    layout(tp=1)
    ddp = build()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in ddp.module.state_dict().items()}
    ddp.zero_grad_buffer()
    losses = step(ddp, micro_batch(0, COUNTS))
    finalize_model_grads([ddp])
    grads = adapter_grads(ddp)
    mm.destroy_parallel()
    return state, losses, grads


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_tp2_gpt_matches_tp1(layout, sp):
    state, ref_losses, ref_grads = reference(layout)
    layout(tp=2, sp=sp)
    ddp = build(sp)
    load_full_state(ddp, state)
    ddp.zero_grad_buffer()
    losses = step(ddp, micro_batch(0, COUNTS))
    finalize_model_grads([ddp])
    failures: list[str] = []
    compare(failures, losses, ref_losses, REL, "per-slot loss")
    like = ddp.module.state_dict(keep_vars=True)
    grads = adapter_grads(ddp)
    if set(grads) != set(ref_grads):
        failures.append(f"trainable sets differ: {sorted(set(grads) ^ set(ref_grads))[:4]}")
    for k, g in grads.items():
        compare(failures, g, shard_for_this_rank(k, ref_grads[k], like[k]), REL, k)
    assert_all_ranks(failures)


def test_dp2_grads_equal_one_process_on_both_micro_batches(layout):
    layout(tp=1)  # world 2: DP=2
    dp_rank = parallel_state.get_data_parallel_rank()
    batches = [micro_batch(10, [9, 0, 3, 4]), micro_batch(11, [0, 6, 6, 4])]

    ref = build()
    ref.zero_grad_buffer()
    for batch in batches:  # one process, both micro-batches, gradients averaged
        step(ref, batch)
    want = {k: g / 2 for k, g in adapter_grads(ref).items()}  # local, no DP reduction

    ddp = build()
    ddp.zero_grad_buffer()
    step(ddp, batches[dp_rank])
    finalize_model_grads([ddp])
    failures: list[str] = []
    for k, g in adapter_grads(ddp).items():
        compare(failures, g, want[k], REL, k)
    assert_all_ranks(failures)


def test_dist_checkpoint_saved_at_tp1_loads_at_tp2(layout, tmp_path):
    """Base and adapter tensors reshard through megatron's dist_checkpointing."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = [str(tmp_path)]
    dist.broadcast_object_list(path, src=0)  # one folder for all ranks
    layout(tp=1)
    ddp = build()
    full = {k: v.clone() for k, v in ddp.module.state_dict().items() if torch.is_tensor(v)}
    dist_checkpointing.save(ddp.module.sharded_state_dict(), path[0])
    mm.destroy_parallel()

    layout(tp=2)
    torch.manual_seed(99)  # different weights until the checkpoint loads
    model = mm.apply_multi_lora(mm.build_gpt_model(CFG), N, DIM, 1.0)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path[0]))
    like = model.state_dict(keep_vars=True)
    failures = [k for k, v in full.items()
                if not torch.equal(like[k].detach(), shard_for_this_rank(k, v, like[k]))]
    want = torch.tensor(ALPHAS) / torch.tensor(RANKS)
    if any(not torch.equal(layer.scale, want) for layer in mm.multi_lora_modules(model)):
        failures.append(f"slot scales not restored: {mm.multi_lora_modules(model)[0].scale}")
    assert_all_ranks(failures)
