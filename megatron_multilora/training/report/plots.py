"""PNG figures and console tables of per-adapter results.

Figures are rendered with matplotlib's non-interactive Agg backend (no display needed) and
written atomically, so a reader never sees a half-written PNG.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: training hosts have no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from megatron_multilora.atomic_files import atomic_file  # noqa: E402

# Below this many points a curve gets markers, so a single eval point is still visible.
_MARKER_MAX_POINTS = 30


def _save_atomic(fig: Figure, out_png: str | Path) -> Path:
    """Save ``fig`` as PNG to ``out_png`` atomically, and close it."""
    try:
        with atomic_file(out_png, binary=True) as f:
            fig.savefig(f, format="png", dpi=120)
    finally:
        plt.close(fig)
    return Path(out_png)


def plot_loss_curves(records: list[dict], out_png: str | Path, kind: str = "train",
                     metric: str = "loss") -> Path:
    """Plot each adapter's ``metric`` (e.g. ``reward_mean``) against step from ``kind``
    records (see ``read_metrics``); adapters that do not report it are left out.

    Missing or non-finite values are left out. Where a resumed run logged a step again, the
    later value wins, so the curve follows the run that continued.
    """
    selected = [r for r in records if r.get("kind") == kind]
    if not selected:
        raise ValueError(f"no {kind!r} records to plot (got {len(records)} records in all)")
    curves: dict[str, dict[int, float]] = {}
    for record in selected:
        for name, metrics in record["adapters"].items():
            points = curves.setdefault(name, {})
            value = metrics.get(metric)
            if value is not None and math.isfinite(value):
                points[record["step"]] = value
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    for name, points in curves.items():
        if not points:
            continue
        steps = sorted(points)
        ax.plot(steps, [points[s] for s in steps], label=name,
                marker="o" if len(steps) <= _MARKER_MAX_POINTS else None, markersize=3)
    if ax.lines:
        ax.legend(title="adapter")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{kind} {metric} per adapter")
    ax.grid(alpha=0.3)
    return _save_atomic(fig, out_png)


def _as_array(matrix: Sequence[Sequence[float | None]], row_labels: Sequence[str],
              col_labels: Sequence[str]) -> np.ndarray:
    """``matrix`` as a float array (None -> NaN), checked against the label counts."""
    if len(matrix) != len(row_labels):
        raise ValueError(f"matrix has {len(matrix)} rows but {len(row_labels)} row labels")
    for i, row in enumerate(matrix):
        if len(row) != len(col_labels):
            raise ValueError(f"matrix row {i} has {len(row)} values "
                             f"but there are {len(col_labels)} column labels")
    if not row_labels or not col_labels:
        raise ValueError("matrix is empty")
    return np.array(matrix, dtype=float)


def plot_heatmap(matrix: list[list[float]], row_labels: list[str], col_labels: list[str],
                 out_png: str | Path, title: str, value_format: str = "{:.2f}") -> Path:
    """An annotated heat map (rows = adapters, columns = tasks) with a colour bar."""
    values = _as_array(matrix, row_labels, col_labels)
    n_rows, n_cols = values.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * n_cols + 2.5), max(3.0, 0.5 * n_rows + 1.5)),
                           layout="constrained")
    image = ax.imshow(values, cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=ax)
    ax.set_xticks(range(n_cols), labels=col_labels, rotation=30, ha="right")
    ax.set_yticks(range(n_rows), labels=row_labels)
    ax.set_title(title)
    for i in range(n_rows):
        for j in range(n_cols):
            r, g, b, _ = image.cmap(image.norm(values[i, j]))
            # Light text on dark cells and dark text on light ones, so every value reads;
            # NaN cells are left blank (white), so their text is dark.
            dark = np.isfinite(values[i, j]) and 0.299 * r + 0.587 * g + 0.114 * b < 0.5
            color = "white" if dark else "black"
            ax.text(j, i, value_format.format(values[i, j]), ha="center", va="center",
                    color=color, fontsize=9)
    return _save_atomic(fig, out_png)


def format_table(matrix: list[list[float]], row_labels: list[str], col_labels: list[str],
                 value_format: str = "{:.2f}", highlight_best_in_column: bool = True,
                 higher_is_better: bool = True) -> str:
    """A plain-text aligned table; the best value of each column gets a ``*`` suffix.

    Best is the largest value, or the smallest with ``higher_is_better=False``, compared as
    shown (``value_format``): every cell that shows the best value is marked, unless all of
    the column's values show the same (nothing stands out). NaN/None cells are never best.
    """
    values = _as_array(matrix, row_labels, col_labels)
    shown = [[value_format.format(v) for v in row] for row in values]
    best = np.zeros(values.shape, dtype=bool)
    if highlight_best_in_column:
        for j in range(values.shape[1]):
            finite = [i for i in range(values.shape[0]) if np.isfinite(values[i, j])]
            if not finite:
                continue
            pick = max if higher_is_better else min
            winner = shown[pick(finite, key=lambda i: values[i, j])][j]
            marked = [i for i in finite if shown[i][j] == winner]
            if len(marked) < len(finite):
                best[marked, j] = True
    # A trailing space on unmarked cells keeps the digits of marked and unmarked cells aligned.
    suffix = {True: "*", False: " " if highlight_best_in_column else ""}
    cells = [[text + suffix[bool(b)] for text, b in zip(row, best_row)]
             for row, best_row in zip(shown, best)]
    label_width = max(len(label) for label in row_labels)
    widths = [max(len(col_labels[j]), *(len(row[j]) for row in cells))
              for j in range(len(col_labels))]
    header = " " * label_width + "".join(f"  {c:>{w}}" for c, w in zip(col_labels, widths))
    lines = [header, "-" * len(header)]
    for label, row in zip(row_labels, cells):
        lines.append(f"{label:<{label_width}}"
                     + "".join(f"  {c:>{w}}" for c, w in zip(row, widths)))
    return "\n".join(line.rstrip() for line in lines)
