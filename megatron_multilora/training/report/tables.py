"""Adapters x tasks: each adapter slot on a job's held-out data (its task), loss (and the
task objective's metrics) and exact-match accuracy of greedy generations, and the final
table of every exported adapter (and the base model alone) on every task."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import torch
from megatron.core import parallel_state

from megatron_multilora.checkpoint.adapter_files import import_adapter
from megatron_multilora.data.demo_tasks import exact_match, may_still_match
from megatron_multilora.layers.lifecycle import ModelOrChunks, clear_adapter_slot
from megatron_multilora.parallel import data_parallel_sum
from megatron_multilora.training.jobs.job import Job
from megatron_multilora.training.step import evaluation, generation


@dataclasses.dataclass
class AdapterTaskTables:
    """Rows: adapters; columns: the tasks (jobs with held-out data)."""

    tasks: list[Job]
    losses: list[list[float]]
    accuracy: list[list[float]]
    metrics: list[list[dict[str, float]]]
    """Each adapter's metrics on each task by the task's objective (DPO: its preference
    accuracy, rewards and margin; none for SFT)."""


class AdapterTaskEval:
    """Held-out loss and accuracy of the adapters in ``model``'s slots on jobs' held-out data
    (``job.eval`` examples; ``job.eval_records`` with a prompt and a completion are generated
    from). ``tokenizer`` has ``bos_id``, ``eos_id``, ``pad_id``, ``encode`` and ``decode``."""

    def __init__(self, model: ModelOrChunks, tokenizer, n_slots: int, token_budget: int,
                 pad_multiple: int, max_new_tokens: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.n_slots, self.token_budget = n_slots, token_budget
        self.pad_multiple, self.max_new_tokens = pad_multiple, max_new_tokens

    def evaluate(self, slot_to_task: dict[int, Job]) -> dict[int, dict[str, float]]:
        """Each slot's mean loss on its task's examples by the task's objective, and the
        objective's metrics (slots whose task has examples)."""
        slot_examples: list[Sequence] = [[] for _ in range(self.n_slots)]
        objectives = [None] * self.n_slots
        for slot, task in slot_to_task.items():
            slot_examples[slot] = task.eval
            objectives[slot] = task.objective.eval_objective()
        if not any(slot_examples):
            return {}
        table = evaluation.eval_results(self.model, slot_examples, self.token_budget,
                                        self.pad_multiple, self.tokenizer.pad_id, objectives)
        return {slot: {"loss": float(table[slot, 0]),
                       **{name: float(v) for name, v in
                          zip(objectives[slot].metrics, table[slot, 1:])}}
                for slot in slot_to_task if slot_examples[slot]}

    def accuracy(self, slot_to_task: dict[int, Job]) -> dict[int, float]:
        """Exact-match accuracy of greedy generations, per slot, on its task's records
        (prompt/completion records only)."""
        return {slot: acc for (slot, _), acc in
                self._cell_accuracy(list(slot_to_task.items())).items()}

    def _cell_accuracy(self, cells: Sequence[tuple[int, Job]]) -> dict[tuple[int, str], float]:
        """Exact-match accuracy per ``(slot, task name)`` cell (cells with prompts only):
        every cell's prompts in one batch (one forward per new token serves them all),
        shared out over the data-parallel ranks where generation allows it."""
        prompts, answers = [], []
        keys = [(slot, task.name) for slot, task in cells]
        for index, (slot, task) in enumerate(cells):
            for record in task.eval_records:
                if "prompt" not in record:
                    continue
                ids = [self.tokenizer.bos_id] + self.tokenizer.encode(record["prompt"])
                prompts.append((slot, ids))
                answers.append((index, record["completion"]))
        if not prompts:
            return {}
        world, rank = 1, 0
        if generation.uses_kv_cache(self.model, self.pad_multiple):
            world = parallel_state.get_data_parallel_world_size()
            rank = parallel_state.get_data_parallel_rank()
        mine = answers[rank::world]

        def missed(i: int, tokens: list[int]) -> bool:
            # Only the match is reported: a prompt whose text has left its answer stops.
            return not may_still_match(self.tokenizer.decode(tokens), mine[i][1])

        outputs = generation.greedy_generate(
            self.model, prompts[rank::world], self.n_slots, self.max_new_tokens,
            self.tokenizer.eos_id, self.pad_multiple, self.tokenizer.pad_id, give_up=missed)
        hits = torch.zeros(len(cells), 2, dtype=torch.int64)  # [hits, prompts] per cell
        for out, (index, answer) in zip(outputs, mine):
            hits[index] += torch.tensor([exact_match(self.tokenizer.decode(out), answer), 1])
        if world > 1:
            hits = data_parallel_sum(hits)
        return {keys[i]: hit / total for i, (hit, total) in enumerate(hits.tolist()) if total}

    def tables(self, adapters: Sequence[Optional[Path]], jobs: Sequence[Job]) -> AdapterTaskTables:
        """Every adapter folder (None: a cleared slot, i.e. the base model alone) on every
        job with held-out data, ``n_slots`` adapters at a time; the slots used are cleared
        afterwards. Each group's generations of every task run in one batch."""
        tasks = [job for job in jobs if job.eval]
        losses = [[float("nan")] * len(tasks) for _ in adapters]
        accuracy = [[float("nan")] * len(tasks) for _ in adapters]
        metrics: list[list[dict[str, float]]] = [[{} for _ in tasks] for _ in adapters]
        for start in range(0, len(adapters), self.n_slots) if tasks else []:
            group = adapters[start:start + self.n_slots]
            for slot, folder in enumerate(group):
                if folder is None:  # the slot may still hold a job's adapter from training
                    clear_adapter_slot(self.model, slot)
                else:
                    import_adapter(self.model, slot, folder)
            cell_accuracy = self._cell_accuracy([(slot, task) for task in tasks
                                                 for slot in range(len(group))])
            for col, task in enumerate(tasks):
                results = self.evaluate({slot: task for slot in range(len(group))})
                for slot in range(len(group)):
                    losses[start + slot][col] = results[slot].pop("loss")
                    metrics[start + slot][col] = results[slot]
                    accuracy[start + slot][col] = cell_accuracy.get((slot, task.name),
                                                                    float("nan"))
            for slot in range(len(group)):
                clear_adapter_slot(self.model, slot)
        return AdapterTaskTables(tasks, losses, accuracy, metrics)
