"""Generation from many adapters at once: each prompt through its own slot.

Every slot's prompts run in one batch, adapter-major, so one forward per new token serves
every adapter. With the KV cache (dense models without sequence or pipeline parallelism),
keys and values stay in megatron's static inference context and each step runs one new token
per prompt; otherwise every step re-runs each prompt's whole prefix, packed, through the
pipeline schedule. Both give the same tokens. Either way the slot layout reaches the adapted
layers with the call (``layers/slot_layout_route.py``), as in training.

Each next token is chosen by a ``Pick`` from its row's logits (greedy: the argmax; sampling:
``step/sampling.py``, whose draws are keyed per row and token so that a row's samples do
not depend on the other rows), and its log-prob under the model (temperature 1) is kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from functools import partial

import torch
from megatron.core import parallel_state

from megatron_multilora.data.datasets import Example
from megatron_multilora.layers.lifecycle import ModelOrChunks, model_chunks
from megatron_multilora.layers.slot_layout_route import SlotInferenceContext
from megatron_multilora.ops.slot_layout import SlotLayout
from megatron_multilora.training.step.micro_batches import MicroBatch, MicroBatcher
from megatron_multilora.training.step.schedule import eval_mode, from_last_stage, run_schedule

# pick(logits [B, V] float32, prompt index of each row, tokens generated so far by each row)
# -> the next token of each row ([B] int64).
Pick = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]
# give_up(prompt index, its tokens so far) -> whether to end that prompt's generation there.
GiveUp = Callable[[int, list[int]], bool]


def greedy(logits: torch.Tensor, rows: list[int], generated: list[int]) -> torch.Tensor:
    return logits.argmax(dim=-1)


@dataclasses.dataclass
class Generation:
    """One prompt's continuation: its tokens (without the stop token), the model's log-prob
    of each token it chose (the stop token's included when it ended with one), and the stop
    token that ended it (None: it reached its length limit)."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    stop: int | None = None

    @property
    def ended(self) -> bool:
        return self.stop is not None


def _choose(
    pick: Pick, logits: torch.Tensor, rows: list[int], generated: list[int]
) -> torch.Tensor:
    """``[B, 2]`` float64: each row's chosen token and its log-prob (one tensor, so a
    pipeline broadcasts both at once; token ids are exact in float64)."""
    logits = logits.float()
    tokens = pick(logits, rows, generated).to(logits.device)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens.view(-1, 1)).flatten()
    return torch.stack([tokens.double(), logprobs.double()], dim=1)


def _packed_prompts(
    seqs: list[tuple[int, list[int]]], batcher: MicroBatcher
) -> tuple[MicroBatch, list[int]]:
    """Pack (slot, tokens) sequences, already slot-ordered, into one micro-batch (the batcher's
    budget holds them all) for one generation step; returns it and the position of each
    sequence's last token."""
    examples: list[list[Example]] = [[] for _ in range(batcher.n_slots)]
    for slot, tokens in seqs:
        # A dummy next token: generation reads logits, not labels.
        examples[slot].append(
            Example(tuple(tokens) + (batcher.pad_id,), (False,) * (len(tokens) - 1) + (True,))
        )
    (mb,) = batcher.pack(examples)
    ends, pos = [], 0
    for _, tokens in seqs:
        pos += len(tokens)
        ends.append(pos - 1)
    return mb, ends


@torch.no_grad()
def generate(
    model: ModelOrChunks,
    prompts: Sequence[tuple[int, list[int]]],
    n_slots: int,
    max_new_tokens: int | Sequence[int],
    eos_id: int,
    pad_multiple: int,
    pad_id: int,
    kv_cache: bool = True,
    pick: Pick = greedy,
    stops: Sequence[Collection[int]] | None = None,
    give_up: GiveUp | None = None,
) -> list[Generation]:
    """Continuations (until ``eos_id`` or one of the prompt's ``stops`` tokens, at most
    ``max_new_tokens``: one for all, or one per prompt) of ``(slot, prompt tokens)`` pairs,
    every slot's prompts in one batch, each next token chosen by ``pick``.

    With ``kv_cache`` (dense models without sequence or pipeline parallelism; the others
    fall back) keys and values are kept in megatron's static inference context, so each
    step runs one new token per prompt; without, every step re-runs the whole prefix
    through the pipeline schedule. Both give the same tokens. ``give_up(i, tokens)``, asked
    after each new token of prompt i, ends it there when true (a caller that only needs to
    know whether a continuation reaches a target stops feeding those that no longer can).
    """
    chunks = model_chunks(model)
    limits = (
        [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    )
    order = sorted(range(len(prompts)), key=lambda i: prompts[i][0])  # adapter-major
    seqs = [(prompts[i][0], list(prompts[i][1])) for i in order]
    cached = kv_cache and uses_kv_cache(chunks, pad_multiple)
    ends = [frozenset({eos_id, *(stops[i] if stops else ())}) for i in order]
    run = _Run(seqs, order, [limits[i] for i in order], ends, pick, give_up)
    with eval_mode(chunks):
        if seqs and max(limits, default=0) >= 1:
            if cached:
                _generate_cached(chunks[0], run, n_slots)
            else:
                _generate_uncached(chunks, run, n_slots, pad_multiple, pad_id)
    result: list[Generation] = [Generation() for _ in prompts]
    for k, i in enumerate(order):
        result[i] = run.out[k]
    return result


def uses_kv_cache(model: ModelOrChunks, pad_multiple: int) -> bool:
    """Whether :func:`generate` can keep a KV cache for ``model``: a dense model without
    sequence or pipeline parallelism. Only that path runs no data-parallel collective, so
    data-parallel ranks may generate different prompts."""
    chunks = model_chunks(model)
    # pad_multiple > 1 means sequence parallelism: a [B, 1] decode step cannot be split.
    return (
        pad_multiple == 1
        and len(chunks) == 1
        and not _has_moe(chunks)
        and parallel_state.get_pipeline_model_parallel_world_size() == 1
    )


def greedy_generate(
    model: ModelOrChunks,
    prompts: Sequence[tuple[int, list[int]]],
    n_slots: int,
    max_new_tokens: int,
    eos_id: int,
    pad_multiple: int,
    pad_id: int,
    kv_cache: bool = True,
    give_up: GiveUp | None = None,
) -> list[list[int]]:
    """Greedy continuations' tokens (see :func:`generate`)."""
    return [
        g.tokens
        for g in generate(
            model,
            prompts,
            n_slots,
            max_new_tokens,
            eos_id,
            pad_multiple,
            pad_id,
            kv_cache,
            give_up=give_up,
        )
    ]


class _Run:
    """The sequences being continued (adapter-major), what each has produced, and when each
    is done: at one of its stop tokens, at its own limit, or when the caller gives it up."""

    def __init__(
        self,
        seqs: list[tuple[int, list[int]]],
        rows: list[int],
        limits: list[int],
        ends: list[frozenset[int]],
        pick: Pick,
        give_up: GiveUp | None = None,
    ) -> None:
        self.seqs, self.rows, self.limits, self.ends, self.pick = seqs, rows, limits, ends, pick
        self.give_up = give_up
        self.out = [Generation() for _ in seqs]
        self.done = [limit < 1 for limit in limits]

    def choose(self, logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
        return _choose(
            self.pick, logits, [self.rows[k] for k in ks], [len(self.out[k].tokens) for k in ks]
        )

    def take(self, k: int, token: int, logprob: float) -> None:
        """Sequence k's next token (ignored once it is done)."""
        if self.done[k]:
            return
        out = self.out[k]
        out.logprobs.append(logprob)
        if token in self.ends[k]:
            out.stop, self.done[k] = token, True
            return
        out.tokens.append(token)
        self.done[k] = len(out.tokens) >= self.limits[k] or (
            self.give_up is not None and self.give_up(self.rows[k], out.tokens)
        )


def forced_greedy(
    reference: Sequence[int],
    choices: Sequence[int],
    max_new_tokens: int,
    eos_id: int,
    give_up: GiveUp | None = None,
) -> list[int] | None:
    """What :func:`greedy_generate` returns for a prompt, known without decoding it, from a
    teacher-forced pass over the prompt followed by ``reference``: ``choices[k]`` is the clear
    greedy choice after the prompt and ``reference[:k]`` (-1: not clear; see
    ``models/loss_rows.clear_choices``). While the choices follow the reference, greedy
    generation follows it too, and where they first leave it, generation takes the same
    token. None when generation would go on past that point (or meets an unclear choice).
    ``give_up`` is asked as :func:`generate` asks it, with prompt index 0."""
    run = _Run([(0, [])], [0], [max_new_tokens], [frozenset({eos_id})], greedy, give_up)
    for token, choice in zip(reference, choices):
        if run.done[0]:
            break
        if choice < 0:
            return None
        run.take(0, choice, 0.0)
        if choice != token and not run.done[0]:
            return None
    return run.out[0].tokens if run.done[0] else None


def _has_moe(chunks: list[torch.nn.Module]) -> bool:
    # Slot routing through the token dispatcher is not tested under megatron's inference
    # context: MoE models generate uncached.
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return any(isinstance(m, MoELayer) for chunk in chunks for m in chunk.modules())


def _chosen_at_ends(
    run: _Run, ends: list[int], mb: MicroBatch, logits: torch.Tensor, non_loss_data: bool = True
) -> torch.Tensor:
    """The last stage's choice for every sequence of ``mb`` (``[B, 2]``, see ``_choose``)."""
    return run.choose(logits[0, ends], list(range(len(ends))))


def _generate_uncached(
    chunks: list[torch.nn.Module], run: _Run, n_slots: int, pad_multiple: int, pad_id: int
) -> None:
    """Every step packs every (prefix + generated) sequence and runs it whole through the
    schedule; the last stage's choices are broadcast to every stage."""
    batcher = MicroBatcher(chunks, n_slots, 10**9, pad_multiple, pad_id)
    device = next(chunks[0].parameters()).device
    for _ in range(max(run.limits)):
        mb, ends = _packed_prompts(run.seqs, batcher)
        # Pads after every prompt's last token (expert-parallel peers, pipeline shapes), and
        # fillers where virtual pipeline stages need more micro-batches.
        mbs = batcher.equalize([mb])
        store = run_schedule(
            chunks,
            mbs,
            partial(_chosen_at_ends, run, ends),
            forward_only=True,
            collect_non_loss_data=True,
            labels=None,
            runtime_gather_output=True,
        )
        chosen = (
            store[0] if store else torch.zeros(len(ends), 2, dtype=torch.float64, device=device)
        )
        for k, (token, logprob) in enumerate(from_last_stage(chosen).tolist()):
            if not run.done[k]:
                run.take(k, int(token), logprob)
                if not run.done[k]:
                    run.seqs[k][1].append(int(token))
        if all(run.done):
            break


def _generate_cached(model: torch.nn.Module, run: _Run, n_slots: int) -> None:
    """Megatron's static batching: all sequences advance one position per step, so they
    share one KV-cache offset (and RoPE position). The first ``min prompt length`` positions
    run at once (prefill, one forward per slot: a ``[b, s]`` batch flattens sequence-major,
    so only a single-slot batch is adapter-major); then every step feeds ``[B, 1]`` tokens,
    adapter-major as the sequences are slot-sorted: a prompt's own next token while it
    lasts (its prediction is ignored), else the token chosen at the previous step. A finished
    sequence leaves the batch, and its KV-cache row with it."""
    seqs = run.seqs
    device = next(model.parameters()).device
    lengths = [len(tokens) for _, tokens in seqs]
    prefill = min(lengths)
    total = max(n + limit for n, limit in zip(lengths, run.limits))
    context = SlotInferenceContext(max_batch_size=len(seqs), max_sequence_length=total)
    slots = [slot for slot, _ in seqs]
    per_slot = [slots.count(s) for s in range(n_slots)]

    def forward(tokens: list[list[int]], offset: int, counts: list[int], ks: list[int]) -> list:
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)  # [b, s]
        positions = torch.arange(offset, offset + ids.size(1), device=device).expand_as(ids)
        context.slot_layout = SlotLayout(counts)  # rides with the call, as in training
        logits = model(ids, positions, None, inference_context=context, runtime_gather_output=True)
        return run.choose(logits[:, -1], ks).tolist()  # only the last position is materialised

    chosen: list = []
    start = 0
    for slot, n in enumerate(per_slot):
        if n:
            context.batch_size_offset = start
            chosen += forward(
                [tokens[:prefill] for _, tokens in seqs[start : start + n]],
                0,
                [n * prefill if s == slot else 0 for s in range(n_slots)],
                list(range(start, start + n)),
            )
            start += n
    context.batch_size_offset = 0
    live = list(range(len(seqs)))  # the sequence in each row of the KV cache, adapter-major
    position = prefill  # of the token each sequence's ``chosen`` entry predicts
    while True:
        for k, (token, logprob) in zip(live, chosen):
            if position >= lengths[k]:  # else still inside the prompt: not used
                run.take(k, int(token), logprob)
        if all(run.done):
            break
        if any(run.done[k] for k in live):
            # Finished sequences leave the batch and their cache rows with them.
            context.keep_rows(
                torch.tensor([row for row, k in enumerate(live) if not run.done[k]], device=device)
            )
            live = [k for k in live if not run.done[k]]
        feed = [
            seqs[k][1][position] if position < lengths[k] else run.out[k].tokens[-1] for k in live
        ]
        context.sequence_len_offset = position
        chosen = forward(
            [[t] for t in feed],
            position,
            [sum(slots[k] == s for k in live) for s in range(n_slots)],
            live,
        )
        position += 1
