"""Adapters x tasks: each adapter slot on a job's held-out data (its task), loss (and the
task objective's metrics) and exact-match accuracy of greedy generations, and the final
table of every exported adapter (and the base model alone) on every task."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import torch
from megatron.core import parallel_state

from megatron_multilora.checkpoint.adapter_files import import_adapter
from megatron_multilora.data.datasets import Example
from megatron_multilora.data.demo_tasks import exact_match, may_still_match
from megatron_multilora.layers.lifecycle import clear_adapter_slot
from megatron_multilora.parallel import data_parallel_sum
from megatron_multilora.training.jobs.job import Job
from megatron_multilora.training.step import evaluation, generation
from megatron_multilora.training.step.slot_step import SlotStep


@dataclasses.dataclass
class AdapterTaskTables:
    """Rows: adapters; columns: the tasks (jobs with held-out data)."""

    tasks: list[Job]
    losses: list[list[float]]
    accuracy: list[list[float]]
    metrics: list[list[dict[str, float]]]
    """Each adapter's metrics on each task by the task's objective (DPO: its preference
    accuracy, rewards and margin; none for SFT)."""


# Per (slot, task name), per eval record: its greedy generation's tokens where the held-out
# pass's teacher-forced choices decide them (generation.forced_greedy), else None.
Known = dict[tuple[int, str], list[list[int] | None]]


class AdapterTaskEval:
    """Held-out loss and accuracy of the adapters in ``step``'s slots on jobs' held-out data
    (``job.eval`` examples; ``job.eval_records`` with a prompt and a completion are generated
    from), greedy generations of at most ``max_new_tokens``. ``tokenizer`` has ``bos_id``,
    ``eos_id``, ``pad_id``, ``encode`` and ``decode``.

    The loss pass also decides most greedy generations: where an example's prompt is its
    record's, the teacher-forced choices at its completion positions give the tokens greedy
    decoding would produce (exactly, where each choice leads its runner-up clearly) as far as
    it follows the reference, and the token where it first leaves it. Only the prompts that
    pass leaves open (a clear leaving choice whose text may still match, an unclear choice,
    a layout whose output layer runs whole) are decoded."""

    def __init__(self, step: SlotStep, tokenizer, max_new_tokens: int) -> None:
        self.step, self.model, self.tokenizer = step, step.model, tokenizer
        self.n_slots, self.pad_multiple = step.n_slots, step.batcher.pad_multiple
        self.max_new_tokens = max_new_tokens

    def evaluate(self, slot_to_task: dict[int, Job]) -> tuple[dict[int, dict[str, float]], Known]:
        """Each slot's mean loss on its task's examples by the task's objective, and the
        objective's metrics (slots whose task has examples); and the greedy generations that
        pass decides, for :meth:`accuracy`."""
        slot_examples: list[Sequence] = [[] for _ in range(self.n_slots)]
        objectives = [None] * self.n_slots
        for slot, task in slot_to_task.items():
            slot_examples[slot] = task.eval
            objectives[slot] = task.objective.eval_objective()
        if not any(slot_examples):
            return {}, {}
        table, choices = evaluation.eval_results_and_choices(self.step, slot_examples, objectives)
        results = {
            slot: {
                "loss": float(table[slot, 0]),
                **{name: float(v) for name, v in zip(objectives[slot].metrics, table[slot, 1:])},
            }
            for slot in slot_to_task
            if slot_examples[slot]
        }
        known = {
            (slot, task.name): self._known(task, choices[slot])
            for slot, task in slot_to_task.items()
        }
        return results, known

    def accuracy(
        self, slot_to_task: dict[int, Job], known: Known | None = None
    ) -> dict[int, float]:
        """Exact-match accuracy of greedy generations, per slot, on its task's records
        (prompt/completion records only); ``known``: what :meth:`evaluate` decided."""
        return {
            slot: acc
            for (slot, _), acc in self._cell_accuracy(
                list(slot_to_task.items()), known or {}
            ).items()
        }

    def _prompt(self, record: dict) -> list[int]:
        return [self.tokenizer.bos_id] + self.tokenizer.encode(record["prompt"])

    def _missed(self, tokens: list[int], completion: str) -> bool:
        # Only the match is reported: a prompt whose text has left its answer stops.
        return not may_still_match(self.tokenizer.decode(tokens), completion)

    def _known(self, task: Job, choices: list[list[list[int]]]) -> list[list[int] | None]:
        """Each of ``task``'s records' greedy tokens where its example's teacher-forced
        ``choices`` (per item, per example, per position) decide them, else None."""
        known: list[list[int] | None] = []
        for record, item, item_choices in zip(task.eval_records, task.eval, choices):
            tokens = list(item.tokens) if isinstance(item, Example) else []
            prompt = self._prompt(record) if "prompt" in record else None
            if prompt is None or tokens[: len(prompt)] != prompt or len(tokens) <= len(prompt):
                known.append(None)
                continue
            # Position p's choice follows tokens[:p + 1]: the completion's k-th token is
            # chosen at position len(prompt) - 1 + k.
            known.append(
                generation.forced_greedy(
                    tokens[len(prompt) :],
                    item_choices[0][len(prompt) - 1 :],
                    self.max_new_tokens,
                    self.tokenizer.eos_id,
                    lambda _, done, answer=record["completion"]: self._missed(done, answer),
                )
            )
        return known + [None] * (len(task.eval_records) - len(known))

    def _cell_accuracy(
        self, cells: Sequence[tuple[int, Job]], known: Known
    ) -> dict[tuple[int, str], float]:
        """Exact-match accuracy per ``(slot, task name)`` cell (cells with prompts only): the
        ``known`` generations as they are, every other prompt of every cell generated in one
        batch (one forward per new token serves them all), shared out over the
        data-parallel ranks where generation allows it."""
        prompts, answers = [], []
        hits = torch.zeros(len(cells), 2, dtype=torch.int64)  # [hits, prompts] per cell
        keys = [(slot, task.name) for slot, task in cells]
        for index, (slot, task) in enumerate(cells):
            decided = known.get(keys[index], [])
            for i, record in enumerate(task.eval_records):
                if "prompt" not in record:
                    continue
                out = decided[i] if i < len(decided) else None
                if out is None:
                    prompts.append((slot, self._prompt(record)))
                    answers.append((index, record["completion"]))
                else:
                    hits[index] += torch.tensor(
                        [exact_match(self.tokenizer.decode(out), record["completion"]), 1]
                    )
        world, rank = 1, 0
        if generation.uses_kv_cache(self.model, self.pad_multiple):
            world = parallel_state.get_data_parallel_world_size()
            rank = parallel_state.get_data_parallel_rank()
        mine = answers[rank::world]
        outputs = (
            generation.greedy_generate(
                self.model,
                prompts[rank::world],
                self.n_slots,
                self.max_new_tokens,
                self.tokenizer.eos_id,
                self.pad_multiple,
                self.tokenizer.pad_id,
                give_up=lambda i, tokens: self._missed(tokens, mine[i][1]),
            )
            if prompts
            else []
        )
        generated = torch.zeros(len(cells), 2, dtype=torch.int64)
        for out, (index, answer) in zip(outputs, mine):
            generated[index] += torch.tensor([exact_match(self.tokenizer.decode(out), answer), 1])
        if world > 1 and prompts:
            generated = data_parallel_sum(generated)
        hits += generated
        return {keys[i]: hit / total for i, (hit, total) in enumerate(hits.tolist()) if total}

    def tables(self, adapters: Sequence[Path | None], jobs: Sequence[Job]) -> AdapterTaskTables:
        """Every adapter folder (None: a cleared slot, i.e. the base model alone) on every
        job with held-out data, ``n_slots`` adapters at a time; the slots used are cleared
        afterwards. Each group's remaining generations of every task run in one batch."""
        tasks = [job for job in jobs if job.eval]
        losses = [[float("nan")] * len(tasks) for _ in adapters]
        accuracy = [[float("nan")] * len(tasks) for _ in adapters]
        metrics: list[list[dict[str, float]]] = [[{} for _ in tasks] for _ in adapters]
        for start in range(0, len(adapters), self.n_slots) if tasks else []:
            group = adapters[start : start + self.n_slots]
            for slot, folder in enumerate(group):
                if folder is None:  # the slot may still hold a job's adapter from training
                    clear_adapter_slot(self.model, slot)
                else:
                    import_adapter(self.model, slot, folder)
            known: Known = {}
            for col, task in enumerate(tasks):
                results, decided = self.evaluate({slot: task for slot in range(len(group))})
                known.update(decided)
                for slot in range(len(group)):
                    losses[start + slot][col] = results[slot].pop("loss")
                    metrics[start + slot][col] = results[slot]
            cell_accuracy = self._cell_accuracy(
                [(slot, task) for task in tasks for slot in range(len(group))], known
            )
            for col, task in enumerate(tasks):
                for slot in range(len(group)):
                    accuracy[start + slot][col] = cell_accuracy.get((slot, task.name), float("nan"))
            for slot in range(len(group)):
                clear_adapter_slot(self.model, slot)
        return AdapterTaskTables(tasks, losses, accuracy, metrics)
