"""scripts/bench.py --quick runs end to end and reports every row with positive figures."""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIMED_ROWS = ["1a", "2a", "3a", "1b", "2b", "3b", "1c", "2c", "1d", "2d", "4", "5"]
TP_ROWS = ["6a", "6b"]
PP_ROWS = ["7a", "7b"]
SCALE_ROWS = ["8a", "8b", "8c", "9"]  # after the TP and PP sections


def test_quick_benchmark_writes_every_row(tmp_path):
    # One thread: two threads stall badly when other processes load the cores.
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--skip-tp",
                    "--skip-pp", "--threads", "1", "--out-dir", str(tmp_path)], check=True, cwd=REPO,
                   timeout=240, stdout=subprocess.DEVNULL)
    report = json.loads((tmp_path / "cpu.json").read_text())
    markdown = (tmp_path / "cpu.md").read_text()
    rows = {row["id"]: row for row in report["rows"]}
    assert list(rows) == TIMED_ROWS + TP_ROWS + PP_ROWS + SCALE_ROWS
    for row_id in TIMED_ROWS + SCALE_ROWS:
        row = rows[row_id]
        for key in ("a_value", "b_value", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (row_id, key, row[key])
        assert f"| {row_id} |" in markdown and f"- **{row_id}**:" in markdown
    for row_id, flag in [(r, "--skip-tp") for r in TP_ROWS] + [(r, "--skip-pp") for r in PP_ROWS]:
        assert rows[row_id]["skipped"].startswith(f"skipped: {flag}")
        assert f"| {row_id} |" in markdown
    meta = report["meta"]
    assert meta["hardware"]["cpu_cores"] >= 1 and meta["versions"]["torch"]
    assert meta["settings"]["quick"] and meta["settings"]["dtype"] == "fp32"


def test_quick_pp_section_alone(tmp_path):
    """--only pp: PP=1 here, PP=2 and DP=2 in 2 processes; the layouts train alike; the full
    report is left alone."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--only", "pp",
                    "--threads", "1", "--out-dir", str(tmp_path)], check=True, cwd=REPO,
                   timeout=240, stdout=subprocess.DEVNULL)
    assert not (tmp_path / "cpu.json").exists()
    report = json.loads((tmp_path / "cpu-only-pp.json").read_text())
    markdown = (tmp_path / "cpu-only-pp.md").read_text()
    rows = {row["id"]: row for row in report["rows"]}
    assert list(rows) == PP_ROWS and report["meta"]["sections"] == ["pp"]
    for row_id in PP_ROWS:
        row = rows[row_id]
        for key in ("a_value", "b_value", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (row_id, key, row[key])
        assert f"| {row_id} |" in markdown and f"- **{row_id}**:" in markdown
        assert "differ by at most" in row["note"]
        assert float(row["note"].split("at most ")[1].split()[0]) < 1e-5, row["note"]
    assert set(report["samples_s"]["trainer step PP"]) == {"PP=2", "DP=2", "PP=1 one process"}


def test_a_failing_section_keeps_the_others(tmp_path):
    """The report is written after every section: a section that raises becomes a FAILED row,
    the next one still runs, and the run exits 1."""
    code = f"""
import sys
from pathlib import Path
sys.path.insert(0, {str(REPO / "scripts")!r})
import bench

def broken(*args):
    raise RuntimeError("boom")

bench.RUN_SECTION["layers"] = broken
bench.mm.support_megatron_here()
settings, _ = bench.parse_settings(["--quick", "--threads", "1"])
sys.exit(1 if bench.run_benchmark(settings, Path({str(tmp_path)!r}), ("layers", "jobs")) else 0)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=240,
                          capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads((tmp_path / "cpu-only-layers-jobs.json").read_text())
    rows = {row["id"]: row for row in report["rows"]}
    assert rows["layers"]["skipped"] == "FAILED (RuntimeError: boom)"
    assert rows["4"]["ratio"] > 0
    assert report["meta"]["failed"] == {"layers": "RuntimeError: boom"}
    markdown = (tmp_path / "cpu-only-layers-jobs.md").read_text()
    assert "- sections: layers (FAILED), jobs (done)" in markdown


def test_versions_without_git(monkeypatch):
    """The GPU machine's image may have no git: the report then names no commit."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench", REPO / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench.subprocess, "run", no_git)
    found = bench.versions()
    assert "git" not in found and found["torch"] and found["megatron-core"]
