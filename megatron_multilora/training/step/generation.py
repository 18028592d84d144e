"""Greedy generation from many adapters at once: each prompt through its own slot.

Every slot's prompts run in one batch, adapter-major, so one forward per new token serves
every adapter. With the KV cache (dense models without sequence or pipeline parallelism),
keys and values stay in megatron's static inference context and each step runs one new token
per prompt; otherwise every step re-runs each prompt's whole prefix, packed, through the
pipeline schedule. Both give the same tokens. Either way the slot layout reaches the adapted
layers with the call (``layers/micro_batch_layout.py``), as in training.
"""

from __future__ import annotations

from typing import Sequence

import torch
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Example
from megatron_multilora.data.packing import MicroBatch
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.layers.micro_batch_layout import SlotInferenceContext
from megatron_multilora.ops.slot_layout import SlotLayout
from megatron_multilora.training.step.evaluation import eval_mode
from megatron_multilora.training.step.micro_batches import MicroBatcher
from megatron_multilora.training.step.schedule import from_last_stage, run_schedule


def _packed_prompts(seqs: list[tuple[int, list[int]]], batcher: MicroBatcher
                    ) -> tuple[MicroBatch, list[int]]:
    """Pack (slot, tokens) sequences, already slot-ordered, into one micro-batch (the batcher's
    budget holds them all) for one generation step; returns it and the position of each
    sequence's last token."""
    examples: list[list[Example]] = [[] for _ in range(batcher.n_slots)]
    for slot, tokens in seqs:
        # A dummy next token: generation reads logits, not labels.
        examples[slot].append(Example(tuple(tokens) + (batcher.pad_id,),
                                      (False,) * (len(tokens) - 1) + (True,)))
    (mb,) = batcher.pack(examples)
    ends, pos = [], 0
    for _, tokens in seqs:
        pos += len(tokens)
        ends.append(pos - 1)
    return mb, ends


@torch.no_grad()
def greedy_generate(model: ModelOrChunks, prompts: Sequence[tuple[int, list[int]]], n_slots: int,
                    max_new_tokens: int, eos_id: int, pad_multiple: int, pad_id: int,
                    kv_cache: bool = True) -> list[list[int]]:
    """Greedy continuations (until ``eos_id``, at most ``max_new_tokens``) of ``(slot, prompt
    tokens)`` pairs, every slot's prompts in one batch.

    With ``kv_cache`` (dense models without sequence or pipeline parallelism; the others
    fall back) keys and values are kept in megatron's static inference context, so each
    step runs one new token per prompt; without, every step re-runs the whole prefix
    through the pipeline schedule. Both give the same tokens.
    """
    chunks = model_chunks(model)
    order = sorted(range(len(prompts)), key=lambda i: prompts[i][0])  # adapter-major
    seqs = [(prompts[i][0], list(prompts[i][1])) for i in order]
    # pad_multiple > 1 means sequence parallelism: a [B, 1] decode step cannot be split.
    cached = (kv_cache and pad_multiple == 1 and len(chunks) == 1 and not _has_moe(chunks)
              and parallel_state.get_pipeline_model_parallel_world_size() == 1)
    with eval_mode(chunks):
        if not seqs or max_new_tokens < 1:
            generated = [[] for _ in seqs]
        elif cached:
            generated = _generate_cached(chunks[0], seqs, n_slots, max_new_tokens, eos_id, pad_id)
        else:
            generated = _generate_uncached(chunks, seqs, n_slots, max_new_tokens, eos_id,
                                           pad_multiple, pad_id)
    result: list[list[int]] = [[] for _ in prompts]
    for k, i in enumerate(order):
        result[i] = generated[k]
    return result


def _has_moe(chunks: list[torch.nn.Module]) -> bool:
    # Slot routing through the token dispatcher is not tested under megatron's inference
    # context: MoE models generate uncached.
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return any(isinstance(m, MoELayer) for chunk in chunks for m in chunk.modules())


def _argmax_tokens(mb: MicroBatch, logits: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
    """The last stage's greedy choice at every position of ``mb`` (``[S]`` int64)."""
    return logits[0].argmax(dim=-1)


def _generate_uncached(chunks: list[torch.nn.Module], seqs: list[tuple[int, list[int]]],
                       n_slots: int, max_new_tokens: int, eos_id: int, pad_multiple: int,
                       pad_id: int) -> list[list[int]]:
    """Every step packs every (prefix + generated) sequence and runs it whole through the
    schedule; the last stage's argmax is broadcast to every stage."""
    batcher = MicroBatcher(chunks, n_slots, 10**9, pad_multiple, pad_id)
    device = next(chunks[0].parameters()).device
    generated = [[] for _ in seqs]
    done = [False] * len(seqs)
    for _ in range(max_new_tokens):
        mb, ends = _packed_prompts(seqs, batcher)
        # Pads after every prompt's last token (expert-parallel peers, pipeline shapes), and
        # fillers where virtual pipeline stages need more micro-batches.
        mbs = batcher.equalize([mb])
        store = run_schedule(chunks, mbs, _argmax_tokens, forward_only=True,
                             collect_non_loss_data=True, labels=None, runtime_gather_output=True)
        ids = store[0] if store else torch.zeros(mbs[0].tokens.size(1), dtype=torch.int64,
                                                 device=device)
        next_ids = from_last_stage(ids)[ends].tolist()
        for k, token in enumerate(next_ids):
            if done[k]:
                continue
            if token == eos_id:
                done[k] = True
            else:
                generated[k].append(token)
                seqs[k][1].append(token)
        if all(done):
            break
    return generated


def _generate_cached(model: torch.nn.Module, seqs: list[tuple[int, list[int]]], n_slots: int,
                     max_new_tokens: int, eos_id: int, pad_id: int) -> list[list[int]]:
    """Megatron's static batching: all sequences advance one position per step, so they
    share one KV-cache offset (and RoPE position). The first ``min prompt length`` positions
    run at once (prefill, one forward per slot: a ``[b, s]`` batch flattens sequence-major,
    so only a single-slot batch is adapter-major); then every step feeds ``[B, 1]`` tokens,
    adapter-major as ``seqs`` is slot-sorted: a prompt's own next token while it lasts (its
    logits are ignored), else the token generated at the previous step."""
    device = next(model.parameters()).device
    lengths = [len(tokens) for _, tokens in seqs]
    prefill = min(lengths)
    total = max(n + max_new_tokens for n in lengths)
    context = SlotInferenceContext(max_batch_size=len(seqs), max_sequence_length=total)
    slots = [slot for slot, _ in seqs]
    per_slot = [slots.count(s) for s in range(n_slots)]

    def forward(tokens: list[list[int]], offset: int, counts: list[int]) -> list[int]:
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)  # [b, s]
        positions = torch.arange(offset, offset + ids.size(1), device=device).expand_as(ids)
        context.slot_layout = SlotLayout(counts)  # rides with the call, as in training
        logits = model(ids, positions, None, inference_context=context, runtime_gather_output=True)
        return logits[:, -1].argmax(dim=-1).tolist()  # only the last position is materialised

    next_ids: list[int] = []
    start = 0
    for slot, n in enumerate(per_slot):
        if n:
            context.batch_size_offset = start
            next_ids += forward([tokens[:prefill] for _, tokens in seqs[start:start + n]], 0,
                                [n * prefill if s == slot else 0 for s in range(n_slots)])
            start += n
    context.batch_size_offset = 0
    generated = [[] for _ in seqs]
    done = [False] * len(seqs)
    position = prefill  # of the token each sequence's ``next_ids`` entry predicts
    while True:
        for k, token in enumerate(next_ids):
            if done[k] or position < lengths[k]:
                continue  # still inside the prompt: the prediction is not used
            if token == eos_id:
                done[k] = True
            else:
                generated[k].append(token)
                done[k] = len(generated[k]) == max_new_tokens
        if all(done):
            break
        feed = [seqs[k][1][position] if position < lengths[k]
                else (pad_id if done[k] else generated[k][-1])
                for k in range(len(seqs))]
        context.sequence_len_offset = position
        next_ids = forward([[t] for t in feed], position, per_slot)
        position += 1
    return generated
