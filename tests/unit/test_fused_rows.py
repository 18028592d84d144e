import pytest
import torch

from megatron_multilora import GPTModelConfig
from megatron_multilora.ops.fused_rows import (
    QKVRows,
    fuse_gate_up,
    shard_gate_up,
    split_gate_up,
    unshard_gate_up,
)


def _rows(n: int, first: int, cols: int = 3) -> torch.Tensor:
    """``n`` rows whose values name them: row i is all ``first + i``."""
    return (torch.arange(n, dtype=torch.float32) + first)[:, None].expand(n, cols).clone()


def test_qkv_layout_from_config_defaults():
    assert QKVRows.of(GPTModelConfig(hidden_size=32, num_attention_heads=4)) == QKVRows(4, 4, 8)
    cfg = GPTModelConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=6)
    assert QKVRows.of(cfg) == QKVRows(4, 2, 6)
    assert QKVRows.of(cfg).part_rows() == (24, 12, 12)


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (6, 1)])
def test_qkv_fuse_is_megatrons_per_group_order_and_split_inverts_it(heads, groups):
    d = 2
    layout = QKVRows(heads, groups, d)
    q, k, v = _rows(heads * d, 0), _rows(groups * d, 100), _rows(groups * d, 200)
    fused = layout.fuse(q, k, v)
    # Written out by hand: each group's q heads, then its k head, then its v head.
    want = []
    for g in range(groups):
        for h in range(g * heads // groups, (g + 1) * heads // groups):
            want.append(q[h * d : (h + 1) * d])
        want += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
    assert torch.equal(fused, torch.cat(want))
    assert all(torch.equal(a, b) for a, b in zip(layout.split(fused), (q, k, v)))
    # A TP rank holds whole groups: fusing its groups' rows gives its slice of the fused rows.
    if groups % 2 == 0:
        per = heads // 2 * d, groups // 2 * d
        rank1 = layout.fuse(q[per[0] :], k[per[1] :], v[per[1] :])
        assert torch.equal(rank1, fused.chunk(2)[1])


def test_qkv_round_trip_of_a_bias_and_of_lora_b():
    layout = QKVRows(4, 2, 2)
    bias = torch.arange(16.0)  # 1-D: a qkv bias
    assert torch.equal(layout.fuse(*layout.split(bias)), bias)
    b = torch.randn(16, 5)  # [out, r]: a LoRA B
    assert [p.shape for p in layout.split(b)] == [(8, 5), (4, 5), (4, 5)]
    assert torch.equal(layout.fuse(*layout.split(b)), b)


def test_gate_up_shards_hold_a_chunk_of_each_half():
    gate, up = _rows(8, 0), _rows(8, 100)
    full = fuse_gate_up(gate, up)
    assert all(torch.equal(a, b) for a, b in zip(split_gate_up(full), (gate, up)))
    shards = [shard_gate_up(full, r, 4) for r in range(4)]
    for r, shard in enumerate(shards):  # [gate_r; up_r], not chunk r of [gate; up]
        assert torch.equal(shard, torch.cat([gate[2 * r : 2 * r + 2], up[2 * r : 2 * r + 2]]))
    assert torch.equal(unshard_gate_up(shards), full)
