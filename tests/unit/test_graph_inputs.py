"""What a CUDA graph of the training pass replays, checked on the CPU (``training/step/
cuda_graphs.py``): the chunk called with static inputs (a micro-batch padded to a fixed
length, its slot layout on the device, attention in one masked pass) gives the packed
forward's losses and every slot's gradients, and runs the very same ops with no host read
for any micro-batch of a length, which is what lets one capture replay for all of them.
The capture itself needs a GPU (tests/gpu/test_cuda_paths.py)."""

import gc
import weakref

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import megatron_multilora as mm
from benchmarks import launches
from megatron_multilora.data.datasets import Example
from megatron_multilora.layers.inject import TARGETS
from megatron_multilora.training.step.cuda_graphs import StaticChunk, graph_lengths, static_inputs
from megatron_multilora.training.step.micro_batches import (
    MicroBatcher,
    chunk_inputs,
    pack_micro_batches,
    pad_micro_batch,
)
from megatron_multilora.training.step.slot_adamw import SlotAdamW
from tests.host_reads import HostRead, refuse_host_reads

CFG = mm.GPTModelConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=96,
    gated_linear_unit=True,
)
N_SLOTS, LENGTH = 4, 128
# Per slot, its examples' lengths: slot 1 has none (zero rows, still in every grouped GEMM).
LAYOUTS = {
    "a": [[31, 6], [], [4, 18, 9, 2], [12]],
    "b": [[3], [], [40, 5, 5], [7, 20, 1, 9]],
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = mm.apply_multi_lora(
        mm.build_gpt_model(CFG, calculate_per_token_loss=True),
        N_SLOTS,
        16,
        8.0,
        row_init_method="normal",
    )
    for slot, rank in enumerate((8, 16, 4, 12)):
        mm.init_adapter_slot(model, slot, rank, 2.0 * rank)
    SlotAdamW.of(model)  # gradients go to the slots' rows, as in the trainer's step
    return model


def micro_batch(name: str):
    gen = torch.Generator().manual_seed(len(name))
    slots = [
        [
            Example(tuple(torch.randint(0, 96, (n + 1,), generator=gen).tolist()), (True,) * n)
            for n in lengths
        ]
        for lengths in LAYOUTS[name]
    ]
    (mb,) = pack_micro_batches(slots, 1000)
    return mb


def grads(model) -> torch.Tensor:
    rows = SlotAdamW.of(model).rows
    out = rows.grad_buffer.clone()
    rows.grad_buffer.zero_()
    return out


def test_static_inputs_give_the_packed_losses_and_every_slots_gradients(model):
    mb = micro_batch("a")
    size = mb.tokens.size(1)
    weights = torch.rand(1, LENGTH, generator=torch.Generator().manual_seed(1))
    weights[:, size:] = 0  # the pads carry no loss
    grads(model)

    eager = model(**chunk_inputs(model, mb), labels=mb.labels)
    (eager * weights[:, :size]).sum().backward()
    want = grads(model)

    padded = pad_micro_batch(mb, LENGTH, 0)
    static = StaticChunk(model)(*static_inputs(padded, N_SLOTS, torch.device("cpu")))
    assert static.shape == (1, LENGTH)
    (static * weights).sum().backward()
    got = grads(model)

    torch.testing.assert_close(static[:, :size], eager, rtol=1e-5, atol=1e-5)
    per_slot = want.view(N_SLOTS, -1).abs().sum(1)
    assert (per_slot[[0, 2, 3]] > 0).all() and per_slot[1] == 0  # slot 1 has no rows
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def ops_of(fn) -> list[tuple]:
    """Each aten op of ``fn`` with its input shapes, but the insides of the grouped GEMM
    (a loop of per-group GEMMs on the CPU, one kernel on the GPU)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [
        (e.name, tuple(tuple(s) for s in e.input_shapes if s))
        for e in prof.events()
        if e.name.startswith("aten::") and not launches._inside(e)
    ]


def test_every_micro_batch_of_a_length_runs_the_same_ops_and_reads_nothing_back(model):
    mbs = [pad_micro_batch(micro_batch(name), LENGTH, 0) for name in LAYOUTS]
    assert mbs[0].counts != mbs[1].counts and mbs[0].seq_lengths != mbs[1].seq_lengths

    def static_pass(mb):
        inputs = static_inputs(mb, N_SLOTS, torch.device("cpu"))  # copied in before a replay

        def run():
            StaticChunk(model)(*inputs).sum().backward()

        return run

    def packed_pass(mb):
        def run():
            model(**chunk_inputs(model, mb), labels=mb.labels).sum().backward()

        return run

    static = [ops_of(static_pass(mb)) for mb in mbs]
    assert static[0] == static[1]
    assert not [op for op in static[0] if op[0] == "aten::_local_scalar_dense"]
    # The check can fail: the host-laid-out packed pass differs between the two.
    packed = [ops_of(packed_pass(mb)) for mb in mbs]
    assert packed[0] != packed[1]
    grads(model)


def test_graph_lengths_and_the_batcher_pads_to_the_shortest_that_holds(model):
    assert graph_lengths(1024) == (128, 256, 512, 1024)
    assert graph_lengths(100) == (64, 128)
    batcher = MicroBatcher(model, N_SLOTS, 1000, 1, 0, lengths=(64, 128))
    mbs = batcher.equalize([micro_batch("a"), micro_batch("b")], 3)
    assert [mb.tokens.size(1) for mb in mbs] == [128, 128, 64]  # the filler too
    assert all(mb.loss_mask[0, -mb.n_pad :].sum() == 0 for mb in mbs if mb.n_pad)
    long = pad_micro_batch(micro_batch("a"), 129, 0)
    with pytest.raises(ValueError, match="longer than the longest fixed length 128"):
        batcher.equalize([long], 1)


def _bf16_model(
    max_rank: int, ranks: tuple[int, ...], targets: tuple[str, ...] = TARGETS, **cfg: object
) -> torch.nn.Module:
    """A bf16 model (what graphs run: the grouped kernel's rule for bf16 on the CPU is the
    GPU's, widths in multiples of 16 bytes) with slots of ``ranks``."""
    torch.manual_seed(0)
    model = mm.apply_multi_lora(
        mm.build_gpt_model(
            mm.GPTModelConfig(**{**vars(CFG), **cfg}),
            params_dtype=torch.bfloat16,
            calculate_per_token_loss=True,
        ),
        N_SLOTS,
        max_rank,
        8.0,
        targets,
        row_init_method="normal",
    )
    for slot, rank in enumerate(ranks):
        mm.init_adapter_slot(model, slot, rank, 2.0 * rank)
    SlotAdamW.of(model)
    return model


def _graphed_pass(model: torch.nn.Module) -> None:
    mb = pad_micro_batch(micro_batch("a"), LENGTH, 0)
    longest = 64  # trainer.max_seq_len
    inputs = static_inputs(mb, N_SLOTS, torch.device("cpu"), longest)  # copied in before a replay
    with refuse_host_reads():
        StaticChunk(model, longest)(*inputs).float().sum().backward()


@pytest.mark.parametrize(
    "max_rank,ranks",
    [(8, (4, 8, 1, 8)), (16, (12, 16, 4, 9)), (64, (64, 4, 20, 33))],
    ids=["max_rank_8", "max_rank_16", "max_rank_64"],
)
def test_the_graphed_pass_reads_nothing_back_for_every_rank_graphs_admit(max_rank, ranks):
    _graphed_pass(_bf16_model(max_rank, ranks))


@pytest.mark.parametrize(
    "targets,cfg",
    [
        ((*TARGETS, "output_layer"), {"tie_word_embeddings": True}),
        (("q_proj", "v_proj", "down_proj"), {"qk_layernorm": True}),
        (TARGETS, {"sliding_window": 64, "normalization": "LayerNorm"}),
    ],
    ids=["output_layer_tied", "fused_parts_qk_norm", "window_layernorm"],
)
def test_the_graphed_pass_reads_nothing_back_for_the_settings_graphs_admit(targets, cfg):
    """Other targets (the output layer, parts of a fused linear) and model settings."""
    _graphed_pass(_bf16_model(16, (12, 16, 4, 9), targets, **cfg))


def test_a_max_rank_off_a_multiple_of_8_would_read_the_host_in_a_capture():
    """The defect the host-read check exists for: at ``lora.max_rank=12`` a slot of rank 9-12
    makes the GEMMs run at rank 12, off the grouped kernel's 16-byte rule, and the fallback
    reads the group sizes back (refused before anything runs: ``training/checks.py``)."""
    with pytest.raises(HostRead, match="tolist"):
        _graphed_pass(_bf16_model(12, (4, 12, 9, 1)))


def test_a_sliding_window_model_runs_graphed_with_its_window():
    """The graphed pass (one masked pass on the CPU, flash varlen on a GPU) computes the
    window as the packed forward does, for sequences of several windows; its sequences are
    bounded by the run's longest (``trainer.max_seq_len``), the pads cut into sequences of
    that length."""
    window, longest = 4, 32
    torch.manual_seed(0)
    model = mm.apply_multi_lora(
        mm.build_gpt_model(
            mm.GPTModelConfig(**{**vars(CFG), "sliding_window": window}),
            calculate_per_token_loss=True,
        ),
        N_SLOTS,
        16,
        8.0,
        row_init_method="normal",
    )
    mb = micro_batch("a")
    assert max(mb.seq_lengths) > 2 * window and LENGTH - mb.tokens.size(1) > longest
    eager = model(**chunk_inputs(model, mb), labels=mb.labels)
    padded = pad_micro_batch(mb, LENGTH, 0)
    static = StaticChunk(model, longest)(
        *static_inputs(padded, N_SLOTS, torch.device("cpu"), longest)
    )
    torch.testing.assert_close(static[:, : mb.tokens.size(1)], eager, rtol=1e-5, atol=1e-5)


def test_a_capture_holds_the_rope_tables_it_reads(model, monkeypatch):
    """megatron caches RoPE tables in an ``lru_cache`` of 32 keys; a capture reads its table
    on every replay, so the graph holds the tensor itself: evicted from the cache, it stays
    alive and unchanged (the capture is stood in for by one eager call on the CPU)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_multilora.training.step.cuda_graphs import ChunkGraphs

    def eager_capture(module, args, allow_unused_input, pool):
        module(*args)
        return module

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", eager_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "one pool")
    graphs = ChunkGraphs(model, SlotAdamW.of(model).rows, longest=LENGTH)
    graphs(graphs.inputs(pad_micro_batch(micro_batch("a"), LENGTH, 0)))
    ((_, _, tables),) = graphs._graphed.values()
    assert tables and all(isinstance(t, torch.Tensor) for t in tables)
    held = [weakref.ref(t) for t in tables]
    del tables
    RotaryEmbedding.forward.cache_clear()
    rope = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    for length in range(1, 40):  # other keys, as evaluation and generation add
        rope(length)
    assert all(ref() is not None for ref in held)  # the graph holds them
    graphs._graphed.clear()
    gc.collect()
    assert all(ref() is None for ref in held)  # and nothing else: without it, freed
    assert "forward" not in vars(rope)  # megatron's own forward back in place
    grads(model)
