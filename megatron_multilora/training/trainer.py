"""The multi-LoRA trainer: N adapter jobs on one frozen Megatron-core model, from setup to
the final adapter x task tables.

setup: the parallel layout, tokenizer, model (``model_setup.build_run_model``), every job's
data, the job queue, a resumed checkpoint and the submitted jobs the run's journal adds
later. train: at each step boundary, honour an agreed stop, add submitted jobs and cancel
jobs (``mmlora``, training/job_inbox.py; decided on rank 0, broadcast, journaled), admit
queued jobs into free slots (starting from an adapter folder, a PEFT folder or fresh
weights); then run one :class:`SlotTrainStep` over every active job's global batch, end the
jobs that reached their budget (export, slot handed on) or failed, and log, evaluate and
checkpoint on schedule. A serving run (``trainer.serve``) waits for submissions when no job
is left. finish: every exported adapter on every task, and how each job ended.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_multilora.checkpoint.adapter_files import export_adapter, import_adapter
from megatron_multilora.checkpoint.adapter_folders import FolderFormat, folder_format
from megatron_multilora.checkpoint.peft_format import export_peft, import_peft
from megatron_multilora.data.datasets import Example, load_dataset, read_jsonl_records
from megatron_multilora.data.packing import shard_for_data_parallel
from megatron_multilora.data.tokenizer import ByteTokenizer, HFTokenizer
from megatron_multilora.layers.lifecycle import (
    ModelOrChunks,
    clear_adapter_slot,
    init_adapter_slot,
    slot_parameters,
)
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.models.hf_config import read_hf_config
from megatron_multilora.models.hf_import import load_hf_tokenizer
from megatron_multilora.parallel import destroy_parallel, init_parallel
from megatron_multilora.training.adapter_task_eval import AdapterTaskEval
from megatron_multilora.training.checkpoints import (
    find_resume_point,
    prepare_checkpoint_folder,
    read_training_state,
    restore_training_checkpoint,
    save_training_checkpoint,
)
from megatron_multilora.training import job_inbox
from megatron_multilora.training.config import (
    AdapterJob,
    ConfigError,
    RunConfig,
    adapter_job,
    base_model_config,
    job_alpha,
    job_problems,
    name_problems,
    to_plain,
)
from megatron_multilora.training.job_states import (
    ACTIVE,
    CANCELLED,
    DONE,
    ENDED,
    FAILED,
    FINISHED,
    IDLE,
    QUEUED,
    STOPPED,
    TRAINING,
)
from megatron_multilora.training.jobs import JobQueue, JobState, planned_steps
from megatron_multilora.training.metrics import (
    METRICS_FILE,
    MetricsLogger,
    Progress,
    format_adapter_line,
    keep_first_records,
    read_metrics,
)
from megatron_multilora.training.job_requests import JobRequests
from megatron_multilora.training.model_setup import build_run_model
from megatron_multilora.training.step.micro_batches import agree
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer
from megatron_multilora.training.step.train_step import SlotTrainStep
from megatron_multilora.training.stop import STOP_REQUESTED, RunStopped, received


def start_job(model: ModelOrChunks, slot: int, job: AdapterJob, total_steps: int,
              model_config: GPTModelConfig, hf_model_type: Optional[str] = None) -> SlotOptimizer:
    """Put ``job``'s adapter into ``slot``: from its ``init_from`` folder (an adapter or a
    PEFT folder; ``hf_model_type`` names the PEFT modules, default llama) or fresh weights;
    returns the slot's optimizer for ``total_steps`` steps."""
    if job.init_from and folder_format(job.init_from) is FolderFormat.PEFT:
        import_peft(model, slot, job.init_from, model_config, hf_model_type or "llama")
    elif job.init_from:
        import_adapter(model, slot, job.init_from)
    else:  # initialised from the job, not the slot: the same adapter in any slot
        clear_adapter_slot(model, slot, init_key=job.name)
    # An imported adapter keeps its own alpha (validate refused a differing job alpha).
    init_adapter_slot(model, slot, job.rank, job_alpha(job), job.dropout)
    return SlotOptimizer(slot_parameters(model, slot), job, total_steps)


# What a run writes into run_dir (its recorded hydra/ config aside): moved to
# run_dir/previous/<n> when a run starts over there, so nothing is overwritten or mixed.
RUN_OUTPUTS = (METRICS_FILE, "checkpoints", "adapters", "peft", "wandb", "loss_curves.png",
               "adapter_task_loss.png")


class Trainer:
    """Trains ``run``'s adapter jobs: :meth:`setup`, :meth:`train`, then :meth:`finish` (or
    :meth:`stopped` when :meth:`train` raised RunStopped). ``run`` must have passed
    ``config.validate``."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.run_dir = Path(run.run_dir)
        self.model_config = base_model_config(run)  # hf_dir's architecture, or run.model
        # Read once: exports and every checkpoint's adapter meta name the HF model type.
        self.hf_model_type = read_hf_config(run.hf_dir)["model_type"] if run.hf_dir else None

    # ----- setup, in order ----------------------------------------------------------------

    def setup(self) -> None:
        run = self.run
        init_parallel(tensor_model_parallel_size=run.parallel.tp,
                      expert_model_parallel_size=run.parallel.ep,
                      pipeline_model_parallel_size=run.parallel.pp,
                      virtual_pipeline_model_parallel_size=run.parallel.vpp,
                      sequence_parallel=run.parallel.sp, seed=run.seed)
        self.is_main = dist.get_rank() == 0
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.pad_multiple = run.parallel.tp if run.parallel.sp else 1
        self.tokenizer = (HFTokenizer(load_hf_tokenizer(run.hf_dir)) if run.hf_dir
                          else ByteTokenizer())
        self.model = build_run_model(run, self.model_config)  # its chunks
        self.n_slots = run.lora.slots
        self.train_step = SlotTrainStep(self.model, self.n_slots, run.trainer.micro_batch_tokens,
                                        self.pad_multiple, self.tokenizer.pad_id)
        self.train_data, self.eval_records, self.eval_data = [], [], []
        for job in run.adapters:
            self._load_job_data(job)
        self.queue = JobQueue(run.adapters, [len(d) for d in self.train_data], self.n_slots,
                              run.trainer.steps_per_job)
        self.optimizers: dict[int, SlotOptimizer] = {}
        self.step = 0
        # (stop signal, job requests) agreed by the last step, if any since the boundary
        self._agreed: Optional[tuple[int, int]] = None
        self.config_jobs = len(run.adapters)  # submitted jobs follow them in run.adapters
        self.requests = JobRequests(self.run_dir)
        self._job_metrics: dict[str, dict[str, float]] = {}  # for status.json
        self._seconds_per_step: Optional[float] = None
        self._status_time = 0.0  # when status.json was last written
        self._resume()
        for job in self.requests.replay(self.step, {job.name for job in run.adapters}):
            self._add_job(AdapterJob(**job))
        self.logger = MetricsLogger(self.run_dir, self.is_main, run.logging.wandb_mode,
                                    run.logging.wandb_project, self.run_dir.name,
                                    {**to_plain(run), "model": dataclasses.asdict(self.model_config)})
        self.tasks = AdapterTaskEval(self.model, self.tokenizer, self.eval_data, self.eval_records,
                                     self.n_slots, run.trainer.micro_batch_tokens,
                                     self.pad_multiple, run.trainer.max_new_tokens)
        if self.is_main:
            trainable = sum(p.numel() for chunk in self.model for p in chunk.parameters()
                            if p.requires_grad)
            print(f"run {self.run_dir}: {len(run.adapters)} adapter jobs on {self.n_slots} slots, "
                  f"world {dist.get_world_size()} (tp {run.parallel.tp}, sp {run.parallel.sp}, "
                  f"ep {run.parallel.ep}, pp {run.parallel.pp}"
                  f"{f' x vpp {run.parallel.vpp}' if run.parallel.vpp else ''}, dp {self.dp_size}), {trainable:,} trainable parameters "
                  f"per rank, starting at step {self.step}", flush=True)

    def _optimizer(self, slot: int, state: JobState) -> SlotOptimizer:
        return SlotOptimizer(slot_parameters(self.model, slot), self.run.adapters[state.index],
                             state.total_steps)

    def _resume(self) -> None:
        """Continue from the newest intact checkpoint (``checkpoint.resume=auto``; damaged newer
        ones are set aside) or the one given; or start at step 0 (``never``, or nothing saved
        yet), moving an earlier run's outputs aside so nothing is overwritten or logged twice."""
        self._saved: tuple[int, Path] | None = None  # (step, folder) of the last checkpoint
        point = find_resume_point(self.run_dir, self.run.checkpoint.resume)
        for note in point.notes:
            self._say(note)
        if point.path is None:
            if self.is_main:
                self._move_previous_run_aside()
            dist.barrier()
            return
        if self.is_main:
            for line in prepare_checkpoint_folder(self.run_dir, point):
                print(line, flush=True)
        dist.barrier()
        saved = read_training_state(point.path)
        for job in saved["trainer"].get("submitted", []):  # added before the checkpoint
            self._add_job(AdapterJob(**job))
        self.queue.load_state_dict(saved["trainer"]["queue"])
        by_slot = {s.slot: s for s in self.queue.active()}
        self.optimizers = restore_training_checkpoint(
            point.path, saved, self.model, lambda slot: self._optimizer(slot, by_slot[slot]))
        self.step = saved["step"]
        self._saved = (self.step, point.path)
        if self.is_main:
            keep_first_records(self.run_dir / METRICS_FILE, saved["trainer"]["metrics_records"])
            print(f"resumed from {point.path} at step {self.step}", flush=True)

    def _move_previous_run_aside(self) -> None:
        # A run starting over on purpose also leaves the earlier submissions behind; one that
        # found no checkpoint (killed before its first) replays them (JobRequests.replay).
        outputs = RUN_OUTPUTS + ((job_inbox.SERVE_DIR,) if self.run.checkpoint.resume == "never"
                                 else ())
        found = [name for name in outputs if (self.run_dir / name).exists()]
        if not found:
            return
        n = 1
        while (self.run_dir / "previous" / str(n)).exists():
            n += 1
        dest = self.run_dir / "previous" / str(n)
        dest.mkdir(parents=True)
        for name in found:
            os.replace(self.run_dir / name, dest / name)
        why = ("checkpoint.resume=never" if self.run.checkpoint.resume == "never"
               else "no checkpoint to resume")
        print(f"{self.run_dir} holds an earlier run ({why}): starting at step 0, its outputs "
              f"({', '.join(found)}) moved to {dest}", flush=True)

    def _load_job_data(self, job: AdapterJob) -> None:
        """Append the job's training examples and its evaluation records and examples."""
        trainer = self.run.trainer
        self.train_data.append(load_dataset(job.dataset, self.tokenizer, trainer.max_seq_len))
        self.eval_records.append(read_jsonl_records(job.eval_dataset)[:trainer.eval_samples]
                                 if job.eval_dataset else [])
        self.eval_data.append(load_dataset(job.eval_dataset, self.tokenizer, trainer.max_seq_len)
                              [:trainer.eval_samples] if job.eval_dataset else [])

    def _add_job(self, job: AdapterJob) -> JobState:
        """Queue a submitted job (from its ``start_step`` on), with its data, evaluation and
        metrics like a config job's."""
        self.run.adapters.append(job)  # the queue's own list of jobs
        self._load_job_data(job)
        return self.queue.add(job, len(self.train_data[-1]))

    # ----- step boundaries: stop, job requests --------------------------------------------

    def _boundary(self) -> int:
        """Stop here (checkpoint, RunStopped) if any rank got a stop signal or ``mmlora stop``
        was asked; else return how many job requests rank 0 saw (agreed on every rank)."""
        agreed, self._agreed = self._agreed, None
        if agreed is None:  # no step since the last boundary agreed on it
            agreed = agree([], 0, (self._local_stop(), self._local_requests())).extras
        signum, requests = agreed
        if signum:
            checkpoint = self._save()
            if self.is_main and signum == STOP_REQUESTED:
                job_inbox.clear_stop_request(self.run_dir)  # honoured: a resumed run trains on
            self._write_status(STOPPED)
            raise RunStopped(signum, self.step, checkpoint)
        return requests

    def _local_stop(self) -> int:
        return received() or (STOP_REQUESTED if self.is_main and
                              job_inbox.stop_requested(self.run_dir) else 0)

    def _local_requests(self) -> int:
        return self.requests.pending() if self.is_main else 0

    def _take_requests(self, requests: int) -> None:
        """Rank 0 decides on the pending requests (journaled first), every rank applies the
        broadcast decision; then this boundary's cancellations happen."""
        granted = []
        if requests:
            decision = [self.requests.decide(
                self.step, {job.name for job in self.run.adapters},
                {s.name for s in self.queue.states if s.status in ENDED},
                self._checked_submission, self._say) if self.is_main else None]
            if dist.get_world_size() > 1:
                dist.broadcast_object_list(decision, src=0)
            for job in decision[0]["add"]:
                state = self._add_job(AdapterJob(**job))
                self._say(f"step {self.step}: submitted job {state.name} joins the queue "
                          f"({state.total_steps} steps)")
            granted = decision[0]["cancel"]
            self._write_status(TRAINING)
        for name in self.requests.cancels_at(self.step, granted):
            self._cancel(name)

    def _checked_submission(self, sub: job_inbox.Submission
                            ) -> tuple[Optional[AdapterJob], list[str]]:
        """The submitted job and what is wrong with it now (``mmlora submit`` checked it,
        but files and the run may have changed since, and anyone can write the folder)."""
        where = f"submitted job {sub.name}"
        try:
            job = adapter_job(sub.job, where)
        except ConfigError as err:
            return None, [str(err)]
        return job, (name_problems(job.name, where)
                     + job_problems(job, where, self.run.lora.max_rank, self.dp_size))

    def _cancel(self, name: str) -> None:
        state = next(s for s in self.queue.states if s.name == name)
        if state.status == ACTIVE:
            self._end(state, CANCELLED, f"cancelled after {state.steps_done} steps; exported as "
                                        "it stood")
        elif state.status == QUEUED:
            self.queue.release(state, CANCELLED, "cancelled before it started")
            self._say(f"step {self.step}: job {name} cancelled before it started")
            self._write_status(TRAINING)

    def _write_status(self, state: str, force: bool = True) -> None:
        """Rank 0: the run's state and a row per job for ``mmlora status``; routine updates
        (``force=False``) at most once a second (each is a synced file write)."""
        if not self.is_main or (not force and time.time() - self._status_time < 1.0):
            return
        self._status_time = time.time()
        rows = []
        for s in self.queue.states:
            metrics = self._job_metrics.get(s.name, {})
            left = s.total_steps - s.steps_done
            rows.append({"name": s.name, "status": s.status, "slot": s.slot,
                         "steps_done": s.steps_done, "total_steps": s.total_steps,
                         "loss": metrics.get("loss"), "eval_loss": metrics.get("eval_loss"),
                         "tokens_per_s": metrics.get("tokens_per_s"),
                         "eta_s": (left * self._seconds_per_step if s.status == ACTIVE
                                   and self._seconds_per_step else None),
                         "source": "config" if s.index < self.config_jobs else "submitted"})
        job_inbox.write_status(self.run_dir, {
            "state": state, "step": self.step, "updated_at": time.time(), "pid": os.getpid(),
            "host": socket.gethostname(), "dp_size": self.dp_size,
            "max_rank": self.run.lora.max_rank, "slots": self.n_slots, "jobs": rows})

    # ----- training -----------------------------------------------------------------------

    def _start(self, state: JobState) -> None:
        job = self.run.adapters[state.index]
        self.optimizers[state.slot] = start_job(self.model, state.slot, job, state.total_steps,
                                                self.model_config, self.hf_model_type)
        self._say(f"step {self.step}: job {job.name} starts on slot {state.slot} "
                  f"({state.total_steps} steps)")
        self._write_status(TRAINING)

    def _end(self, state: JobState, status: str, reason: str) -> None:
        job = self.run.adapters[state.index]
        if status in (DONE, CANCELLED):
            self._export(state, cancelled=status == CANCELLED)
        slot = self.queue.release(state, status, reason)
        self.optimizers.pop(slot).zero_grad()
        clear_adapter_slot(self.model, slot)  # weights, rank, alpha back to a fresh slot
        self._say(f"step {self.step}: job {job.name} {status} ({reason}); slot {slot} is free")
        self._write_status(TRAINING)

    def _export(self, state: JobState, cancelled: bool = False) -> None:
        """Write the job's slot as an adapter folder (and a PEFT folder on an HF base)."""
        job = self.run.adapters[state.index]
        meta = self._adapter_meta(job, state)
        if cancelled:
            meta["cancelled"] = True
        export_adapter(self.model, state.slot, self.run_dir / "adapters" / job.name, meta,
                       overwrite=True)
        if self.run.hf_dir:
            export_peft(self.model, state.slot, self.run_dir / "peft" / job.name,
                        self.model_config, self.hf_model_type,
                        str(Path(self.run.hf_dir).resolve()), overwrite=True,
                        dropout=job.dropout)

    def _adapter_meta(self, job, state: JobState) -> dict:
        """What an exported adapter (and a checkpoint, for its training jobs) records beside
        the tensors: enough to rebuild the base's shapes and name its modules."""
        meta = {"name": job.name, "dropout": job.dropout, "targets": list(self.run.lora.targets),
                "max_rank": self.run.lora.max_rank, "steps": state.steps_done,
                "total_steps": state.total_steps, "finished": state.steps_done >= state.total_steps,
                "base_model": dataclasses.asdict(self.model_config)}
        if self.run.hf_dir:
            meta.update(hf_dir=str(Path(self.run.hf_dir).resolve()), hf_model_type=self.hf_model_type)
        return meta

    def _global_batch(self, active: list[JobState]) -> tuple[list[list[Example]], dict[int, int]]:
        """This rank's examples per slot, and each slot's tokens over all ranks."""
        slot_examples: list[list[Example]] = [[] for _ in range(self.n_slots)]
        tokens = {}
        for state in active:
            job = self.run.adapters[state.index]
            data = self.train_data[state.index]
            picked = self.queue.next_samples(state, job.global_batch_size, len(data), self.run.seed)
            slot_examples[state.slot] = [data[i] for i in
                                         shard_for_data_parallel(picked, self.dp_rank, self.dp_size)]
            tokens[state.slot] = sum(len(data[i].tokens) for i in picked)
        return slot_examples, tokens

    def train_one_step(self, active: list[JobState]) -> dict[int, dict[str, float]]:
        """One trainer step; returns per-slot metrics of the slots that stepped."""
        slot_examples, tokens = self._global_batch(active)
        # Packed in rank order, a micro-batch holds jobs of similar rank: the layers compute at
        # the largest rank present, so low-rank jobs do not pay for a high-rank one.
        rank = {s.slot: self.run.adapters[s.index].rank for s in active}
        order = sorted(range(self.n_slots), key=lambda slot: rank.get(slot, 0))
        optimizers = {s.slot: self.optimizers[s.slot] for s in active}
        lrs = {slot: opt.lr for slot, opt in optimizers.items()}  # what this step uses
        result = self.train_step(slot_examples, optimizers, slot_order=order,
                                 extras=(self._local_stop(), self._local_requests()))
        self._agreed = result.extras  # for the coming step boundary
        stats = {}
        for state in active:
            job = self.run.adapters[state.index]
            if state.slot in result.skipped:
                state.bad_steps += 1
                self._say(f"step {self.step}: job {job.name} has non-finite loss/gradients; "
                          f"step skipped ({state.bad_steps}/{self.run.trainer.max_bad_steps})")
                continue
            state.bad_steps = 0
            state.steps_done += 1
            stats[state.slot] = {"loss": float(result.losses[state.slot]), "lr": lrs[state.slot],
                                 "grad_norm": result.grad_norms[state.slot],
                                 "tokens": tokens[state.slot],
                                 "loss_tokens": float(result.loss_tokens[state.slot])}
        return stats

    def _planned(self) -> int:
        budget = self.step + planned_steps(self.run.adapters, self.queue.states, self.n_slots)
        return min(budget, self.run.trainer.max_steps or budget)

    def train(self) -> None:
        tr = self.run.trainer
        progress = Progress(self._planned(), self.is_main, initial=self.step)
        window: dict[str, list[float]] = {}
        window_start, window_step = time.perf_counter(), self.step
        self._write_status(TRAINING)
        while tr.max_steps is None or self.step < tr.max_steps:
            requests = self._boundary()
            self._take_requests(requests)
            if requests:  # jobs added or cancelled: the plan changed
                progress.set_total(self._planned(), self.step)
            for state in self.queue.admit(self.step):
                self._start(state)
            active = self.queue.active()
            if not active and self.queue.finished():
                if not tr.serve:
                    break
                self._write_status(IDLE, force=False)  # wait for submissions, sleeping
                time.sleep(tr.serve_poll_seconds)
                window_start, window_step = time.perf_counter(), self.step
                continue
            if not active:  # every remaining job starts later
                self.step += 1
                continue
            stats = self.train_one_step(active)
            self.step += 1
            for state in active:
                job_name = self.run.adapters[state.index].name
                if state.slot in stats:
                    window.setdefault(job_name, []).append(stats[state.slot])
                if state.bad_steps >= tr.max_bad_steps:
                    self._end(state, FAILED, f"{state.bad_steps} non-finite steps in a row")
                elif state.steps_done >= state.total_steps:
                    self._end(state, DONE, f"{state.steps_done} steps")
            progress.update(self.step)
            if self.step % tr.log_interval == 0 or self.queue.finished():
                seconds = time.perf_counter() - window_start
                self._seconds_per_step = seconds / max(1, self.step - window_step)
                self._log_train(window, seconds, progress)
                window, window_start, window_step = {}, time.perf_counter(), self.step
                self._write_status(TRAINING, force=False)
            if tr.eval_interval and self.step % tr.eval_interval == 0:
                self._log_eval(progress)
            every = self.run.checkpoint.save_interval
            if every and self.step % every == 0:
                self._save()
        progress.close()
        self._save()
        for state in self.queue.active():  # cut short by trainer.max_steps: export as is
            self._export(state)

    def _log_train(self, window, seconds: float, progress: Progress) -> None:
        adapters = {}
        for name, items in window.items():
            # Every token processed (prompt and completion); loss tokens separately.
            adapters[name] = {"loss": sum(i["loss"] for i in items) / len(items),
                              "lr": items[-1]["lr"], "grad_norm": items[-1]["grad_norm"],
                              "tokens_per_s": sum(i["tokens"] for i in items) / max(seconds, 1e-9),
                              "loss_tokens_per_s": (sum(i["loss_tokens"] for i in items)
                                                    / max(seconds, 1e-9))}
        if not adapters:
            return
        for name, metrics in adapters.items():
            self._job_metrics.setdefault(name, {}).update(
                loss=metrics["loss"], tokens_per_s=metrics["tokens_per_s"])
        self.logger.log(self.step, "train", adapters)
        width = max(len(n) for n in adapters)
        for name, metrics in adapters.items():
            progress.write(format_adapter_line(self.step, name, metrics, name_width=width))

    def _log_eval(self, progress: Progress) -> None:
        on_own_task = {s.slot: s.index for s in self.queue.active()}
        losses = self.tasks.losses(on_own_task)
        if not losses:
            return
        names = {s.slot: self.run.adapters[s.index].name for s in self.queue.active()}
        adapters = {names[slot]: {"loss": loss} for slot, loss in losses.items()}
        for name, metrics in adapters.items():
            self._job_metrics.setdefault(name, {})["eval_loss"] = metrics["loss"]
        for slot, acc in self.tasks.accuracy(on_own_task).items():
            adapters[names[slot]]["accuracy"] = acc
        self.logger.log(self.step, "eval", adapters)
        for name, metrics in adapters.items():
            progress.write(f"eval {format_adapter_line(self.step, name, metrics)}")

    def _save(self) -> Path:
        """Checkpoint the current step, once: a step already saved (or resumed from) is not
        written again."""
        if self._saved is None or self._saved[0] != self.step:
            path = save_training_checkpoint(
                self.run_dir, self.step, self.model, self.optimizers,
                {"queue": self.queue.state_dict(), "metrics_records": self.logger.records,
                 "adapters": self._training_meta(),
                 "submitted": [dataclasses.asdict(job)
                               for job in self.run.adapters[self.config_jobs:]]},
                self.run.checkpoint.keep_last)
            self._saved = (self.step, path)
        return self._saved[1]

    def stopped(self, stop: RunStopped) -> None:
        """Say where a stopped run can be resumed; close the logger, tear down the layout."""
        self._say(f"{stop}. Resume it with the same command (checkpoint.resume=auto, the "
                  f"default) or with checkpoint.resume={stop.checkpoint}.")
        self.logger.close()
        destroy_parallel()

    def _training_meta(self) -> dict[str, dict]:
        """Each training job's adapter meta, for exports from a checkpoint."""
        return {s.name: self._adapter_meta(self.run.adapters[s.index], s) for s in self.queue.active()}

    # ----- the end: every adapter on every task -------------------------------------------

    def finish(self) -> list[str]:
        """Evaluate every exported adapter on every task, print the tables and how each job
        ended; returns the names of the jobs that failed."""
        self._write_status(FINISHED)
        names, tasks, losses, accuracy = self._adapter_task_tables()
        if self.is_main:
            from megatron_multilora.training.plots import format_table, plot_heatmap, plot_loss_curves

            if names and tasks:
                print("held-out loss of each adapter (row) on each job's data (column), * = best:")
                print(format_table(losses, names, tasks, higher_is_better=False))
                if any(v == v for row in accuracy for v in row):  # some tasks have prompts
                    print("exact-match accuracy of greedy generations:")
                    print(format_table(accuracy, names, tasks), flush=True)
                self.logger.log(self.step, "eval", {
                    n: {**{f"loss_on_{t}": v for t, v in zip(tasks, lrow)},
                        **{f"accuracy_on_{t}": v for t, v in zip(tasks, arow)}}
                    for n, lrow, arow in zip(names, losses, accuracy)})
            elif names:
                print("no job has an eval_dataset: no adapter x task table")
            records = read_metrics(self.run_dir / METRICS_FILE) if (
                self.run_dir / METRICS_FILE).is_file() else []
            if self.run.logging.plots and any(r["kind"] == "train" for r in records):
                plot_loss_curves(records, self.run_dir / "loss_curves.png")
                plots = [self.run_dir / "loss_curves.png"]
                if names and tasks:
                    plot_heatmap(losses, names, tasks, self.run_dir / "adapter_task_loss.png",
                                 "held-out loss: adapter (row) x task (column), lower is better")
                    plots.append(self.run_dir / "adapter_task_loss.png")
                print(f"plots: {', '.join(map(str, plots))}")
            self._print_outcome([s.name for s in self._exported()])
        self.logger.close()
        dist.barrier()
        return [s.name for s in self.queue.states if s.status == FAILED]

    def _print_outcome(self, exported: list[str]) -> None:
        """The last lines of a run: how each job ended and where its adapter is."""
        limit = f"trainer.max_steps={self.run.trainer.max_steps} reached"
        for state in self.queue.states:
            where = self.run_dir / "adapters" / state.name if state.name in exported else "-"
            how = {DONE: f"done after {state.steps_done} steps",
                   FAILED: f"FAILED after {state.steps_done} steps ({state.reason}), not exported",
                   CANCELLED: state.reason,
                   ACTIVE: f"UNFINISHED: {state.steps_done} of {state.total_steps} steps ({limit}), "
                           "exported as is",
                   QUEUED: f"not started ({limit})"}[state.status]
            print(f"job {state.name}: {how} -> {where}", flush=True)
        if self.run.hf_dir and exported:
            print(f"PEFT adapters in {self.run_dir / 'peft'}; load one with:\n"
                  f"  PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
                  f"'{self.run.hf_dir}'), '{self.run_dir / 'peft' / exported[0]}')", flush=True)
        if not self.queue.finished():
            print(f"the run stopped at {limit} before every job finished: unfinished adapters "
                  "are marked \"finished\": false in their adapter_config.json; to shorten "
                  "every job with complete schedules, set trainer.steps_per_job instead",
                  flush=True)

    def _exported(self) -> list[JobState]:
        """Done jobs, jobs cancelled while training, and jobs trainer.max_steps cut short
        (exported at the end of train)."""
        return [s for s in self.queue.states if s.status in (DONE, ACTIVE) or
                (s.status == CANCELLED and (self.run_dir / "adapters" / s.name).is_dir())]

    def _adapter_task_tables(self):
        """The base model and every exported adapter on every job's held-out data: (row
        names, task names, loss table, accuracy table)."""
        exported = self._exported()
        # None: a cleared slot (alpha 0), i.e. the base model alone, the row to beat.
        rows = [None] + exported if exported else []
        tables = self.tasks.tables([self.run_dir / "adapters" / s.name if s else None for s in rows])
        return ([s.name if s else "base" for s in rows],
                [self.run.adapters[t].name for t in tables.tasks], tables.losses, tables.accuracy)

    def _say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)


