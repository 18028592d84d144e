"""What a run tells its user while it trains and when it ends: a progress bar, per-adapter
train and eval lines (also in ``metrics.jsonl`` and wandb), then the adapter x task tables of
held-out loss and exact-match accuracy with the base model's row, plots, and one line per
job saying how it ended and where its adapter is."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from megatron_multilora.checkpoint.prompt_format import load_hint
from megatron_multilora.training.config import RunConfig
from megatron_multilora.training.jobs.board import JobBoard
from megatron_multilora.training.jobs.states import ACTIVE, CANCELLED, DONE, FAILED, QUEUED
from megatron_multilora.training.report.metrics import (
    METRICS_FILE,
    MetricsLogger,
    Progress,
    format_adapter_line,
    read_metrics,
)
from megatron_multilora.training.report.tables import AdapterTaskEval

# What every step records; anything else is an objective's metric.
_PER_STEP = ("loss", "lr", "grad_norm", "tokens", "loss_tokens")


class RunReport:
    """The run's metrics log and console output (the main process prints, every rank calls)."""

    def __init__(self, run: RunConfig, is_main: bool, config: dict[str, Any]) -> None:
        self.run, self.is_main, self.run_dir = run, is_main, Path(run.run_dir)
        self.logger = MetricsLogger(
            self.run_dir,
            is_main,
            run.logging.wandb_mode,
            run.logging.wandb_project,
            self.run_dir.name,
            config,
        )
        self.progress: Progress | None = None
        self.seconds_per_step: float | None = None  # over the last logging window
        self._window: dict[str, list[dict[str, float]]] = {}
        self._window_start, self._window_step = time.perf_counter(), 0

    def say(self, line: str) -> None:
        if self.is_main:
            print(line, flush=True)

    def begin(self, step: int, planned: int) -> None:
        self.progress = Progress(planned, self.is_main, initial=step)
        self.restart_window(step)

    def restart_window(self, step: int) -> None:
        """Rates are measured from here (again after idling)."""
        self._window, self._window_start, self._window_step = {}, time.perf_counter(), step

    def stepped(self, step: int, stats: dict[str, dict[str, float]]) -> None:
        for name, values in stats.items():
            self._window.setdefault(name, []).append(values)
        self.progress.update(step)

    def log_train(self, step: int, board: JobBoard) -> None:
        """The window's mean loss, last lr and gradient norm, and rates (every token processed,
        and loss tokens only) per job; the window restarts."""
        seconds = time.perf_counter() - self._window_start
        self.seconds_per_step = seconds / max(1, step - self._window_step)
        self._log_window(step, board, seconds)
        self.restart_window(step)

    def job_ended(self, step: int, name: str, board: JobBoard) -> None:
        """A job ended at ``step``: the window closes now for every job (one record at this
        step), so the ended job's last loss line comes before its end line and none after;
        the progress total follows the jobs left."""
        if name in self._window:
            self.log_train(step, board)
        self.progress.set_total(board.planned(step), step)

    def _log_window(self, step: int, board: JobBoard, seconds: float) -> None:
        adapters = {}
        for name, items in self._window.items():
            adapters[name] = {
                "loss": sum(i["loss"] for i in items) / len(items),
                "lr": items[-1]["lr"],
                "grad_norm": items[-1]["grad_norm"],
                "tokens_per_s": sum(i["tokens"] for i in items) / max(seconds, 1e-9),
                "loss_tokens_per_s": (sum(i["loss_tokens"] for i in items) / max(seconds, 1e-9)),
                # the objective's own metrics (e.g. DPO's margin, GRPO's
                # reward): the window's mean
                **{
                    key: sum(i[key] for i in items) / len(items)
                    for key in items[-1]
                    if key not in _PER_STEP
                },
            }
        if not adapters:
            return
        for name, metrics in adapters.items():
            board.named(name).metrics.update(
                loss=metrics["loss"], tokens_per_s=metrics["tokens_per_s"]
            )
        self.logger.log(step, "train", adapters)
        width = max(len(n) for n in adapters)
        for name, metrics in adapters.items():
            self.progress.write(format_adapter_line(step, name, metrics, name_width=width))

    def log_eval(self, step: int, board: JobBoard, tasks: AdapterTaskEval) -> None:
        """Every training job's adapter on its own held-out data: loss and accuracy (as
        many at a time as there are device slots)."""
        adapters = {}
        for group in board.in_turns(board.active()):
            on_own_task = {job.slot: job for job in group}
            results, known = tasks.evaluate(on_own_task)
            for slot, values in results.items():
                adapters[on_own_task[slot].name] = values
            for slot, acc in tasks.accuracy(on_own_task, known).items():
                adapters[on_own_task[slot].name]["accuracy"] = acc
        if not adapters:
            return
        for name, metrics in adapters.items():
            board.named(name).metrics["eval_loss"] = metrics["loss"]
        self.logger.log(step, "eval", adapters)
        for name, metrics in adapters.items():
            self.progress.write(f"eval {format_adapter_line(step, name, metrics)}")

    def end_training(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def final(
        self, step: int, board: JobBoard, tasks: AdapterTaskEval, stopped: bool = False
    ) -> None:
        """Every exported adapter (and the base model alone: the row to beat) on every task,
        the plots, and how each job ended (``stopped``: a serving run ended by ``mmlora
        stop``, whose unfinished jobs resume from its checkpoint)."""
        # Stopped: the jobs still training were not exported (they resume instead).
        exported = [j for j in board.exported() if not (stopped and j.status == ACTIVE)]
        rows = [None] + exported if exported else []
        tables = tasks.tables(
            [board.exporter.folder(job) if job else None for job in rows], board.jobs
        )
        if self.is_main:
            names = [job.name if job else "base" for job in rows]
            self._print_tables(step, names, [t.name for t in tables.tasks], tables)
            self._plot(names, [t.name for t in tables.tasks], tables)
            self._print_outcome(board, [job.name for job in exported], stopped)
        self.logger.close()

    def _print_tables(self, step: int, names: list[str], tasks: list[str], tables) -> None:
        from megatron_multilora.training.report.text_tables import format_table

        if not (names and tasks):
            if names:
                print("no job has an eval_dataset: no adapter x task table")
            return
        print("held-out loss of each adapter (row) on each job's data (column), * = best:")
        print(format_table(tables.losses, names, tasks, higher_is_better=False))
        if any(v == v for row in tables.accuracy for v in row):  # some tasks have prompts
            print("exact-match accuracy of greedy generations:")
            print(format_table(tables.accuracy, names, tasks), flush=True)
        shown = [task.objective.eval_objective().table_metrics for task in tables.tasks]
        for metric in sorted({m for task_metrics in shown for m in task_metrics}):
            have = [col for col, task_metrics in enumerate(shown) if metric in task_metrics]
            print(f"held-out {metric.replace('_', ' ')}:")
            print(
                format_table(
                    [
                        [row[col].get(metric, float("nan")) for col in have]
                        for row in tables.metrics
                    ],
                    names,
                    [tasks[col] for col in have],
                ),
                flush=True,
            )
        self.logger.log(
            step,
            "eval",
            {
                n: {
                    **{f"loss_on_{t}": v for t, v in zip(tasks, lrow)},
                    **{f"accuracy_on_{t}": v for t, v in zip(tasks, arow)},
                    **{
                        f"{m}_on_{t}": v
                        for t, values in zip(tasks, mrow)
                        for m, v in values.items()
                    },
                }
                for n, lrow, arow, mrow in zip(
                    names, tables.losses, tables.accuracy, tables.metrics
                )
            },
        )

    def _plot(self, names: list[str], tasks: list[str], tables) -> None:
        path = self.run_dir / METRICS_FILE
        records = read_metrics(path) if path.is_file() else []
        if not (self.run.logging.plots and any(r["kind"] == "train" for r in records)):
            return
        from megatron_multilora.training.report.plots import plot_heatmap, plot_loss_curves

        plot_loss_curves(records, self.run_dir / "loss_curves.png")
        plots = [self.run_dir / "loss_curves.png"]
        if any(
            "reward_mean" in m
            for r in records
            if r["kind"] == "train"
            for m in r["adapters"].values()
        ):  # RL jobs: their reward curves
            plots.append(
                plot_loss_curves(records, self.run_dir / "reward_curves.png", metric="reward_mean")
            )
        if names and tasks:
            plot_heatmap(
                tables.losses,
                names,
                tasks,
                self.run_dir / "adapter_task_loss.png",
                "held-out loss: adapter (row) x task (column), lower is better",
            )
            plots.append(self.run_dir / "adapter_task_loss.png")
        print(f"plots: {', '.join(map(str, plots))}")

    def _print_outcome(self, board: JobBoard, exported: list[str], stopped: bool = False) -> None:
        """The last lines of a run: how each job ended and where its adapter is."""
        limit = f"trainer.max_steps={self.run.trainer.max_steps} reached"
        cut = "exported as is"
        if stopped:
            limit, cut = "mmlora stop", "resumes from the checkpoint"
        for job in board.jobs:
            where = board.exporter.folder(job) if job.name in exported else "-"
            how = {
                DONE: f"done after {job.steps_done} steps",
                FAILED: f"FAILED after {job.steps_done} steps ({job.reason}), not exported",
                CANCELLED: job.reason,
                ACTIVE: f"UNFINISHED: {job.steps_done} of {job.total_steps} steps ({limit}), {cut}",
                QUEUED: f"not started ({limit})",
            }[job.status]
            print(f"job {job.name}: {how} -> {where}", flush=True)
        if self.run.hf_dir and exported:
            adapter = self.run_dir / "peft" / exported[0]
            print(
                f"PEFT adapters in {self.run_dir / 'peft'}; "
                + load_hint(str(self.run.hf_dir), str(adapter)),
                flush=True,
            )
        if not board.finished() and not stopped:
            print(
                f"the run stopped at {limit} before every job finished: unfinished adapters "
                'are marked "finished": false in their adapter_config.json; to shorten '
                "every job with complete schedules, set trainer.steps_per_job instead",
                flush=True,
            )
