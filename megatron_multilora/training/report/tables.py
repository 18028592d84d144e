"""Adapters x tasks: each adapter slot on a job's held-out data (its task), loss (and the
task objective's metrics) and exact-match accuracy of greedy generations, and the final
table of every exported adapter (and the base model alone) on every task."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.checkpoint.adapter_files import import_adapter
from megatron_multilora.data.demo_tasks import exact_match
from megatron_multilora.layers.lifecycle import ModelOrChunks, clear_adapter_slot
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
        hits = self._exact_matches(list(slot_to_task.items()))
        return {slot: sum(h) / len(h) for (slot, _), h in hits.items()}

    def _exact_matches(self, cells: Sequence[tuple[int, Job]]
                       ) -> dict[tuple[int, str], list[bool]]:
        """Whether each greedy generation equals its reference, per ``(slot, task name)``
        cell: every cell's prompts in one batch (one forward per new token serves them all)."""
        prompts, answers = [], []
        for slot, task in cells:
            for record in task.eval_records:
                if "prompt" not in record:
                    continue
                ids = [self.tokenizer.bos_id] + self.tokenizer.encode(record["prompt"])
                prompts.append((slot, ids))
                answers.append(((slot, task.name), record["completion"]))
        if not prompts:
            return {}
        outputs = generation.greedy_generate(
            self.model, prompts, self.n_slots, self.max_new_tokens, self.tokenizer.eos_id,
            self.pad_multiple, self.tokenizer.pad_id)
        hits: dict[tuple[int, str], list[bool]] = {}
        for out, (cell, answer) in zip(outputs, answers):
            hits.setdefault(cell, []).append(exact_match(self.tokenizer.decode(out), answer))
        return hits

    def tables(self, adapters: Sequence[Optional[Path]], jobs: Sequence[Job]) -> AdapterTaskTables:
        """Every adapter folder (None: a cleared slot, i.e. the base model alone) on every
        job with held-out data, ``n_slots`` adapters at a time; the slots used are cleared
        afterwards. Data-parallel ranks share the tasks out (see :func:`_task_share`) and
        gather the cells."""
        tasks = [job for job in jobs if job.eval]
        rank, size, group = _task_share()
        mine: dict[tuple[int, int], tuple[float, dict[str, float], float]] = {}
        for start in range(0, len(adapters), self.n_slots) if tasks else []:
            adapter_group = adapters[start:start + self.n_slots]
            for slot, folder in enumerate(adapter_group):
                if folder is not None:
                    import_adapter(self.model, slot, folder)
            cols = range(rank, len(tasks), size)
            hits = self._exact_matches([(slot, tasks[col]) for col in cols
                                        for slot in range(len(adapter_group))])
            for col in cols:
                results = self.evaluate({slot: tasks[col] for slot in range(len(adapter_group))})
                for slot in range(len(adapter_group)):
                    h = hits.get((slot, tasks[col].name))
                    mine[start + slot, col] = (results[slot].pop("loss"), results[slot],
                                               sum(h) / len(h) if h else float("nan"))
            for slot in range(len(adapter_group)):
                clear_adapter_slot(self.model, slot)
        cells = mine
        if size > 1:
            gathered: list = [None] * size
            dist.all_gather_object(gathered, mine, group=group)
            cells = {key: value for part in gathered for key, value in part.items()}
        nan = float("nan")
        return AdapterTaskTables(
            tasks,
            [[cells[row, col][0] if (row, col) in cells else nan for col in range(len(tasks))]
             for row in range(len(adapters))],
            [[cells[row, col][2] if (row, col) in cells else nan for col in range(len(tasks))]
             for row in range(len(adapters))],
            [[cells[row, col][1] if (row, col) in cells else {} for col in range(len(tasks))]
             for row in range(len(adapters))])


def _task_share() -> tuple[int, int, Optional[dist.ProcessGroup]]:
    """This rank's share of the tables' tasks: ``(rank, size, group)`` of the data-parallel
    group it evaluates with (data-parallel replicas hold the same adapters, so each takes
    every size-th task and the cells are gathered), or ``(0, 1, None)`` without a process
    group or under expert parallelism, whose all-to-alls need every rank of an expert group
    to run the same forwards."""
    if (not parallel_state.model_parallel_is_initialized()
            or parallel_state.get_expert_model_parallel_world_size() > 1):
        return 0, 1, None
    group = parallel_state.get_data_parallel_group()
    return dist.get_rank(group), dist.get_world_size(group), group
