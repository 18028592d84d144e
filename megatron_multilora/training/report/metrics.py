"""Per-adapter training metrics: a JSONL file, an optional wandb run and console output.

Only the main process writes. Other ranks build their :class:`MetricsLogger` and
:class:`Progress` with ``enabled=False`` so a training loop can call them on every rank.

Each line of ``metrics.jsonl`` is one record::

    {"step": 40, "kind": "train", "adapters": {"reverse": {"loss": 1.23, ...}}, ..., "time": 1.7e9}

NaN and +-inf are not valid JSON, so they are written as ``null``; :func:`read_metrics`
therefore returns ``None`` where a metric was not finite.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
KINDS = ("train", "eval")
_RESERVED_KEYS = frozenset({"step", "kind", "adapters", "time"})


def _json_value(value: Any) -> Any:
    """``value`` as strict JSON: numpy/torch-like reals become float, non-finite becomes None."""
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    return value


def _drop_partial_last_line(path: Path) -> None:
    """Cut a record a killed run left half-written, so appended records start on a new line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        # Only after a kill mid-write: the whole file is read once to find the last newline.
        f.seek(0)
        f.truncate(f.read().rfind(b"\n") + 1)


class MetricsLogger:
    """Appends per-adapter metrics to ``run_dir/metrics.jsonl`` and, optionally, to wandb.

    With ``enabled=False`` (non-main ranks) nothing is created and every call does nothing.
    ``wandb_mode`` is ``"offline"`` (files under ``run_dir/wandb``, no account or network),
    ``"online"`` or ``"disabled"`` (JSONL only). The wandb run's id is kept in
    ``run_dir/wandb/run_id``, so a resumed run continues the same wandb run (offline: its
    folders sync into one run).
    """

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool,
        wandb_mode: str = "offline",
        wandb_project: str = "megatron-multilora",
        wandb_run_name: str | None = None,
        config: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self._file = None
        self._run = None
        # Records in the file so far (main process): a checkpoint stores it, so a resume keeps
        # exactly the records logged before that checkpoint (keep_first_records).
        self.records = 0
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        _drop_partial_last_line(self.path)
        if self.path.exists():
            self.records = self.path.read_bytes().count(b"\n")
        # Append mode: a resumed run continues the same file.
        self._file = open(self.path, "a", encoding="utf-8")
        if wandb_mode == "disabled":
            return
        try:
            # Imported here: the import is slow and JSONL-only runs never need it.
            import wandb

            # setdefault: a user who exported WANDB_SILENT=false still gets wandb's output.
            os.environ.setdefault("WANDB_SILENT", "true")
            id_file = self.run_dir / "wandb" / "run_id"
            if id_file.is_file():
                run_id = id_file.read_text().strip()
            else:
                run_id = uuid.uuid4().hex[:8]  # wandb's ids: 8 lowercase letters and digits
                id_file.parent.mkdir(parents=True, exist_ok=True)
                id_file.write_text(run_id + "\n")
            self._run = wandb.init(
                dir=str(self.run_dir),
                mode=wandb_mode,
                project=wandb_project,
                name=wandb_run_name,
                config=config,
                id=run_id,
                resume="allow",
            )
        except BaseException:
            self._file.close()
            self._file = None
            raise

    def log(
        self,
        step: int,
        kind: str,
        adapters: dict[str, dict[str, float]],
        extra: dict[str, float] | None = None,
    ) -> None:
        """Write one record for ``step``: metrics per adapter plus run-wide ``extra`` values.

        wandb gets ``{kind}/{adapter}/{metric}`` and ``{kind}/{extra key}`` at ``step``.
        """
        # Checked on every rank so a bad call fails everywhere, not only on the main process.
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        extra = extra or {}
        clashes = _RESERVED_KEYS.intersection(extra)
        if clashes:
            raise ValueError(f"extra uses reserved record keys {sorted(clashes)}")
        if self._file is None:
            return
        record = {
            "step": int(step),
            "kind": kind,
            "adapters": _json_value(adapters),
            **_json_value(extra),
            "time": time.time(),
        }
        # allow_nan=False: any non-finite value that slipped through fails here, not in readers.
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        # Flushed per record so a killed run keeps everything it logged.
        self._file.flush()
        self.records += 1
        if self._run is not None:
            payload = {
                f"{kind}/{name}/{metric}": value
                for name, metrics in adapters.items()
                for metric, value in metrics.items()
            }
            payload.update({f"{kind}/{key}": value for key, value in extra.items()})
            self._run.log(payload, step=int(step))

    def close(self) -> None:
        """Finish the wandb run and close the file; later calls do nothing."""
        if self._run is not None:
            self._run.finish()
            self._run = None
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file, in the order they were written.

    A last line that does not parse (the process was killed mid-write) is skipped; a bad
    line anywhere else raises ``ValueError``, since that is damage, not an interrupted write.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == last:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON: {e}") from e
    return records


# Known metrics in display order: (key, label, format). Fixed widths keep lines aligned.
_COLUMNS = (
    ("loss", "loss", "{:6.3f}"),
    ("lr", "lr", "{:7.1e}"),
    ("grad_norm", "gnorm", "{:7.3f}"),
)


def format_adapter_line(
    step: int, name: str, metrics: Mapping[str, float | None], name_width: int = 12
) -> str:
    """One aligned console line, e.g. ``step   40 | reverse      loss  1.234 | lr 3.0e-04``.

    Only metrics present are shown; ``None`` (a non-finite value read back) shows as ``nan``.
    Names are padded to ``name_width``; pass the longest adapter name's length to align all.
    """

    def value(key: str) -> float:
        v = metrics[key]
        return math.nan if v is None else float(v)

    fields = [f"{label} {fmt.format(value(key))}" for key, label, fmt in _COLUMNS if key in metrics]
    # tok/s: every token processed (prompt and completion); loss tok/s: completion tokens only.
    rates = (("tokens_per_s", "tok/s"), ("loss_tokens_per_s", "loss tok/s"))
    fields += [f"{value(key):6.0f} {label}" for key, label in rates if key in metrics]
    known = {key for key, _, _ in _COLUMNS} | {key for key, _ in rates}
    fields += [f"{key} {value(key):.4g}" for key in metrics if key not in known]
    head = f"step {step:>4d} | {name:<{name_width}}"
    return " | ".join([head + " " + fields[0], *fields[1:]]) if fields else head.rstrip()


class Progress:
    """A progress bar over ``total`` steps for the main process; disabled ranks do nothing.

    Uses tqdm on a terminal. Elsewhere (a log file, torchrun's captured output) or without
    tqdm, a ``step k/total`` line with rate and ETA is printed every 10% of ``total``, so
    logs stay line-oriented.
    """

    def __init__(self, total: int, enabled: bool, desc: str = "train", initial: int = 0) -> None:
        self.total = total
        self.enabled = enabled
        self.desc = desc
        self._bar = None
        # The fallback prints at the first update at or past this step.
        self._next_print = self._after(initial)
        self._start, self._initial = time.perf_counter(), initial
        if not enabled or not sys.stderr.isatty():
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, step: int, postfix: str = "") -> None:
        """Move to absolute ``step`` (steps done) and show ``postfix`` after the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(step - self._bar.n)
            return
        if step >= self._next_print:
            elapsed = time.perf_counter() - self._start
            rate = (step - self._initial) / max(elapsed, 1e-9)
            eta = (self.total - step) / rate if rate > 0 else math.inf
            print(
                f"{self.desc}: step {step}/{self.total} ({100 * step // max(self.total, 1)}%) "
                f"{rate:.1f} steps/s, eta {eta:.0f}s" + (f" | {postfix}" if postfix else ""),
                flush=True,
            )
            self._next_print = self._after(step)

    def set_total(self, total: int, step: int) -> None:
        """A new ``total`` (jobs were added or cancelled), ``step`` steps done."""
        if total == self.total:
            return
        self.total = total
        self._next_print = self._after(step)
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    @property
    def _every(self) -> int:
        return max(1, math.ceil(self.total / 10))

    def _after(self, step: int) -> float:
        """The next 10% mark after ``step``, capped at ``total``; none once ``total`` is reached."""
        if step >= self.total:
            return math.inf
        return min((step // self._every + 1) * self._every, self.total)

    def write(self, line: str) -> None:
        """Print ``line`` above the bar without breaking it."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        """Finish the bar; later calls do nothing."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def keep_first_records(path: str | Path, count: int) -> None:
    """Keep only the first ``count`` records (those logged before the checkpoint a run resumes
    from): the resumed run logs the rest again, so no step is recorded twice."""
    path = Path(path)
    if not path.is_file():
        return
    data = path.read_bytes()
    end = 0
    for _ in range(count):
        newline = data.find(b"\n", end)
        if newline < 0:
            return  # fewer records than that: nothing to drop
        end = newline + 1
    with open(path, "rb+") as f:
        f.truncate(end)
