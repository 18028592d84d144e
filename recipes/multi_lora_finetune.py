"""Fine-tune N LoRA adapter jobs at once on one frozen Megatron-core model.

    torchrun --standalone --nproc-per-node 2 recipes/multi_lora_finetune.py \
        [adapters.0.lr=3e-4 trainer.steps_per_job=50 parallel.tp=2 ...]

The story: check the config, start the parallel layout, build the model and wrap it with
adapter slots, load every job's data, then train. Each trainer step packs every active job's
global batch into adapter-major micro-batches, runs them with per-adapter loss
normalisation, and steps each adapter's own optimizer. A job that reaches its budget is
exported and its slot handed to the next queued job. At the end jobs that trainer.max_steps
cut short are exported as they are, every exported adapter is evaluated on every job's
held-out data, and the run exits with status 1 if a job failed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import megatron_multilora as mm  # light: its names load megatron on first use
from megatron_multilora.checkpoint.adapter_folders import FolderFormat, folder_format
from megatron_multilora.data.datasets import Example, load_dataset, read_jsonl_records
from megatron_multilora.data.demo_tasks import exact_match
from megatron_multilora.data.tokenizer import ByteTokenizer, HFTokenizer
from megatron_multilora.models.hf_config import read_hf_config
from megatron_multilora.training.config import (
    ConfigError,
    RunConfig,
    base_model_config,
    job_alpha,
    load_run_config,
    to_plain,
    validate,
)
from megatron_multilora.training.jobs import (
    ACTIVE,
    DONE,
    FAILED,
    QUEUED,
    JobQueue,
    JobState,
    planned_steps,
)
from megatron_multilora.training.metrics import (
    METRICS_FILE,
    MetricsLogger,
    Progress,
    format_adapter_line,
    keep_first_records,
    read_metrics,
)
from megatron_multilora.training.stop import RunStopped, agreed_stop, stop_on_signals


def _import_training_stack() -> None:
    """Import the modules that load megatron (seconds) as this module's globals. Called once
    the config is valid, so that a bad config is reported without waiting for them."""
    global parallel_state, export_adapter, import_adapter, find_resume_point, prepare_checkpoint_folder
    global read_training_state
    global restore_training_checkpoint, save_training_checkpoint, pack_micro_batches
    global shard_for_data_parallel, export_peft, import_peft, load_hf_checkpoint
    global load_hf_tokenizer, evaluation, train_step, SlotGradSync, SlotOptimizer, slot_grad_norm
    from megatron.core import parallel_state
    from megatron_multilora.checkpoint.adapter_files import export_adapter, import_adapter
    from megatron_multilora.checkpoint.peft_format import export_peft, import_peft
    from megatron_multilora.training.checkpoints import (
        find_resume_point,
        prepare_checkpoint_folder,
        read_training_state,
        restore_training_checkpoint,
        save_training_checkpoint,
    )
    from megatron_multilora.data.packing import pack_micro_batches, shard_for_data_parallel
    from megatron_multilora.models.hf_import import load_hf_checkpoint, load_hf_tokenizer
    from megatron_multilora.training import evaluation, step as train_step
    from megatron_multilora.training.grad_sync import SlotGradSync
    from megatron_multilora.training.slot_optimizer import SlotOptimizer, slot_grad_norm


# What a run writes into run_dir (its recorded hydra/ config aside): moved to
# run_dir/previous/<n> when a run starts over there, so nothing is overwritten or mixed.
RUN_OUTPUTS = (METRICS_FILE, "checkpoints", "adapters", "peft", "wandb", "loss_curves.png",
               "adapter_task_loss.png")


class MultiLoRAFinetuneRecipe:
    def __init__(self, run: RunConfig) -> None:
        validate(run)  # every config problem, before any process-group work or slow import
        _import_training_stack()
        self.run = run
        self.run_dir = Path(run.run_dir)
        self.model_config = base_model_config(run)  # hf_dir's architecture, or run.model
        # Read once: exports and every checkpoint's adapter meta name the HF model type.
        self.hf_model_type = read_hf_config(run.hf_dir)["model_type"] if run.hf_dir else None

    # ----- setup, in order ----------------------------------------------------------------

    def setup(self) -> None:
        run = self.run
        mm.init_parallel(tensor_model_parallel_size=run.parallel.tp,
                         expert_model_parallel_size=run.parallel.ep,
                         sequence_parallel=run.parallel.sp, seed=run.seed)
        self.is_main = dist.get_rank() == 0
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.pad_multiple = run.parallel.tp if run.parallel.sp else 1
        self.tokenizer = (HFTokenizer(load_hf_tokenizer(run.hf_dir)) if run.hf_dir
                          else ByteTokenizer())
        self.model = self._build_model()
        self.grad_sync = SlotGradSync(self.model)
        self.n_slots = run.lora.slots
        self.train_data = [load_dataset(j.dataset, self.tokenizer, run.trainer.max_seq_len)
                           for j in run.adapters]
        self.eval_records = [read_jsonl_records(j.eval_dataset)[:run.trainer.eval_samples]
                             if j.eval_dataset else [] for j in run.adapters]
        self.eval_data = [load_dataset(j.eval_dataset, self.tokenizer, run.trainer.max_seq_len)
                          [:run.trainer.eval_samples] if j.eval_dataset else []
                          for j in run.adapters]
        self.queue = JobQueue(run.adapters, [len(d) for d in self.train_data], self.n_slots,
                              run.trainer.steps_per_job)
        self.optimizers: dict[int, SlotOptimizer] = {}
        self.step = 0
        self._resume()
        self.logger = MetricsLogger(self.run_dir, self.is_main, run.logging.wandb_mode,
                                    run.logging.wandb_project, self.run_dir.name,
                                    {**to_plain(run), "model": dataclasses.asdict(self.model_config)})
        self.filler = train_step.filler_micro_batch(self.n_slots, self.pad_multiple,
                                                    self.tokenizer.pad_id)
        if self.is_main:
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            print(f"run {self.run_dir}: {len(run.adapters)} adapter jobs on {self.n_slots} slots, "
                  f"world {dist.get_world_size()} (tp {run.parallel.tp}, sp {run.parallel.sp}, "
                  f"ep {run.parallel.ep}, dp {self.dp_size}), {trainable:,} trainable parameters "
                  f"per rank, starting at step {self.step}", flush=True)

    def _build_model(self) -> torch.nn.Module:
        run = self.run
        model_cfg = dataclasses.replace(self.model_config)  # recompute is a run setting
        if run.trainer.recompute is not None:
            model_cfg.recompute_granularity = run.trainer.recompute
            if run.trainer.recompute == "selective":
                model_cfg.recompute_modules = ["core_attn"] + (["moe"] if model_cfg.num_moe_experts else [])
        dtype = torch.bfloat16 if run.trainer.precision == "bf16" else torch.float32
        # Per-adapter losses are normalised over the global batch: gradients are summed over
        # data-parallel ranks, not averaged (megatron's per-token-loss convention).
        model = mm.build_gpt_model(model_cfg, sequence_parallel=run.parallel.sp, params_dtype=dtype,
                                   calculate_per_token_loss=True)
        if run.hf_dir:
            load_hf_checkpoint(model, run.hf_dir, model_cfg)
        return mm.apply_multi_lora(model, run.lora.slots, run.lora.max_rank, alpha=1.0,
                                   target_modules=run.lora.targets,
                                   column_init_method=run.lora.column_init_method,
                                   row_init_method=run.lora.row_init_method, seed=run.seed,
                                   fully_sharded=run.lora.fully_sharded)

    def _optimizer(self, slot: int, state: JobState) -> SlotOptimizer:
        return SlotOptimizer(mm.slot_parameters(self.model, slot), self.run.adapters[state.index],
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
        found = [name for name in RUN_OUTPUTS if (self.run_dir / name).exists()]
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

    # ----- training -----------------------------------------------------------------------

    def _start(self, state: JobState) -> None:
        job = self.run.adapters[state.index]
        if job.init_from and folder_format(job.init_from) is FolderFormat.PEFT:
            import_peft(self.model, state.slot, job.init_from, self.model_config,
                        self.hf_model_type or "llama")
        elif job.init_from:
            import_adapter(self.model, state.slot, job.init_from)
        else:  # initialised from the job, not the slot: the same adapter in any slot
            mm.clear_adapter_slot(self.model, state.slot, init_key=job.name)
        # An imported adapter keeps its own alpha (validate refused a differing job alpha).
        mm.init_adapter_slot(self.model, state.slot, job.rank, job_alpha(job), job.dropout)
        self.optimizers[state.slot] = self._optimizer(state.slot, state)
        self._say(f"step {self.step}: job {job.name} starts on slot {state.slot} "
                  f"({state.total_steps} steps)")

    def _end(self, state: JobState, status: str, reason: str) -> None:
        job = self.run.adapters[state.index]
        slot = state.slot
        if status == DONE:
            self._export(state)
        self.queue.release(state, status, reason)
        self.optimizers.pop(slot).zero_grad()
        mm.clear_adapter_slot(self.model, slot)  # weights, rank, alpha back to a fresh slot
        self._say(f"step {self.step}: job {job.name} {status} ({reason}); slot {slot} is free")

    def _export(self, state: JobState) -> None:
        """Write the job's slot as an adapter folder (and a PEFT folder on an HF base)."""
        job = self.run.adapters[state.index]
        export_adapter(self.model, state.slot, self.run_dir / "adapters" / job.name,
                       self._adapter_meta(job, state), overwrite=True)
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

    def _micro_batches(self, slot_examples, exclude: set[int]):
        kept = [[] if s in exclude else ex for s, ex in enumerate(slot_examples)]
        # Packed in rank order, a micro-batch holds jobs of similar rank: the layers compute at
        # the largest rank present, so low-rank jobs do not pay for a high-rank one.
        rank = {s.slot: self.run.adapters[s.index].rank for s in self.queue.active()}
        order = sorted(range(self.n_slots), key=lambda slot: rank.get(slot, 0))
        mbs = pack_micro_batches(kept, self.run.trainer.micro_batch_tokens, self.pad_multiple,
                                 self.tokenizer.pad_id, slot_order=order)
        return train_step.equalize_micro_batches(mbs, self.filler)

    def train_one_step(self, active: list[JobState]) -> dict[int, dict[str, float]]:
        """One trainer step; returns per-slot metrics of the slots that stepped."""
        slot_examples, tokens = self._global_batch(active)
        micro_batches = self._micro_batches(slot_examples, set())
        denominators = train_step.global_loss_tokens(micro_batches, self.n_slots)
        bad: set[int] = set()
        while True:
            # Only the active slots' gradients are reset and reduced: free slots cost nothing.
            self.grad_sync.zero_grad(s.slot for s in active)
            losses = train_step.reduce_losses(
                train_step.forward_backward(self.model, micro_batches, denominators))
            stepping = [s.slot for s in active if s.slot not in bad]
            self.grad_sync.sync(stepping)
            norms = {slot: slot_grad_norm(self.optimizers[slot].params) for slot in stepping}
            failing = {slot for slot, norm in norms.items()
                       if not (math.isfinite(norm) and math.isfinite(float(losses[slot])))}
            if not failing:
                break
            # A non-finite adapter can poison the others through masked attention (0 * inf):
            # find which fail on their own samples, and redo the step without them.
            bad |= self._failing_alone(slot_examples, denominators, failing)
            micro_batches = self._micro_batches(slot_examples, bad)
        stats = {}
        for state in active:
            job = self.run.adapters[state.index]
            if state.slot in bad:
                state.bad_steps += 1
                self._say(f"step {self.step}: job {job.name} has non-finite loss/gradients; "
                          f"step skipped ({state.bad_steps}/{self.run.trainer.max_bad_steps})")
                continue
            state.bad_steps = 0
            opt = self.optimizers[state.slot]
            lr = opt.lr
            opt.step(norms[state.slot])
            state.steps_done += 1
            stats[state.slot] = {"loss": float(losses[state.slot]), "lr": lr,
                                 "grad_norm": norms[state.slot], "tokens": tokens[state.slot],
                                 "loss_tokens": float(denominators[state.slot])}
        return stats

    def _failing_alone(self, slot_examples, denominators, candidates: set[int]) -> set[int]:
        """The candidates whose loss is non-finite on their own samples (all of them when
        none is, i.e. only their combination fails)."""
        culprits = set()
        for slot in sorted(candidates):
            alone = self._micro_batches(slot_examples, set(range(self.n_slots)) - {slot})
            loss = train_step.reduce_losses(
                train_step.forward_backward(self.model, alone, denominators, backward=False))
            if not math.isfinite(float(loss[slot])):
                culprits.add(slot)
        return culprits or set(candidates)

    def train(self) -> None:
        tr = self.run.trainer
        budget = planned_steps(self.run.adapters, self.queue.states, self.n_slots)
        progress = Progress(min(budget, tr.max_steps or budget), self.is_main, initial=self.step)
        window: dict[str, list[float]] = {}
        window_start = time.perf_counter()
        while not self.queue.finished() and (tr.max_steps is None or self.step < tr.max_steps):
            self._stop_if_signalled()
            for state in self.queue.admit(self.step):
                self._start(state)
            active = self.queue.active()
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
                self._log_train(window, time.perf_counter() - window_start, progress)
                window, window_start = {}, time.perf_counter()
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
        self.logger.log(self.step, "train", adapters)
        width = max(len(n) for n in adapters)
        for name, metrics in adapters.items():
            progress.write(format_adapter_line(self.step, name, metrics, name_width=width))

    def _eval_slots(self) -> tuple[list[list[Example]], dict[int, str]]:
        slot_examples: list[list[Example]] = [[] for _ in range(self.n_slots)]
        names = {}
        for state in self.queue.active():
            slot_examples[state.slot] = self.eval_data[state.index]
            names[state.slot] = self.run.adapters[state.index].name
        return slot_examples, names

    def _log_eval(self, progress: Progress) -> None:
        slot_examples, names = self._eval_slots()
        if not any(slot_examples):
            return
        losses = evaluation.eval_losses(self.model, slot_examples, self.run.trainer.micro_batch_tokens,
                                        self.pad_multiple, self.tokenizer.pad_id)
        adapters = {names[s]: {"loss": float(losses[s])} for s in names if slot_examples[s]}
        accuracy = self._accuracy({s.slot: s.index for s in self.queue.active()})
        for slot, acc in accuracy.items():
            adapters[names[slot]]["accuracy"] = acc
        self.logger.log(self.step, "eval", adapters)
        for name, metrics in adapters.items():
            progress.write(f"eval {format_adapter_line(self.step, name, metrics)}")

    def _accuracy(self, slot_to_job: dict[int, int]) -> dict[int, float]:
        """Exact-match accuracy of greedy generations, per slot, on its job's eval records
        (prompt/completion records only)."""
        prompts, owners, answers = [], [], []
        for slot, job_index in slot_to_job.items():
            for record in self.eval_records[job_index]:
                if "prompt" not in record:
                    continue
                ids = [self.tokenizer.bos_id] + self.tokenizer.encode(record["prompt"])
                prompts.append((slot, ids))
                owners.append(slot)
                answers.append(record["completion"])
        if not prompts:
            return {}
        outputs = evaluation.greedy_generate(
            self.model, prompts, self.n_slots, self.run.trainer.max_new_tokens, self.tokenizer.eos_id,
            self.pad_multiple, self.tokenizer.pad_id)
        hits: dict[int, list[bool]] = {}
        for slot, out, answer in zip(owners, outputs, answers):
            hits.setdefault(slot, []).append(exact_match(self.tokenizer.decode(out), answer))
        return {slot: sum(h) / len(h) for slot, h in hits.items()}

    def _save(self) -> Path:
        """Checkpoint the current step, once: a step already saved (or resumed from) is not
        written again."""
        if self._saved is None or self._saved[0] != self.step:
            path = save_training_checkpoint(
                self.run_dir, self.step, self.model, self.optimizers,
                {"queue": self.queue.state_dict(), "metrics_records": self.logger.records,
                 "adapters": self._training_meta()},
                self.run.checkpoint.keep_last)
            self._saved = (self.step, path)
        return self._saved[1]

    def _stop_if_signalled(self) -> None:
        """At a step boundary: if any rank got SIGTERM/SIGINT, every rank saves and stops here."""
        signum = agreed_stop(next(self.model.parameters()).device)
        if signum:
            raise RunStopped(signum, self.step, self._save())

    def stopped(self, stop: RunStopped) -> None:
        """Say where a stopped run can be resumed; close the logger, tear down the layout."""
        self._say(f"{stop}. Resume it with the same command (checkpoint.resume=auto, the "
                  f"default) or with checkpoint.resume={stop.checkpoint}.")
        self.logger.close()
        mm.destroy_parallel()

    def _training_meta(self) -> dict[str, dict]:
        """Each training job's adapter meta, for exports from a checkpoint."""
        return {s.name: self._adapter_meta(self.run.adapters[s.index], s) for s in self.queue.active()}

    # ----- the end: every adapter on every task -------------------------------------------

    def finish(self) -> list[str]:
        """Evaluate every exported adapter on every task, print the tables and how each job
        ended; returns the names of the jobs that failed."""
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
        """Done jobs, and jobs trainer.max_steps cut short (exported at the end of train)."""
        return [s for s in self.queue.states if s.status in (DONE, ACTIVE)]

    def _adapter_task_tables(self):
        """The base model and every exported adapter on every job's held-out data, ``n_slots``
        at a time: (row names, task names, loss table, accuracy table)."""
        # None: a cleared slot (alpha 0), i.e. the base model alone, the row to beat.
        exported = [None] + self._exported() if self._exported() else []
        tasks = [i for i, data in enumerate(self.eval_data) if data]
        losses = [[float("nan")] * len(tasks) for _ in exported]
        accuracy = [[float("nan")] * len(tasks) for _ in exported]
        for start in range(0, len(exported), self.n_slots) if tasks else []:
            chunk = exported[start:start + self.n_slots]
            for slot, state in enumerate(chunk):
                if state is not None:
                    import_adapter(self.model, slot, self.run_dir / "adapters" / state.name)
            for col, task in enumerate(tasks):
                slot_examples = [self.eval_data[task] if s < len(chunk) else []
                                 for s in range(self.n_slots)]
                task_losses = evaluation.eval_losses(
                    self.model, slot_examples, self.run.trainer.micro_batch_tokens,
                    self.pad_multiple, self.tokenizer.pad_id)
                task_accuracy = self._accuracy({slot: task for slot in range(len(chunk))})
                for slot in range(len(chunk)):
                    losses[start + slot][col] = float(task_losses[slot])
                    accuracy[start + slot][col] = task_accuracy.get(slot, float("nan"))
            for slot in range(len(chunk)):
                mm.clear_adapter_slot(self.model, slot)
        return ([s.name if s else "base" for s in exported],
                [self.run.adapters[t].name for t in tasks], losses, accuracy)

    def _say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)


def _report_and_exit(message: str, code: int) -> None:
    """End this process with ``message`` as the launch's one visible error: printed once (by
    the first process) and, under torchrun, written to the error file its failure summary
    shows as the root cause, so the message is also the last thing a user reads."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file:  # torchelastic's error-file format
            with open(error_file, "w") as f:
                json.dump({"message": {"message": message, "extraInfo": {
                    "py_callstack": message, "timestamp": str(int(time.time()))}}}, f)
    elif "TORCHELASTIC_ERROR_FILE" in os.environ:
        # torchrun names the first failure it observes as the root cause: the other ranks
        # leave after rank 0 (which carries the message); torchrun ends them once it exits.
        time.sleep(5)
    sys.exit(code)


def _record_config(cfg: DictConfig, run_dir: Path) -> None:
    """What Hydra would write at startup (conf/config.yaml sets hydra.output_subdir=null so
    that a launch that fails validation leaves an existing run_dir untouched)."""
    out = run_dir / "hydra"
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(HydraConfig.get().overrides.task)), out / "overrides.yaml")


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run = load_run_config(cfg)
        # Hydra's output folder is run_dir for a single run and run_dir-multirun/<n> per sweep job.
        run.run_dir = HydraConfig.get().runtime.output_dir
        recipe = MultiLoRAFinetuneRecipe(run)
    except ConfigError as err:
        _report_and_exit(str(err), 2)
    if int(os.environ.get("RANK", "0")) == 0:
        _record_config(cfg, Path(run.run_dir))
    try:
        with stop_on_signals():  # SIGTERM / Ctrl-C: finish the step, save, stop (training/stop.py)
            recipe.setup()
            recipe.train()
    except RunStopped as stop:
        recipe.stopped(stop)
        sys.exit(128 + stop.signum)  # the shell convention for "ended by this signal"
    failed = recipe.finish()
    mm.destroy_parallel()
    if failed:
        _report_and_exit(f"{len(failed)} of {len(run.adapters)} adapter jobs FAILED: "
                         f"{', '.join(failed)} (see the job lines above); the others were "
                         "exported", 1)


if __name__ == "__main__":
    main()
