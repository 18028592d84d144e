"""The service's model side: every training client is an adapter slot of one multi-LoRA
model, and the calls of many clients run together.

The engine takes a batch of operations (``Op``: plain data, the same on every rank, so
every rank of a parallel layout runs the same calls) and runs it on the runtime the trainer
runs on (``training/runtime.py``): every ``forward_backward`` of the batch (each client's at
most once: a client's calls run in its order) in one call of the step
(``SlotStep.train``), each client's loss the sum over its own datums by its own loss (the
objectives registry's per-token losses), its gradient accumulating in its slot until its
``optim_step``; the batch's ``optim_step`` calls in one ``SlotStep.apply`` (one gradient
sync, one norm pass); every ``sample`` in one generation pass, each row through its
sampler's adapter with draws keyed by the request (``step/sampling.py``). None depends on
who else is in the batch: a client whose loss or gradients are not finite is answered an
error, its gradients of that call dropped, and the others' pass is redone without it. Saves write ``<run_dir>/api/...`` folders: a training state (adapter
and optimizer, ``training/checkpoints.slot_snapshot``) or sampler weights (an adapter folder
and, on a Hugging Face base, a PEFT one).
"""

from __future__ import annotations

import itertools
import math
import shutil
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megatron_multilora.api import wire
from megatron_multilora.api.calls import (
    CREATE,
    FORWARD_BACKWARD,
    FREE,
    LOAD_STATE,
    OPTIM_STEP,
    RELEASE,
    SAMPLE,
    SAVE_FOR_SAMPLER,
    SAVE_STATE,
    SKIP,
    STATE_META,
    Op,
    OpError,
    read_state_meta,
)
from megatron_multilora.api.futures import ERROR, JSON, PROTOBUF, Result
from megatron_multilora.api.recorded_samples import RecordedSamples
from megatron_multilora.atomic_files import write_dir_atomic, write_json_atomic
from megatron_multilora.checkpoint.adapter_files import export_adapter, import_adapter
from megatron_multilora.checkpoint.peft_format import export_peft
from megatron_multilora.data.datasets import Example
from megatron_multilora.layers.lifecycle import TARGET_PARTS, clear_adapter_slot
from megatron_multilora.training.checkpoints import restore_slot, slot_snapshot
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.objectives.objective import SampleRequest
from megatron_multilora.training.objectives.registry import client_objective
from megatron_multilora.training.runtime import Runtime
from megatron_multilora.training.step.reference import target_logprobs
from megatron_multilora.training.step.sampling import cut_at_stop_strings
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer
from megatron_multilora.training.step.slot_step import SlotWork


def client_job(name: str, rank: int, parts: Sequence[str] = TARGET_PARTS) -> AdapterJob:
    """The settings a training client's slot starts with (its optimizer's come with every
    ``optim_step``): ``name`` seeds a fresh adapter as a recipe job's name does; it trains
    the ``parts`` of the model its LoraConfig asks for."""
    return AdapterJob(
        **{f"train_{part}": part in parts for part in TARGET_PARTS},
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
    """Runs operations on the runtime's model: one slot per training client. ``complete``
    answers a call (rank 0's front; the other ranks answer nothing)."""

    def __init__(
        self,
        runtime: Runtime,
        run_dir: Path,
        hf_dir: str | None,
        complete: Callable[[str, Result], None] | None,
    ) -> None:
        self.rt, self.model, self.tokenizer = runtime, runtime.model, runtime.tokenizer
        self.run_dir, self.hf_dir = run_dir, hf_dir
        self.n_slots = runtime.run.lora.slots
        # The clients' adapters by number, in a device slot or paged out: ``place`` puts
        # clients' in slots (paged in where they were out) and leaves ``room`` slots free.
        self.table = runtime.table
        self.tools = runtime.tools(lambda job, reason: None)
        self.complete = complete or (lambda request_id, result: None)  # rank 0's front
        # By a client's number (the front's Client.slot; its device slot is the table's):
        self.optimizers: dict[int, SlotOptimizer] = {}  # the training clients'
        self.versions: dict[int, int] = {}  # bumped whenever its weights change
        self.steps: dict[int, int] = {}  # its client's optim_steps here
        self.losses: dict[int, float] = {}  # its last forward_backward's loss
        self.saved: dict[str, tuple[int, int]] = {}  # sampler weights -> (client, its version)
        api = runtime.run.api
        self.recorded = RecordedSamples(  # samples drawn with record_stability_info
            api.recorded_samples_per_session, int(api.recorded_samples_mb * 2**20)
        )
        self.calls = self._call_table()

    # -- the batch ------------------------------------------------------------------------

    def _call_table(self) -> dict[str, tuple[int, Callable[[list[Op]], None]]]:
        """Each call kind's phase of a batch and its handler, which takes the batch's calls
        of that kind (in batch order). Phases run in order: ended clients' slots freed and
        new clients created first (a client's first call may share its creation's batch),
        every forward_backward together, every optim_step together, the calls that run one
        by one (in batch order, whatever their kind), every sample in one pass, and last the
        releases of sampler weights the samples may read."""
        each = self._each
        return {
            FREE: (0, each(self.free)),
            CREATE: (1, each(self.create)),
            FORWARD_BACKWARD: (2, self._forward_backwards),
            OPTIM_STEP: (3, self._optim_steps),
            SKIP: (4, each(self.skip)),
            SAVE_STATE: (4, each(self.save_state)),
            LOAD_STATE: (4, each(self.load_state)),
            SAVE_FOR_SAMPLER: (4, each(self.save_for_sampler)),
            SAMPLE: (5, self._sample),
            RELEASE: (6, each(self.release)),
        }

    def run(self, ops: list[Op]) -> None:
        """Every op of the batch (a client has at most one in it), phase by phase
        (:meth:`_call_table`; a client created from a training state is created with the new
        ones), each phase's calls in batch order: a run of calls of one kind to its handler
        at once."""
        calls = self.calls
        by_phase: dict[int, list[Op]] = {}
        for op in ops:
            phase = calls[CREATE][0] if op.args.get("init_key") else calls[op.kind][0]
            by_phase.setdefault(phase, []).append(op)
        for phase in sorted(by_phase):
            for kind, run in itertools.groupby(by_phase[phase], key=lambda op: op.kind):
                calls[kind][1](list(run))

    def _each(self, handler: Callable[..., dict]) -> Callable[[list[Op]], None]:
        """A handler of one call (its arguments as keywords, its answer JSON) as a phase's."""

        def answer(op: Op) -> None:
            self.complete(op.request_id, Result(JSON, handler(**op.args)))

        def run_each(ops: list[Op]) -> None:
            for op in ops:
                self._guarded([op], partial(answer, op))

        return run_each

    def _forward_backwards(self, ops: list[Op]) -> None:
        """The training passes first, then the forward-only ones: one step call each."""
        for forward_only in (False, True):
            batch = [op for op in ops if op.args["forward_only"] == forward_only]
            if batch:
                self._forward_backward(batch, forward_only)

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

    def create(self, slot: int, rank: int, init_key: str, model_id: str, parts: list[str]) -> dict:
        """A fresh adapter for client ``slot``, training the ``parts`` its client's LoraConfig
        asks for (attn, mlp, unembed)."""
        device = self.table.place([slot])[slot]
        self.optimizers[slot] = self.rt.start_slot(device, client_job(init_key, rank, parts), 1)
        self.table.bind(slot, self.optimizers[slot])
        self.rt.step.drop([device])
        self.versions[slot] = self.versions.get(slot, 0) + 1
        self.steps[slot] = 0
        self.losses.pop(slot, None)
        return {"type": "create_model", "model_id": model_id}

    def skip(self) -> dict:
        """A refused call's place in its client's order."""
        return {}

    def free(self, slot: int) -> dict:
        """A client gone (its session ended or timed out): its device slot back to a fresh one
        (or its page dropped)."""
        self.optimizers.pop(slot, None)
        device = self.table.forget(slot)
        if device is not None:
            self.rt.free_slot(device)
        self.versions[slot] = self.versions.get(slot, 0) + 1
        self.steps.pop(slot, None)
        self.losses.pop(slot, None)
        return {}

    def _forward_backward(self, ops: list[Op], forward_only: bool) -> None:
        """The calls' datums in one call of the step (each client's loss a sum over its
        datums), as many clients at a time as there are device slots; a client whose loss or
        gradients are not finite is refused, its gradients of this call dropped, the others
        answered as if it were not there."""
        for group in self._by_slots(ops):
            self._guarded(group, partial(self._forward_backward_group, group, forward_only))

    def _by_slots(self, ops: list[Op]) -> list[list[Op]]:
        """``ops`` (one per client) in groups of at most the device slots."""
        return [ops[i : i + self.n_slots] for i in range(0, len(ops), self.n_slots)]

    def _forward_backward_group(self, ops: list[Op], forward_only: bool) -> None:
        device = self.table.place([op.args["slot"] for op in ops])
        work = {}
        for op in list(ops):
            try:
                examples = [self._example(op.args, i, d) for i, d in enumerate(op.args["data"])]
            except OpError as err:
                self.complete(op.request_id, Result(ERROR, (str(err), "user")))
                ops.remove(op)
                continue
            work[device[op.args["slot"]]] = SlotWork(
                examples,
                client_objective(op.args["loss"], op.args["config"]),
                mean=False,  # a sum, as Tinker's: a client scales its own datums
            )
        if not work:
            return
        step = self.rt.step
        result = (step.forward if forward_only else step.train)(work, keep=("logprobs",))
        for op in ops:
            client, slot = op.args["slot"], device[op.args["slot"]]
            if slot in result.skipped:
                self.complete(
                    op.request_id,
                    Result(
                        ERROR,
                        (
                            "the loss or the gradients of this call are not finite: its gradients are "
                            "dropped (the client's earlier ones are kept)",
                            "user",
                        ),
                    ),
                )
                continue
            loss = float(result.losses[slot])
            if not forward_only:
                self.losses[client] = loss
            per_datum = [{"logprobs": lp} for lp in result.kept["logprobs"][slot]]
            self.complete(
                op.request_id,
                Result(PROTOBUF, wire.forward_backward_output(per_datum, {"loss:sum": loss})),
            )

    def _example(self, args: dict, i: int, datum: dict) -> Example:
        """A datum as the step's example; a stable_reinforce datum's sampler log-probs are
        the recorded samples' its provenance names."""
        tokens, targets, values = datum["tokens"], datum["targets"], dict(datum["values"])
        if "spans" in datum:
            values["logprobs"] = self.recorded.sampler_logprobs(
                args["session"],
                tokens[:-1],
                targets or tokens[1:],
                datum["spans"],
                values["logprobs"],
                f"datum {i}",
            )
        mask = (True,) * (len(tokens) - 1)
        return Example(tuple(tokens), mask, values, 1, tuple(targets) if targets else None)

    def release(self, folders: list[str], session: str | None) -> dict:
        """Free sampler weights no sampler uses any more, and an ended session's recorded
        samples."""
        if session is not None:
            self.recorded.forget(session)
        for folder in folders:
            self.saved.pop(folder, None)
            if dist.get_rank() == 0:
                shutil.rmtree(folder, ignore_errors=True)
        return {}

    def _optim_steps(self, ops: list[Op]) -> None:
        """Every optim_step of the batch in one ``SlotStep.apply`` per group of clients that
        fits the device slots: each client's optimizer with its call's hyperparameters; a
        client whose gradient norm is not finite does not step (its call is refused), its
        gradients dropped."""
        for group in self._by_slots(ops):
            self._guarded(group, partial(self._optim_step_group, group))

    def _optim_step_group(self, ops: list[Op]) -> None:
        device = self.table.place([op.args["slot"] for op in ops])
        for op in ops:
            a = op.args
            self.optimizers[a["slot"]].set_hyperparameters(
                a["lr"], tuple(a["betas"]), a["eps"], a["weight_decay"], a["grad_clip"]
            )
        norms, skipped = self.rt.step.apply(
            {device[op.args["slot"]]: self.optimizers[op.args["slot"]] for op in ops}
        )
        for op in ops:
            client, slot = op.args["slot"], device[op.args["slot"]]
            if slot in skipped:
                message = f"the gradient norm is {norms[slot]}: step skipped, gradients dropped"
                self.complete(op.request_id, Result(ERROR, (message, "user")))
                continue
            self.versions[client] += 1
            self.steps[client] += 1
            self.complete(op.request_id, Result(JSON, {"metrics": {"grad_norm:mean": norms[slot]}}))

    # -- saves and loads ------------------------------------------------------------------

    def save_state(self, slot: int, folder: str, path: str, meta: dict) -> dict:
        """The client's adapter and optimizer as a training state (collective)."""
        device = self.table.place([slot])[slot]
        snapshot = slot_snapshot(self.model, device, self.optimizers[slot])
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
        """A training state into the client (``init_key``: a client created from it)."""
        meta = read_state_meta(Path(folder))
        if init_key is not None:
            self.create(slot, meta["rank"], init_key, model_id, TARGET_PARTS)  # its own zeros
        opt = self.optimizers[slot]
        device = self.table.place([slot])[slot]
        restore_slot(
            self.model,
            device,
            meta,
            load_file(str(Path(folder) / "state.safetensors")),
            opt,
            optimizer,
        )
        self.rt.step.drop([device])
        self.versions[slot] += 1
        return {"type": "load_weights", "path": path, "model_id": model_id}

    def save_for_sampler(self, slot: int, folder: str, answer: dict, meta: dict) -> dict:
        """The client's adapter as sampler weights: an adapter folder (and a PEFT one on a
        Hugging Face base); a sampler made from them samples the client's adapter itself
        while its weights stay as saved."""
        device = self.table.place([slot])[slot]
        export_adapter(self.model, device, Path(folder) / "adapter", meta, overwrite=True)
        self.saved[folder] = (slot, self.versions[slot])
        if self.hf_dir:
            export_peft(
                self.model,
                device,
                Path(folder) / "peft",
                self.rt.model_config,
                self.rt.hf_model_type,
                self.hf_dir,
                overwrite=True,
            )
        return answer

    # -- sampling -------------------------------------------------------------------------

    def _sample(self, ops: list[Op]) -> None:
        """Every sample op in one generation pass (or as many as the device slots need). A
        sampler's weights are its client's adapter while they are unchanged since they were
        saved, else they are loaded into a free slot for this pass; the base model samples
        from a free (blank) slot."""
        passes: list[tuple[list[Op], set]] = []
        for op in ops:
            need = self._sampler_source(op.args)
            if not passes or (need not in passes[-1][1] and len(passes[-1][1]) == self.n_slots):
                passes.append(([], set()))
            passes[-1][0].append(op)
            passes[-1][1].add(need)
        for pass_ops, needs in passes:
            self._guarded(pass_ops, partial(self._sample_pass, pass_ops, needs))

    def _sampler_source(self, a: dict) -> tuple[str, object]:
        """What a sample op samples: a client's current adapter, or a folder (None: base)."""
        client, version = self.saved.get(a["folder"], (None, None))
        if client is not None and self.versions.get(client) == version:
            return ("client", client)
        return ("folder", a["folder"])

    def _sample_pass(self, ops: list[Op], needs: set) -> None:
        clients = [key for kind, key in needs if kind == "client"]
        self.table.place(clients, room=len(needs) - len(clients))
        free = self.table.free_slots()
        loaded: dict[str, int] = {}
        requests, owners = [], []
        for op in ops:
            a = op.args
            slot = self._sampler_slot(a, free, loaded)
            for k in range(a["num_samples"]):
                requests.append(
                    SampleRequest(
                        slot,
                        a["prompt"],
                        f"{a['key']}:{k}",
                        a["temperature"],
                        a["top_p"],
                        a["max_tokens"],
                        frozenset(a["stop"]),
                    )
                )
                owners.append(op)
        outputs = self.tools.generate(requests)
        prompt_logprobs = self._prompt_logprobs(ops, free, loaded)
        for slot in loaded.values():
            clear_adapter_slot(self.model, slot)
        for op in ops:
            # A stop token is part of the sample (its log-prob is the last one).
            sequences = [
                cut_at_stop_strings(
                    self.tokenizer.decode,
                    out.tokens + ([out.stop] if out.ended else []),
                    out.logprobs,
                    out.ended,
                    op.args["stop_strings"],
                )
                for out, owner in zip(outputs, owners)
                if owner is op
            ]
            if op.args["record"]:
                self.recorded.record(
                    op.args["session"],
                    op.args["prompt"],
                    {f"{op.request_id}:{k}": seq[:2] for k, seq in enumerate(sequences)},
                )
            self.complete(
                op.request_id,
                Result(
                    PROTOBUF, wire.sample_response(sequences, prompt_logprobs.get(op.request_id))
                ),
            )

    def _sampler_slot(self, a: dict, free: list[int], loaded: dict[str, int]) -> int:
        kind, key = self._sampler_source(a)
        if kind == "client":
            return self.table.slot_of(key)
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
        slot_examples: list[list[Example]] = [[] for _ in range(self.n_slots)]
        order = []
        for op in asked:
            slot = self._sampler_slot(op.args, free, loaded)
            tokens = op.args["prompt"]
            if len(tokens) < 2:  # nothing to score after the first token
                continue
            slot_examples[slot].append(Example(tuple(tokens), (True,) * (len(tokens) - 1)))
            order.append((op.request_id, slot, len(slot_examples[slot]) - 1))
        values = target_logprobs(self.model, slot_examples, self.rt.step.batcher, adapters=True)
        scored = {request_id: [math.nan] + values[slot][i] for request_id, slot, i in order}
        return {op.request_id: scored.get(op.request_id, [math.nan]) for op in asked}
