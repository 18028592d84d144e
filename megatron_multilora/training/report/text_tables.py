"""Plain-text tables of per-adapter results for the console (no plotting library: a run
that draws no figures does not import one)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def as_matrix(
    matrix: Sequence[Sequence[float | None]], row_labels: Sequence[str], col_labels: Sequence[str]
) -> np.ndarray:
    """``matrix`` as a float array (None -> NaN), checked against the label counts."""
    if len(matrix) != len(row_labels):
        raise ValueError(f"matrix has {len(matrix)} rows but {len(row_labels)} row labels")
    for i, row in enumerate(matrix):
        if len(row) != len(col_labels):
            raise ValueError(
                f"matrix row {i} has {len(row)} values "
                f"but there are {len(col_labels)} column labels"
            )
    if not row_labels or not col_labels:
        raise ValueError("matrix is empty")
    return np.array(matrix, dtype=float)


def format_table(
    matrix: list[list[float]],
    row_labels: list[str],
    col_labels: list[str],
    value_format: str = "{:.2f}",
    highlight_best_in_column: bool = True,
    higher_is_better: bool = True,
) -> str:
    """A plain-text aligned table; the best value of each column gets a ``*`` suffix.

    Best is the largest value, or the smallest with ``higher_is_better=False``, compared as
    shown (``value_format``): every cell that shows the best value is marked, unless all of
    the column's values show the same (nothing stands out). NaN/None cells are never best.
    """
    values = as_matrix(matrix, row_labels, col_labels)
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
    cells = [
        [text + suffix[bool(b)] for text, b in zip(row, best_row)]
        for row, best_row in zip(shown, best)
    ]
    label_width = max(len(label) for label in row_labels)
    widths = [
        max(len(col_labels[j]), *(len(row[j]) for row in cells)) for j in range(len(col_labels))
    ]
    header = " " * label_width + "".join(f"  {c:>{w}}" for c, w in zip(col_labels, widths))
    lines = [header, "-" * len(header)]
    for label, row in zip(row_labels, cells):
        lines.append(
            f"{label:<{label_width}}" + "".join(f"  {c:>{w}}" for c, w in zip(row, widths))
        )
    return "\n".join(line.rstrip() for line in lines)
