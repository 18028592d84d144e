"""TP=2 (SP off and on, default and fully sharded) multi-LoRA layers against the unsharded
token-by-token reference.

Every rank computes the full reference from the same full weights and inputs, then checks
its own shards of the outputs and gradients, for every slot (unequal ranks, a zero-token
slot, a slot spanning the sequence-parallel window boundary), and for one slot holding every
row (its unstacked path, `one_slot_term`).
"""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_multilora import MultiLoRALinear
from megatron_multilora.layers.factors import A, B
from megatron_multilora.ops.slot_layout import SlotLayout
from tests.distributed.conftest import assert_all_ranks, compare
from tests.reference import linear_config, lora_reference, random_slots

IN, OUT, DIM = 16, 24, 8
COUNTS = [5, 0, 7, 4]  # 16 tokens; with SP the rank windows are rows 0-7 and 8-15
ONE_SLOT = [0, 0, 16, 0]  # one slot holds every row: one_slot_term
RANKS = [8, 3, 1, 5]
ALPHAS = [16.0, 4.0, 2.0, 10.0]
REL = 1e-5


def sum_sequence_parallel_grads(layer: MultiLoRALinear) -> None:
    """What megatron's finalize_model_grads does for ``sequence_parallel`` params."""
    group = parallel_state.get_tensor_model_parallel_group()
    for p in layer.adapters.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


@pytest.mark.parametrize("fully", [False, True], ids=["default", "fully_sharded"])
@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
@pytest.mark.parametrize("kind", ["column", "row", "replicated"])
@pytest.mark.parametrize("counts", [COUNTS, ONE_SLOT], ids=["three_slots", "one_slot"])
def test_tp2_layer_matches_unsharded_reference(layout, kind, sp, fully, counts):
    layout(tp=2, sp=sp)
    tp, rank = 2, parallel_state.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, IN, generator=gen) * 0.3
    slots = random_slots(len(counts), DIM, IN, OUT, RANKS, ALPHAS, gen)
    x = torch.randn(sum(counts), IN, generator=gen)
    g = torch.randn(sum(counts), OUT, generator=gen)

    x_ref = x.clone().requires_grad_()
    y_ref = lora_reference(x_ref, w, slots, counts)
    (y_ref * g).sum().backward()

    def shard(t, dim):
        return t.chunk(tp, dim=dim)[rank]

    cfg = linear_config(tp=tp, sequence_parallel=sp)
    if kind == "column":
        base = ColumnParallelLinear(
            IN,
            OUT,
            config=cfg,
            init_method=torch.nn.init.zeros_,
            bias=False,
            gather_output=False,
            skip_bias_add=True,
        )
        base.weight.data.copy_(shard(w, 0))
    elif kind == "row":
        base = RowParallelLinear(
            IN,
            OUT,
            config=cfg,
            init_method=torch.nn.init.zeros_,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
        base.weight.data.copy_(shard(w, 1))
    else:
        base = torch.nn.Linear(IN, OUT, bias=False)
        base.weight.data.copy_(w)
    layer = MultiLoRALinear(
        base, len(counts), DIM, 1.0, f"tp.{kind}", sequence_parallel=sp, fully_sharded=fully
    )
    # Fully sharded: A split on its rank dim (column) and B on its output dim (row) too.
    a_dim = {"row": 1, "column": 0 if fully else None}.get(kind)
    b_dim = {"column": 0, "row": 0 if fully else None}.get(kind)
    assert (layer.tp_layout.split_dim(A), layer.tp_layout.split_dim(B)) == (a_dim, b_dim)
    with torch.no_grad():
        for i, f in enumerate(slots):
            layer.init_adapter_slot(i, f.rank, f.alpha)
            layer.adapters[i].linear_in.weight.copy_(f.a if a_dim is None else shard(f.a, a_dim))
            layer.adapters[i].linear_out.weight.copy_(f.b if b_dim is None else shard(f.b, b_dim))
    layer.slot_layout = SlotLayout(counts)

    # What each rank's base sees and produces under this layout.
    in_rows = sp and kind in ("column", "replicated")
    out_rows = sp and kind in ("row", "replicated")
    x_local = shard(x, 0) if in_rows else (shard(x, 1) if kind == "row" else x)
    x_local = x_local.clone().requires_grad_()
    y = layer(x_local.unsqueeze(1))
    y = (y[0] if isinstance(y, tuple) else y).squeeze(1)
    y_want = shard(y_ref, 0) if out_rows else (shard(y_ref, 1) if kind == "column" else y_ref)
    g_local = shard(g, 0) if out_rows else (shard(g, 1) if kind == "column" else g)
    (y * g_local).sum().backward()
    sum_sequence_parallel_grads(layer)

    failures: list[str] = []
    compare(failures, y.detach(), y_want.detach(), REL, "output")
    gx_want = (
        shard(x_ref.grad, 0) if in_rows else (shard(x_ref.grad, 1) if kind == "row" else x_ref.grad)
    )
    compare(failures, x_local.grad, gx_want, REL, "input grad")
    for i, f in enumerate(slots):
        ga = f.a.grad if f.a.grad is None or a_dim is None else shard(f.a.grad, a_dim)
        gb = f.b.grad if f.b.grad is None or b_dim is None else shard(f.b.grad, b_dim)
        compare(failures, layer.adapters[i].linear_in.weight.grad, ga, REL, f"slot {i} A grad")
        compare(failures, layer.adapters[i].linear_out.weight.grad, gb, REL, f"slot {i} B grad")
    assert_all_ranks(failures)
