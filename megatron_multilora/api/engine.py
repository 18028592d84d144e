"""The service's model side: every training client is an adapter slot of one multi-LoRA
model, and the calls of many clients run together.

The engine takes a batch of operations (``Op``: plain data, the same on every rank, so
every rank of a parallel layout runs the same calls) and runs it: every ``forward_backward``
of the batch (each client's at most once: a client's calls run in its order) in one packed
forward/backward, each client's loss the sum over its own datums by its own loss
(``objectives/per_token.py``), its gradient accumulating in its slot until its
``optim_step``; every ``sample`` in one generation pass, each row through its sampler's
adapter with draws keyed by the request (``step/sampling.py``). Neither depends on who
else is in the batch. Saves write ``<run_dir>/api/...`` folders: a training state (adapter
and optimizer, ``training/checkpoints.slot_snapshot``) or sampler weights (an adapter folder
and, on a Hugging Face base, a PEFT one).
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import load_file, save_file

from megatron_multilora.api import wire
from megatron_multilora.api.futures import ERROR, JSON, PROTOBUF, Result
from megatron_multilora.api.ops import STATE_META, Op, OpError, read_state_meta
from megatron_multilora.atomic_files import write_dir_atomic, write_json_atomic
from megatron_multilora.checkpoint.adapter_files import export_adapter, import_adapter
from megatron_multilora.checkpoint.peft_format import export_peft
from megatron_multilora.data.datasets import Example
from megatron_multilora.layers.lifecycle import clear_adapter_slot, model_chunks
from megatron_multilora.training.checkpoints import restore_slot, slot_snapshot
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.jobs.board import start_job
from megatron_multilora.training.objectives.registry import client_objective
from megatron_multilora.training.step import generation
from megatron_multilora.training.step.evaluation import eval_mode
from megatron_multilora.training.step.grad_sync import SlotGradSync
from megatron_multilora.training.step.micro_batches import MicroBatcher
from megatron_multilora.training.step.reference import target_logprobs
from megatron_multilora.training.step.sampling import KeyedSampler, RowSampling
from megatron_multilora.training.step.schedule import per_slot_results_and_data
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer, slot_grad_norms
from megatron_multilora.training.step.train_step import start_reducing_losses


def client_job(name: str, rank: int) -> AdapterJob:
    """The settings a training client's slot starts with (its optimizer's come with every
    ``optim_step``): ``name`` seeds a fresh adapter as a recipe job's name does."""
    return AdapterJob(
        name=name,
        dataset="",
        rank=rank,
        alpha=2.0 * rank,
        lr=1e-4,
        schedule="constant",
        grad_clip=None,
        max_steps=1,
    )


class Engine:
    """Runs operations on ``model`` (its chunks): one slot per training client."""

    def __init__(
        self,
        model: list[torch.nn.Module],
        tokenizer,
        batcher: MicroBatcher,
        run_dir: Path,
        model_config,
        hf_dir: str | None,
        hf_model_type: str | None,
        complete: Callable[[str, Result], None],
    ) -> None:
        self.model, self.tokenizer, self.batcher = model_chunks(model), tokenizer, batcher
        self.run_dir, self.model_config = run_dir, model_config
        self.hf_dir, self.hf_model_type = hf_dir, hf_model_type
        self.complete = complete if dist.get_rank() == 0 else (lambda request_id, result: None)
        self.grad_sync = SlotGradSync(self.model)
        self.optimizers: dict[int, SlotOptimizer] = {}  # by slot: the training clients'
        self.versions: dict[int, int] = {}  # by slot: bumped whenever its weights change
        self.steps: dict[int, int] = {}  # by slot: its client's optim_steps here
        self.losses: dict[int, float] = {}  # by slot: its last forward_backward's loss
        self.saved: dict[str, tuple[int, int]] = {}  # sampler weights -> (slot, its version)

    # -- the batch ------------------------------------------------------------------------

    def run(self, ops: list[Op]) -> None:
        """Every op of the batch (a client has at most one in it): ended clients' slots
        freed and new clients created first (a client's first call may share its creation's
        batch), then every forward_backward together, the other calls in order, and every
        sample in one pass."""
        first = [op for op in ops if op.kind == "free"] + [
            op for op in ops if op.kind == "create" or op.args.get("init_key")
        ]
        for op in first:
            self._run_one(op)
        for forward_only in (False, True):
            batch = [
                op
                for op in ops
                if op.kind == "forward_backward" and op.args["forward_only"] == forward_only
            ]
            if batch:
                self._guarded(batch, partial(self._forward_backward, batch, forward_only))
        for op in ops:
            if op not in first and op.kind not in ("forward_backward", "sample"):
                self._run_one(op)
        samples = [op for op in ops if op.kind == "sample"]
        if samples:
            self._guarded(samples, lambda: self._sample(samples))

    def _run_one(self, op: Op) -> None:
        self._guarded(
            [op],
            lambda: self.complete(op.request_id, Result(JSON, getattr(self, op.kind)(**op.args))),
        )

    def _guarded(self, ops: list[Op], work: Callable[[], None]) -> None:
        try:
            work()
        except OpError as err:
            for op in ops:
                self.complete(op.request_id, Result(ERROR, (str(err), "user")))
        except Exception as err:  # one batch failing must not stop the service
            traceback.print_exc()  # a fault of ours: its traceback goes to the service's log
            for op in ops:
                self.complete(
                    op.request_id, Result(ERROR, (f"{type(err).__name__}: {err}", "server"))
                )

    # -- training clients -----------------------------------------------------------------

    def create(self, slot: int, rank: int, init_key: str, model_id: str) -> dict:
        self.optimizers[slot] = start_job(
            self.model, slot, client_job(init_key, rank), 1, self.model_config, self.hf_model_type
        )
        self.grad_sync.zero_grad([slot])
        self.versions[slot] = self.versions.get(slot, 0) + 1
        self.steps[slot] = 0
        self.losses.pop(slot, None)
        return {"type": "create_model", "model_id": model_id}

    def skip(self) -> dict:
        """A refused call's place in its client's order."""
        return {}

    def free(self, slot: int) -> dict:
        """A client gone (its session ended or timed out): its slot back to a fresh one."""
        self.grad_sync.zero_grad([slot])
        self.optimizers.pop(slot, None)
        clear_adapter_slot(self.model, slot)
        self.versions[slot] = self.versions.get(slot, 0) + 1
        self.steps.pop(slot, None)
        self.losses.pop(slot, None)
        return {}

    def _forward_backward(self, ops: list[Op], forward_only: bool) -> None:
        """The calls' datums in one packed forward/backward, split over data-parallel ranks
        (datum i on rank i mod dp; gradients are summed over them at the optim_step)."""
        dp = parallel_state.get_data_parallel_world_size()
        rank = parallel_state.get_data_parallel_rank()
        slot_examples: list[list[Example]] = [[] for _ in range(self.batcher.n_slots)]
        objectives = [None] * self.batcher.n_slots
        for op in ops:
            slot = op.args["slot"]
            slot_examples[slot] = [
                Example(tuple(d["tokens"]), (True,) * (len(d["tokens"]) - 1), d["values"], units=1)
                for d in op.args["data"][rank::dp]
            ]
            objectives[slot] = client_objective(
                op.args["loss"], op.args["clip_low"], op.args["clip_high"]
            )
        micro_batches = self.batcher.ready(slot_examples)
        # Sums, not means: each slot's loss weighs 1 (a client scales its own datums).
        ones = torch.zeros(self.batcher.n_slots, dtype=torch.int64).index_fill_(
            0, torch.tensor([op.args["slot"] for op in ops]), 1
        )
        with eval_mode(self.model) if forward_only else contextlib.nullcontext():
            table, kept = per_slot_results_and_data(
                self.model, micro_batches, ones, forward_only, objectives
            )
        logprobs = kept["logprobs"]
        losses = start_reducing_losses(table[:, 0].contiguous())()
        shares = [None] * dp  # every rank's log-probs of its datums, by slot
        if dp > 1:
            dist.all_gather_object(shares, logprobs, group=parallel_state.get_data_parallel_group())
        else:
            shares = [logprobs]
        for op in ops:
            slot, n = op.args["slot"], len(op.args["data"])
            if not forward_only:
                self.losses[slot] = float(losses[slot])
            per_datum = [{"logprobs": shares[i % dp][slot][i // dp]} for i in range(n)]
            self.complete(
                op.request_id,
                Result(
                    PROTOBUF,
                    wire.forward_backward_output(per_datum, {"loss:sum": float(losses[slot])}),
                ),
            )

    def optim_step(
        self,
        slot: int,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        grad_clip: float | None,
    ) -> dict:
        opt = self.optimizers[slot]
        self.grad_sync.sync([slot])
        norm = slot_grad_norms({slot: opt.params})[slot]
        if not math.isfinite(norm):
            self.grad_sync.zero_grad([slot])
            raise OpError(f"the gradient norm is {norm}: step skipped, gradients dropped")
        opt.set_hyperparameters(lr, tuple(betas), eps, weight_decay, grad_clip)
        opt.step(norm)
        self.grad_sync.zero_grad([slot])
        self.versions[slot] += 1
        self.steps[slot] += 1
        return {"metrics": {"grad_norm:mean": norm}}

    # -- saves and loads ------------------------------------------------------------------

    def save_state(self, slot: int, folder: str, path: str, meta: dict) -> dict:
        """The slot's adapter and optimizer as a training state (collective)."""
        snapshot = slot_snapshot(self.model, slot, self.optimizers[slot])
        if dist.get_rank() == 0:

            def fill(tmp: Path) -> None:
                save_file(
                    {k: v.contiguous() for k, v in snapshot.pop("tensors").items()},
                    str(tmp / "state.safetensors"),
                )
                write_json_atomic(tmp / STATE_META, {**meta, **snapshot})

            write_dir_atomic(Path(folder), fill, overwrite=True)
        dist.barrier()
        return {"type": "save_weights", "path": path}

    def load_state(
        self,
        slot: int,
        folder: str,
        optimizer: bool,
        path: str,
        model_id: str,
        init_key: str | None = None,
    ) -> dict:
        """A training state into the slot (``init_key``: a client created from it)."""
        meta = read_state_meta(Path(folder))
        if init_key is not None:
            self.create(slot, meta["rank"], init_key, model_id)
        opt = self.optimizers[slot]
        restore_slot(
            self.model,
            slot,
            meta,
            load_file(str(Path(folder) / "state.safetensors")),
            opt,
            optimizer,
        )
        self.grad_sync.zero_grad([slot])
        self.versions[slot] += 1
        return {"type": "load_weights", "path": path, "model_id": model_id}

    def save_for_sampler(self, slot: int, folder: str, answer: dict, meta: dict) -> dict:
        """The slot's adapter as sampler weights: an adapter folder (and a PEFT one on a
        Hugging Face base); a sampler made from them samples the slot itself while its
        weights stay as saved."""
        export_adapter(self.model, slot, Path(folder) / "adapter", meta, overwrite=True)
        self.saved[folder] = (slot, self.versions[slot])
        if self.hf_dir:
            export_peft(
                self.model,
                slot,
                Path(folder) / "peft",
                self.model_config,
                self.hf_model_type,
                self.hf_dir,
                overwrite=True,
            )
        return answer

    # -- sampling -------------------------------------------------------------------------

    def _sample(self, ops: list[Op]) -> None:
        """Every sample op in one generation pass. A sampler's weights are its client's slot
        while they are unchanged since they were saved, else they are loaded into a free
        slot for this pass; the base model samples from a free (cleared) slot."""
        free = [s for s in range(self.batcher.n_slots) if s not in self.optimizers]
        loaded: dict[str, int] = {}
        prompts, rows, limits, stops, owners = [], [], [], [], []
        for op in ops:
            a = op.args
            slot = self._sampler_slot(a, free, loaded)
            for k in range(a["num_samples"]):
                prompts.append((slot, a["prompt"]))
                rows.append(RowSampling(f"{a['key']}:{k}", a["temperature"], a["top_p"]))
                limits.append(a["max_tokens"])
                stops.append(frozenset(a["stop"]))
                owners.append(op)
        outputs = generation.generate(
            self.model,
            prompts,
            self.batcher.n_slots,
            limits,
            self.tokenizer.eos_id,
            self.batcher.pad_multiple,
            self.tokenizer.pad_id,
            pick=KeyedSampler(rows),
            stops=stops,
        )
        prompt_logprobs = self._prompt_logprobs(ops, free, loaded)
        for slot in loaded.values():
            clear_adapter_slot(self.model, slot)
        for op in ops:
            # A stop token is part of the sample (its log-prob is the last one).
            sequences = [
                self._cut_at_strings(
                    out.tokens + ([out.stop] if out.ended else []),
                    out.logprobs,
                    out.ended,
                    op.args["stop_strings"],
                )
                for out, owner in zip(outputs, owners)
                if owner is op
            ]
            self.complete(
                op.request_id,
                Result(
                    PROTOBUF, wire.sample_response(sequences, prompt_logprobs.get(op.request_id))
                ),
            )

    def _cut_at_strings(
        self, tokens: list[int], logprobs: list[float], ended: bool, strings: list[str]
    ) -> tuple[list[int], list[float], bool]:
        """The sample up to the first token whose text completes a stop string (included),
        as if it had stopped there: its draws before that point do not depend on later ones."""

        def stops(k: int) -> bool:
            text = self.tokenizer.decode(tokens[:k])
            return any(s in text for s in strings)

        if not strings or not stops(len(tokens)):
            return tokens, logprobs, ended
        low, high = 1, len(tokens)  # the shortest stopping prefix: a longer one stops too
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if stops(mid) else (mid + 1, high)
        return tokens[:high], logprobs[:high], True

    def _sampler_slot(self, a: dict, free: list[int], loaded: dict[str, int]) -> int:
        slot, version = self.saved.get(a["folder"], (None, None))
        if slot is not None and self.versions.get(slot) == version:
            return slot
        source = a["folder"] or "base"
        if source not in loaded:
            if not free:
                raise OpError(
                    "no free adapter slot to load these sampler weights into; "
                    "sample again when a client has ended (or sample from a "
                    "client's current weights)"
                )
            slot = loaded[source] = free.pop(0)
            if a["folder"]:
                import_adapter(self.model, slot, Path(a["folder"]) / "adapter")
        return loaded[source]

    def _prompt_logprobs(
        self, ops: list[Op], free: list[int], loaded: dict[str, int]
    ) -> dict[str, list[float]]:
        asked = [op for op in ops if op.args["prompt_logprobs"]]
        if not asked:
            return {}
        slot_examples: list[list[Example]] = [[] for _ in range(self.batcher.n_slots)]
        order = []
        for op in asked:
            slot = self._sampler_slot(op.args, free, loaded)
            tokens = op.args["prompt"]
            if len(tokens) < 2:  # nothing to score after the first token
                continue
            slot_examples[slot].append(Example(tuple(tokens), (True,) * (len(tokens) - 1)))
            order.append((op.request_id, slot, len(slot_examples[slot]) - 1))
        values = target_logprobs(self.model, slot_examples, self.batcher, adapters=True)
        scored = {request_id: [math.nan] + values[slot][i] for request_id, slot, i in order}
        return {op.request_id: scored.get(op.request_id, [math.nan]) for op in asked}
