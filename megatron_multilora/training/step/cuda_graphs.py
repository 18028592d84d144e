"""The training pass under CUDA graphs (``trainer.cuda_graphs``): a model chunk's forward and
backward captured once per padded micro-batch length, then replayed for every micro-batch
of that length, so a micro-batch costs a few launches instead of one per op.

A replay runs the captured kernels on the captured addresses, so everything a micro-batch
varies must reach the graph as tensors of fixed shapes (:func:`static_inputs`): its tokens,
positions and labels padded to one of a few lengths (:func:`graph_lengths`; the micro-batcher
pads them), its sequence bounds padded with empty sequences, and its slot layout as device
tensors over every slot (``ops/slot_layout.DeviceSlotLayout``), with attention in one masked
pass (``models/torch_modules.attend_in_one_pass``). Nothing inside reads a value back to the
host. What the host decides per layer (the rank the GEMMs run at, which buffers the factors
and gradients live in) is checked before each replay, and a change captures again.

torch's ``make_graphed_callables`` does the capture, one autograd node per micro-batch; the
objectives' losses stay eager on its output. The graphed pass computes the logits at every
position, not only at the loss rows as the eager pass does: their number varies by
micro-batch, and a graph's shapes cannot (a fixed bound on them would be the length). megatron-core's own graphs do not fit here:
its ``CudaGraphManager`` (``cuda_graph_impl="local"``) graphs each transformer layer and
refuses a layer with forward pre-hooks, which is how the slot layout reaches the adapters
(``layers/slot_layout_route.py``); its ``FullCudaGraphWrapper`` captures one whole
``forward_backward_func`` call, with its micro-batch count and the loss function's host
decisions (each slot's spans) baked in, which change every step here; TE's helper needs
Transformer Engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_multilora.layers.lifecycle import multi_lora_modules
from megatron_multilora.layers.slot_layout_route import with_slot_layout
from megatron_multilora.models.torch_modules import attend_in_one_pass
from megatron_multilora.ops.slot_layout import DeviceSlotLayout
from megatron_multilora.training.step.micro_batches import MicroBatch
from megatron_multilora.training.step.slot_rows import SlotRows

LENGTH_MULTIPLE = 64


def graph_lengths(token_budget: int) -> tuple[int, ...]:
    """The lengths micro-batches are padded to under CUDA graphs: the token budget and its
    half, quarter and eighth, each rounded up to a multiple of 64 (at most 4 captures; a
    micro-batch padded to the shortest that holds it stays under twice its length, or 64)."""
    return tuple(
        sorted(
            {
                -(-max(1, token_budget // d) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
                for d in (8, 4, 2, 1)
            }
        )
    )


def sequence_lengths(mb: MicroBatch, longest: int) -> list[int]:
    """``mb``'s sequence lengths for a graphed pass whose attention takes sequences of at
    most ``longest`` positions: its trailing pads (loss-free, attending among themselves) cut
    into pieces of that length; a longer example is refused."""
    lengths = list(mb.seq_lengths)
    pads = lengths.pop() if mb.n_pad else 0
    if lengths and max(lengths) > longest:
        raise ValueError(
            f"a sequence of {max(lengths)} positions is longer than the graphed pass's "
            f"{longest} (trainer.max_seq_len)"
        )
    return lengths + [longest] * (pads // longest) + ([pads % longest] if pads % longest else [])


def static_inputs(
    mb: MicroBatch, n_slots: int, device: torch.device, longest: int | None = None
) -> tuple[torch.Tensor, ...]:
    """``mb`` as the graphed chunk takes it, one host-to-device copy: tokens, positions and
    labels (``[1, S]``), sequence bounds (``[S + 1]`` int32, the last ones repeated: empty
    sequences; pads cut into sequences of at most ``longest``, default ``S``), each slot's
    row end (``[n_slots]`` int32) and each row's slot (``[S]``)."""
    size = mb.tokens.size(1)
    bounds = torch.full((size + 1,), size, dtype=torch.int64)
    ends = torch.tensor([0, *sequence_lengths(mb, longest or size)]).cumsum(0)
    bounds[: ends.numel()] = ends
    counts = torch.tensor(mb.counts)
    slot_of_row = torch.repeat_interleave(torch.arange(n_slots), counts, output_size=size)
    host = torch.cat(
        [t.cpu().flatten() for t in (mb.tokens, mb.position_ids, mb.labels)]
        + [bounds, counts.cumsum(0), slot_of_row]
    )
    on_device = host.to(device)
    tokens, positions, labels, bounds, ends, slot_of_row = on_device.split(
        [size, size, size, size + 1, n_slots, size]
    )
    return (
        tokens.view(1, size),
        positions.view(1, size),
        labels.view(1, size),
        bounds.int(),
        ends.int(),
        slot_of_row,
    )


class StaticChunk(torch.nn.Module):
    """A model chunk (the whole model: one pipeline stage, no tensor parallelism) called
    with :func:`static_inputs` alone, returning each position's loss (``[1, S]``, fp32): what
    a graph captures (eagerly, the same ops for every micro-batch of a length). ``longest``:
    the most positions of one sequence (``trainer.max_seq_len``; default each call's ``S``),
    what attention reads as the sequences' maximum."""

    def __init__(self, chunk: torch.nn.Module, longest: int | None = None) -> None:
        super().__init__()
        self.chunk, self.longest = chunk, longest

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor,
        bounds: torch.Tensor,
        slot_ends: torch.Tensor,
        slot_of_row: torch.Tensor,
    ) -> torch.Tensor:
        size = tokens.size(1)
        # Fresh views: what a layer caches on them (RoPE's angles) is then this call's.
        bounds = bounds.view(-1)
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=bounds,
            cu_seqlens_kv=bounds,
            max_seqlen_q=min(size, self.longest or size),
            max_seqlen_kv=min(size, self.longest or size),
        )
        layout = DeviceSlotLayout(slot_ends.view(-1), slot_of_row.view(-1))
        logits = self.chunk(
            input_ids=tokens,
            position_ids=position_ids,
            attention_mask=None,
            packed_seq_params=attend_in_one_pass(with_slot_layout(packed, layout)),
        )
        # torch's cross entropy, not megatron's vocab-parallel one (tensor parallelism is not
        # graphed): that one zeroes out-of-shard targets through a boolean index, which reads
        # the mask's count back to the host.
        losses = F.cross_entropy(logits[0].float(), labels[0], reduction="none")
        return losses.unsqueeze(0)


class ChunkGraphs:
    """The training forward and backward of ``chunk`` as CUDA graphs, one per micro-batch
    length (:func:`graph_lengths`), captured on first use; ``rows`` hold the slots'
    parameters and gradients (the capture's warm-up passes add gradients, which are put
    back); ``longest`` as for :class:`StaticChunk`."""

    def __init__(self, chunk: torch.nn.Module, rows: SlotRows, longest: int | None = None) -> None:
        self.chunk, self.rows, self.longest = chunk, rows, longest
        self.n_slots = rows.n
        # length -> (what the capture depends on, the graphed callable, the tensors it reads
        # that live outside its memory pool)
        self._graphed: dict[int, tuple[tuple, torch.nn.Module, list]] = {}
        self.captures = 0  # how many times a length was captured (again after a change)
        # One memory pool for every length: a micro-batch's forward and backward replays run
        # before the next micro-batch's (no pipelining under graphs), so a capture may reuse
        # what the others free, instead of each length holding its own pool.
        self._pool = None

    def inputs(self, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        """:func:`static_inputs` of ``mb`` (on the host) on the chunk's device."""
        return static_inputs(mb, self.n_slots, next(self.chunk.parameters()).device, self.longest)

    def __call__(self, args: Sequence[torch.Tensor]) -> torch.Tensor:
        """Each position's loss of a micro-batch given as :meth:`inputs`, differentiable:
        its backward replays the captured backward, adding the slots' gradients to ``rows``."""
        key, state = args[0].size(1), self._state()
        graphed = self._graphed.get(key)
        if graphed is None or graphed[0] != state:
            graphed = self._graphed[key] = (state, *self._capture(args))
        return graphed[1](*args)

    def _state(self) -> tuple:
        """What a capture depends on besides its inputs: where the slots' parameters and
        gradients live and the rank each layer's GEMMs run at."""
        ranks = tuple(
            m.adapters.compute_rank(tuple(range(self.n_slots)), m.tp_layout.rank_is_split)
            for m in multi_lora_modules(self.chunk)
        )
        buffers = (self.rows.grad_buffer, *self.rows.values.values())
        return ranks, tuple(b.data_ptr() for b in buffers)

    def _capture(self, args: Sequence[torch.Tensor]) -> tuple[torch.nn.Module, list]:
        self.captures += 1
        kept = self.rows.grad_buffer.clone()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with _rope_tables_read(self.chunk) as tables:
            graphed = torch.cuda.make_graphed_callables(
                StaticChunk(self.chunk, self.longest),
                tuple(args),
                allow_unused_input=True,
                pool=self._pool,
            )
        self.rows.grad_buffer.copy_(kept)
        return graphed, tables


@contextlib.contextmanager
def _rope_tables_read(chunk: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """The RoPE tables ``chunk``'s rotary embeddings hand out while inside, collected. megatron
    caches them (``lru_cache(maxsize=32)`` on ``RotaryEmbedding.forward``), so a capture
    reads a cached tensor on every replay; evaluation, generation and rollouts add other
    keys, and once one is evicted its memory is handed out again and replays would read
    whatever is written there. Holding them for the graph's life keeps them (Gemma 3's local
    tables too: each is kept on its global table)."""
    tables: list[torch.Tensor] = []
    modules = [m for m in chunk.modules() if isinstance(m, RotaryEmbedding)]

    def recording(read: object) -> object:
        def forward(*args: object, **kwargs: object) -> object:
            table = read(*args, **kwargs)
            tables.append(table)
            return table

        return forward

    for module in modules:
        module.forward = recording(module.forward)
    try:
        yield tables
    finally:
        for module in modules:
            del module.forward
