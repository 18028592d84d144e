"""Training metrics (JSONL, wandb offline, console lines, progress) and result figures/tables."""

import json
import math
import os
import struct
import sys

import pytest

from megatron_multilora.training.report.metrics import (
    MetricsLogger,
    Progress,
    format_adapter_line,
    read_metrics,
)
from megatron_multilora.training.report.plots import plot_heatmap, plot_loss_curves
from megatron_multilora.training.report.text_tables import format_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) from the PNG header, after checking the magic bytes."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def strict_json(line):
    """Parse as strict JSON: NaN/Infinity literals are an error."""

    def reject(name):
        raise AssertionError(f"non-JSON constant {name}")

    return json.loads(line, parse_constant=reject)


def test_jsonl_round_trip_with_nan_as_null_and_resume_appends(tmp_path):
    run = tmp_path / "run"
    logger = MetricsLogger(run, enabled=True, wandb_mode="disabled")
    logger.log(
        10,
        "train",
        {"rev": {"loss": 1.5, "lr": 3e-4, "grad_norm": math.nan}, "sort": {"loss": math.inf}},
        extra={"tokens": 4096},
    )
    assert len(read_metrics(run / "metrics.jsonl")) == 1  # flushed: a kill now would keep it
    logger.close()
    logger.close()  # idempotent
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1
    record = strict_json(lines[0])
    assert record["adapters"] == {
        "rev": {"loss": 1.5, "lr": 3e-4, "grad_norm": None},
        "sort": {"loss": None},
    }
    assert list(record) == ["step", "kind", "adapters", "tokens", "time"]

    resumed = MetricsLogger(run, enabled=True, wandb_mode="disabled")
    resumed.log(20, "eval", {"rev": {"loss": 1.25}})
    resumed.close()
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], r["kind"]) for r in records] == [(10, "train"), (20, "eval")]
    assert records[1]["adapters"]["rev"]["loss"] == 1.25


def test_truncated_last_line_is_skipped_and_repaired_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"step": s, "kind": "train", "adapters": {}} for s in (1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 3, "ki')
    assert read_metrics(path) == good

    # A resumed run cuts the partial record, so its first record is not glued onto it.
    logger = MetricsLogger(tmp_path, enabled=True, wandb_mode="disabled")
    logger.log(3, "train", {"a": {"loss": 0.5}})
    logger.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]

    # Damage before the last line is not an interrupted write: it is reported.
    path.write_text('{"step": 1, "ki\n' + json.dumps(good[1]) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        read_metrics(path)


def test_log_rejects_unknown_kind_and_reserved_extra_keys(tmp_path):
    logger = MetricsLogger(tmp_path, enabled=False)
    with pytest.raises(ValueError, match="kind"):
        logger.log(1, "training", {})
    with pytest.raises(ValueError, match="reserved"):
        logger.log(1, "train", {}, extra={"step": 3.0})


def test_disabled_logger_writes_nothing(tmp_path):
    run = tmp_path / "run"
    logger = MetricsLogger(run, enabled=False, wandb_mode="offline")
    logger.log(1, "train", {"a": {"loss": 1.0}})
    logger.close()
    assert not run.exists()


def test_wandb_offline_run_is_written_under_run_dir(tmp_path, monkeypatch):
    # Registered twice so undo restores the environment as it was, whatever the logger sets.
    monkeypatch.setenv("WANDB_SILENT", "unset-by-test")
    monkeypatch.delenv("WANDB_SILENT")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    logger = MetricsLogger(
        run,
        enabled=True,
        wandb_mode="offline",
        wandb_run_name="unit",
        config={"lr": 3e-4, "adapters": ["a", "b"]},
    )
    assert os.environ["WANDB_SILENT"] == "true"
    logger.log(1, "train", {"a": {"loss": 2.0}, "b": {"loss": math.nan}}, extra={"tokens": 64})
    logger.log(2, "eval", {"a": {"loss": 1.5}})
    logger.close()
    run_files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1 and run_files[0].stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing outside run_dir
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    # A resumed run continues that wandb run: the same id, so its offline folders sync as one.
    first_id = (run / "wandb" / "run_id").read_text().strip()
    assert run_files[0].name == f"run-{first_id}.wandb"
    again = MetricsLogger(run, enabled=True, wandb_mode="offline", wandb_run_name="unit")
    again.log(3, "train", {"a": {"loss": 1.0}})
    again.close()
    ids = {p.name for p in (run / "wandb").glob("offline-run-*/run-*.wandb")}
    assert ids == {f"run-{first_id}.wandb"}
    # A fresh run directory starts a run of its own.
    other = MetricsLogger(tmp_path / "other", enabled=True, wandb_mode="offline")
    other.close()
    assert (tmp_path / "other" / "wandb" / "run_id").read_text().strip() != first_id


def test_format_adapter_line_fields_and_alignment():
    metrics = {"loss": 1.234, "lr": 3e-4, "grad_norm": 0.812, "tokens_per_s": 1234.4}
    assert (
        format_adapter_line(40, "reverse", metrics)
        == "step   40 | reverse      loss  1.234 | lr 3.0e-04 | gnorm   0.812 |   1234 tok/s"
    )

    def bars(line):
        return [i for i, c in enumerate(line) if c == "|"]

    # Names within the default width align as they are; a longer one needs name_width.
    for long_name, width in (("reverse", {}), ("reverse_words_long", {"name_width": 18})):
        short = format_adapter_line(5, "a", {**metrics, "loss": math.nan}, **width)
        long = format_adapter_line(
            1200, long_name, {**metrics, "loss": 10.5, "grad_norm": None}, **width
        )
        assert len(short) == len(long)
        assert bars(short) == bars(long) and len(bars(short)) == 4
        assert short.index("loss") == long.index("loss")
        assert "loss    nan" in short and "gnorm     nan" in long

    only_loss = format_adapter_line(7, "a", {"loss": 0.5, "acc": 0.75})
    assert "lr" not in only_loss and "tok/s" not in only_loss and only_loss.endswith("| acc 0.75")


def test_progress_without_tty_prints_a_line_every_tenth(capsys):
    """Without a terminal (tqdm installed or not): lines with rate and ETA, no bar redraws."""
    assert not sys.stderr.isatty()
    bar = Progress(total=95, enabled=True, desc="train")
    for step in range(1, 96):
        bar.update(step, postfix="ok")
    bar.update(95)
    bar.write("note")
    bar.close()
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == ""
    steps = [line.split()[2] for line in lines[:-1]]
    assert steps == [f"{s}/95" for s in (*range(10, 100, 10), 95)]
    assert all("steps/s, eta" in line and line.endswith("| ok") for line in lines[:-1])
    assert lines[-1] == "note"

    resumed = Progress(total=95, enabled=True, initial=40)
    for step in range(41, 60):
        resumed.update(step)
    assert [line.split()[2] for line in capsys.readouterr().out.splitlines()] == ["50/95"]

    silent = Progress(total=10, enabled=False)
    silent.update(10)
    silent.write("hidden")
    silent.close()
    assert capsys.readouterr() == ("", "")


def records_for_plot():
    records = [
        {
            "step": s,
            "kind": "train",
            "time": 0.0,
            "adapters": {"rev": {"loss": 3.0 / s}, "sort": {"loss": None if s == 4 else 2.0 / s}},
        }
        for s in range(1, 50)
    ]
    records.append({"step": 10, "kind": "eval", "adapters": {"rev": {"loss": 1.0}}})
    return records


def assert_png(path, min_w=300, min_h=200):
    width, height = png_size(path)
    assert width >= min_w and height >= min_h
    assert path.stat().st_size > 5000  # drawn content, not a blank canvas
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_plot_loss_curves_writes_png_and_needs_records_of_the_kind(tmp_path):
    records = records_for_plot()
    out = plot_loss_curves(records, tmp_path / "figs" / "train_loss.png")
    assert out == tmp_path / "figs" / "train_loss.png"
    assert_png(out)
    assert_png(plot_loss_curves(records, tmp_path / "eval_loss.png", kind="eval"))
    with pytest.raises(ValueError, match="no 'eval' records"):
        plot_loss_curves(records[:5], tmp_path / "none.png", kind="eval")
    assert not (tmp_path / "none.png").exists()


def test_plot_heatmap_writes_png_and_checks_labels(tmp_path):
    matrix = [[0.9, 0.1, 0.4], [0.2, 0.8, math.nan]]
    out = plot_heatmap(
        matrix, ["rev", "sort"], ["reverse", "sort", "copy"], tmp_path / "h.png", title="accuracy"
    )
    assert out == tmp_path / "h.png"
    assert_png(out)
    with pytest.raises(ValueError, match="2 rows but 3 row labels"):
        plot_heatmap(matrix, ["a", "b", "c"], ["x", "y", "z"], tmp_path / "bad.png", "t")
    with pytest.raises(ValueError, match="row 0 has 3 values but there are 2 column labels"):
        plot_heatmap(matrix, ["a", "b"], ["x", "y"], tmp_path / "bad.png", "t")
    assert not (tmp_path / "bad.png").exists()


def test_format_table_marks_best_per_column():
    matrix = [[0.9, 0.1, math.nan], [0.2, 0.8, 0.5], [0.9, 0.3, 0.7]]
    rows, cols = ["rev", "sort_long", "copy"], ["reverse", "sort", "copy"]
    lines = format_table(matrix, rows, cols).splitlines()
    assert lines[0].split() == cols
    cells = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert cells == {
        "rev": ["0.90*", "0.10", "nan"],
        "sort_long": ["0.20", "0.80*", "0.50"],
        "copy": ["0.90*", "0.30", "0.70*"],
    }
    # Marked and unmarked values line up: decimal points share a position in each column.
    dots = [[i for i, c in enumerate(line) if c == "."][:2] for line in lines[2:]]
    assert dots[0] == dots[1] == dots[2]

    lower = format_table(matrix, rows, cols, value_format="{:.1f}", higher_is_better=False)
    assert [line.split()[1:] for line in lower.splitlines()[2:]] == [
        ["0.9", "0.1*", "nan"],
        ["0.2*", "0.8", "0.5*"],
        ["0.9", "0.3", "0.7"],
    ]
    assert "*" not in format_table(matrix, rows, cols, highlight_best_in_column=False)


def test_format_table_stars_nothing_when_a_column_shows_one_value():
    """Ties as shown: all-zero accuracies, and values equal at the shown precision, have no
    best; a tie for best above a worse value marks every tied cell."""
    matrix = [[0.0, 0.501, 0.9], [0.0, 0.499, 0.9], [math.nan, 0.5, 0.2]]
    lines = format_table(matrix, ["a", "b", "c"], ["x", "y", "z"]).splitlines()
    cells = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert cells == {
        "a": ["0.00", "0.50", "0.90*"],
        "b": ["0.00", "0.50", "0.90*"],
        "c": ["nan", "0.50", "0.20"],
    }


def test_format_adapter_line_shows_all_tokens_and_loss_tokens_rates():
    line = format_adapter_line(
        3, "rev", {"loss": 1.0, "tokens_per_s": 812.0, "loss_tokens_per_s": 96.0}
    )
    assert line.endswith("|    812 tok/s |     96 loss tok/s")
