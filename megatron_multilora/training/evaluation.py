"""Held-out evaluation of many adapters at once: loss, and greedy generation accuracy.

Evaluation runs the same packed, adapter-major batches as training, so one forward serves
every adapter; every rank evaluates the same samples (no data-parallel split), which keeps
expert-parallel collectives in step and needs no reduction of the results.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_multilora.data.datasets import Example
from megatron_multilora.data.packing import MicroBatch, pack_micro_batches
from megatron_multilora.training.step import align_with_expert_peers, forward_backward


@torch.no_grad()
def eval_losses(model: torch.nn.Module, slot_examples: Sequence[Sequence[Example]],
                token_budget: int, pad_multiple: int, pad_id: int) -> torch.Tensor:
    """``[n_slots]`` mean loss over each slot's examples' loss tokens (nan: no examples)."""
    was_training = model.training
    model.eval()
    micro_batches = align_with_expert_peers(
        pack_micro_batches(slot_examples, token_budget, pad_multiple, pad_id), pad_id)
    denominators = torch.zeros(len(slot_examples), dtype=torch.int64)
    for mb in micro_batches:
        denominators += mb.loss_tokens_per_slot()
    per_slot = forward_backward(model, micro_batches, denominators, backward=False)
    model.train(was_training)
    return torch.where(denominators > 0, per_slot, torch.full_like(per_slot, float("nan"))).float()


def _packed_prompts(seqs: list[tuple[int, list[int]]], n_slots: int, pad_multiple: int,
                    pad_id: int) -> tuple[MicroBatch, list[int]]:
    """Pack (slot, tokens) sequences, already slot-ordered, for one generation step; returns
    the batch and the position of each sequence's last token."""
    examples = [[] for _ in range(n_slots)]
    for slot, tokens in seqs:
        # A dummy next token: generation reads logits, not labels.
        examples[slot].append(Example(tuple(tokens) + (pad_id,), (False,) * (len(tokens) - 1) + (True,)))
    (mb,) = pack_micro_batches(examples, token_budget=10**9, pad_multiple=pad_multiple, pad_id=pad_id)
    ends, pos = [], 0
    for _, tokens in seqs:
        pos += len(tokens)
        ends.append(pos - 1)
    return mb, ends


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompts: Sequence[tuple[int, list[int]]], n_slots: int,
                    max_new_tokens: int, eos_id: int, pad_multiple: int, pad_id: int) -> list[list[int]]:
    """Greedy continuations of ``(slot, prompt tokens)`` pairs, all in one packed batch per
    step (no KV cache: the tiny models this serves re-run the prefix cheaply)."""
    from megatron_multilora.layers.lifecycle import set_tokens_per_adapter_slot

    was_training = model.training
    model.eval()
    order = sorted(range(len(prompts)), key=lambda i: prompts[i][0])  # adapter-major
    seqs = [(prompts[i][0], list(prompts[i][1])) for i in order]
    generated = [[] for _ in seqs]
    done = [False] * len(seqs)
    for _ in range(max_new_tokens):
        mb, ends = _packed_prompts(seqs, n_slots, pad_multiple, pad_id)
        (mb,) = align_with_expert_peers([mb], pad_id)  # pads after every prompt's last token
        mb = mb.to(next(model.parameters()).device)
        set_tokens_per_adapter_slot(model, mb.counts, ep_slots=mb.ep_slots)
        logits = model(mb.tokens, mb.position_ids, None, runtime_gather_output=True,
                       packed_seq_params=mb.packed_seq_params())
        next_ids = logits[0, ends].argmax(dim=-1).tolist()
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
    model.train(was_training)
    result: list[list[int]] = [[] for _ in prompts]
    for k, i in enumerate(order):
        result[i] = generated[k]
    return result
