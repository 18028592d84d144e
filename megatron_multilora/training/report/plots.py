"""PNG figures of per-adapter results (the console tables are in :mod:`.text_tables`).

Figures are rendered with matplotlib's non-interactive Agg backend (no display needed) and
written atomically, so a reader never sees a half-written PNG.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: training hosts have no display

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from megatron_multilora.atomic_files import atomic_file
from megatron_multilora.training.report.text_tables import as_matrix

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


def plot_loss_curves(
    records: list[dict], out_png: str | Path, kind: str = "train", metric: str = "loss"
) -> Path:
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
        ax.plot(
            steps,
            [points[s] for s in steps],
            label=name,
            marker="o" if len(steps) <= _MARKER_MAX_POINTS else None,
            markersize=3,
        )
    if ax.lines:
        ax.legend(title="adapter")
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{kind} {metric} per adapter")
    ax.grid(alpha=0.3)
    return _save_atomic(fig, out_png)


def plot_heatmap(
    matrix: list[list[float]],
    row_labels: list[str],
    col_labels: list[str],
    out_png: str | Path,
    title: str,
    value_format: str = "{:.2f}",
) -> Path:
    """An annotated heat map (rows = adapters, columns = tasks) with a colour bar."""
    values = as_matrix(matrix, row_labels, col_labels)
    n_rows, n_cols = values.shape
    fig, ax = plt.subplots(
        figsize=(max(4.0, 1.1 * n_cols + 2.5), max(3.0, 0.5 * n_rows + 1.5)), layout="constrained"
    )
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
            ax.text(
                j,
                i,
                value_format.format(values[i, j]),
                ha="center",
                va="center",
                color=color,
                fontsize=9,
            )
    return _save_atomic(fig, out_png)
