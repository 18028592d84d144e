"""The ``mmlora`` command line on a real run directory (the composed config the recipe writes)."""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megatron_multilora import cli
from megatron_multilora.cli import jobs as jobs_cli
from megatron_multilora.training.mailbox import folder

REPO = Path(__file__).resolve().parents[2]
GOOD_LINES = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(4)]


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory as a serving launch leaves it: hydra/config.yaml with interpolations."""
    demo, run = tmp_path / "demo", tmp_path / "run"
    demo.mkdir()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[f"data_dir={demo}", f"run_dir={run}", "hf_dir=null", "trainer.serve=true"],
        )
    (run / "hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / "hydra" / "config.yaml")
    return run


@pytest.fixture
def data(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", GOOD_LINES)
    write_jsonl(folder / "eval.jsonl", GOOD_LINES[:2])
    return folder


def spec_file(folder: Path, spec: dict | str, name: str = "job.yaml") -> Path:
    path = folder / name
    path.write_text(spec if isinstance(spec, str) else json.dumps(spec), encoding="utf-8")
    return path


def good_spec(data: Path, **fields) -> dict:
    spec = {"name": "newjob", "dataset": str(data / "train.jsonl"), "rank": 8, "max_steps": 20}
    spec.update(fields)
    return {k: v for k, v in spec.items() if v is not ...}  # ...: leave the field out


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"<dir>")
        for p in sorted(folder.rglob("*"))
    }


def live_status(**fields) -> dict:
    status = {
        "state": "training",
        "step": 12,
        "updated_at": time.time() - 64.6,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "dp_size": 1,
        "max_rank": 16,
        "slots": 4,
        "jobs": [
            {
                "name": "reverse",
                "status": "active",
                "slot": 0,
                "steps_done": 10,
                "total_steps": 500,
                "loss": 3.21,
                "eval_loss": 3.4,
                "tokens_per_s": 1234.0,
                "eta_s": 65.0,
                "source": "config",
            },
            {
                "name": "add",
                "status": "done",
                "slot": None,
                "steps_done": 500,
                "total_steps": 500,
                "loss": 0.5,
                "eval_loss": None,
                "tokens_per_s": None,
                "eta_s": None,
                "source": "config",
            },
        ],
    }
    status.update(fields)
    return status


# ---------------------------------------------------------------------------------------------
# submit: refusals


BAD_SPECS = {
    "unknown key": (dict(rnak=8), ["'rnak'", "unknown key"]),
    "bad type": (dict(rank="eight"), ["rank", "eight"]),
    "missing dataset": (dict(dataset=...), ["dataset: missing"]),
    "missing name": (dict(name=...), ["name: missing"]),
    "dataset file missing": (dict(dataset="nope.jsonl"), ["dataset", "nope.jsonl: file not found"]),
    "rank above max": (dict(rank=32), ["rank=32", "lora.max_rank=16"]),
    "config name": (dict(name="reverse"), ["'reverse' is already a job of the run's config"]),
    "base": (dict(name="base"), ["name='base': reserved"]),
    "slash in name": (dict(name="a/b"), ["name='a/b'", "letters, digits"]),
    "leading dot": (dict(name=".hidden"), ["name='.hidden'"]),
    "start_step": (dict(start_step=5), ["start_step: remove it"]),
    "both budgets": (dict(epochs=1.0), ["give exactly one of them"]),
    "no budget": (dict(max_steps=...), ["give exactly one of them"]),
    "bad init_from": (dict(init_from="no-such-adapter"), ["init_from", "not a folder"]),
    "grpo tokens": (
        dict(objective="grpo", grpo={"max_new_tokens": 10**6}),
        ["grpo.max_new_tokens=1000000: must be below trainer.max_seq_len="],
    ),
}


@pytest.mark.parametrize("fields,expected", BAD_SPECS.values(), ids=list(BAD_SPECS))
def test_submit_refuses_a_bad_spec_and_writes_nothing(
    run_dir, data, tmp_path, monkeypatch, fields, expected
):
    monkeypatch.chdir(tmp_path)
    spec = spec_file(tmp_path, good_spec(data, **fields))
    before = snapshot(run_dir)
    code, out, err = run_cli("submit", "--run-dir", run_dir, spec)
    assert code == 2 and out == ""
    assert str(spec) in err
    for text in expected:
        assert text in err
    assert snapshot(run_dir) == before


def test_submit_refuses_a_malformed_dataset_line_naming_file_and_line(run_dir, data, tmp_path):
    bad = data / "bad.jsonl"
    bad.write_text(json.dumps(GOOD_LINES[0]) + "\n{not json\n", encoding="utf-8")
    spec = spec_file(tmp_path, good_spec(data, eval_dataset=str(bad)))
    before = snapshot(run_dir)
    code, _, err = run_cli("submit", "--run-dir", run_dir, spec)
    assert code == 2 and f"eval_dataset: {bad}:2: malformed JSON" in err
    assert snapshot(run_dir) == before


def test_submit_lists_every_problem_at_once(run_dir, data, tmp_path):
    spec = spec_file(
        tmp_path, good_spec(data, name="base", rank=32, epochs=2.0, start_step=3, rnak=4)
    )
    code, _, err = run_cli("submit", "--run-dir", run_dir, spec)
    assert code == 2
    for text in (
        "name='base': reserved",
        "start_step",
        "unknown key 'rnak'; did you mean 'rank'?",
        "rank=32",
        "give exactly one of them",
    ):
        assert text in err
    # A mistyped field leaves the per-job checks out: they would check its default instead.
    spec = spec_file(tmp_path, good_spec(data, rank="x", max_steps=..., lr=[1]))
    code, _, err = run_cli("submit", "--run-dir", run_dir, spec)
    assert code == 2 and "rank: Value 'x'" in err and "lr: " in err
    assert "give exactly one" not in err and "full_key" not in err


def test_submit_refuses_a_duplicate_of_a_submitted_name(run_dir, data, tmp_path):
    spec = spec_file(tmp_path, good_spec(data))
    assert run_cli("submit", "--run-dir", run_dir, spec)[0] == 0
    before = snapshot(run_dir)
    code, _, err = run_cli("submit", "--run-dir", run_dir, spec)
    assert code == 2 and "'newjob': a job of that name was already submitted" in err
    assert snapshot(run_dir) == before


def test_submit_checks_the_batch_against_the_reported_data_parallel_size(run_dir, data, tmp_path):
    folder.write_status(run_dir, live_status(dp_size=2))
    spec = spec_file(tmp_path, good_spec(data, global_batch_size=3))
    code, _, err = run_cli("submit", "--run-dir", run_dir, spec)
    assert (
        code == 2 and "global_batch_size=3: must be a multiple of the data-parallel size 2" in err
    )


@pytest.mark.parametrize(
    "text,expected",
    [("name: [unclosed", "not valid YAML or JSON"), ("- a\n- b\n", "expected one mapping")],
)
def test_submit_refuses_a_spec_that_is_not_one_mapping(run_dir, tmp_path, text, expected):
    before = snapshot(run_dir)
    code, _, err = run_cli("submit", "--run-dir", run_dir, spec_file(tmp_path, text))
    assert code == 2 and expected in err
    assert snapshot(run_dir) == before


def test_submit_refuses_a_folder_that_is_not_a_run_directory(data, tmp_path):
    not_run = tmp_path / "elsewhere"
    not_run.mkdir()
    code, _, err = run_cli("submit", "--run-dir", not_run, spec_file(tmp_path, good_spec(data)))
    assert code == 2 and "is not a run directory" in err and "trainer.serve=true" in err
    assert snapshot(not_run) == {}


# ---------------------------------------------------------------------------------------------
# submit: acceptance


def test_submit_lands_one_file_with_absolute_paths(run_dir, data, tmp_path, monkeypatch):
    monkeypatch.chdir(data)
    spec = spec_file(
        tmp_path,
        "name: newjob\ndataset: train.jsonl\neval_dataset: ./eval.jsonl\nrank: '8'\nepochs: 1\n",
        name="job.yaml",
    )
    before = snapshot(run_dir)
    code, out, err = run_cli("submit", "--run-dir", run_dir, spec)
    assert (code, err) == (0, "")
    assert "submitted job newjob" in out and "when the run is resumed" in out  # no trainer yet
    added = set(snapshot(run_dir)) - set(before)
    assert added == {"serve", "serve/submitted", "serve/submitted/newjob.json"}
    [sub] = folder.submissions(run_dir)
    assert sub.job == {
        "name": "newjob",
        "dataset": str(data / "train.jsonl"),
        "eval_dataset": str(data / "eval.jsonl"),
        "rank": 8,
        "epochs": 1.0,
    }


def test_submit_to_a_live_trainer_says_next_step_boundary(run_dir, data, tmp_path):
    folder.write_status(run_dir, live_status())
    code, out, _ = run_cli("submit", "--run-dir", run_dir, spec_file(tmp_path, good_spec(data)))
    assert code == 0 and "at its next step boundary" in out
    folder.write_status(run_dir, live_status(state="stopped"))
    spec = spec_file(tmp_path, good_spec(data, name="other"))
    code, out, _ = run_cli("submit", "--run-dir", run_dir, spec)
    assert code == 0 and "when the run is resumed" in out


def _submit_in_child(run_dir: str, spec: str, barrier, results) -> None:
    err = io.StringIO()
    barrier.wait()  # all at once
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(["submit", "--run-dir", run_dir, spec])
    results.put((code, err.getvalue()))


def _race(run_dir: Path, specs: list[Path]) -> list[tuple[int, str]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(len(specs)), ctx.Queue()
    procs = [
        ctx.Process(target=_submit_in_child, args=(str(run_dir), str(s), barrier, results))
        for s in specs
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return outcomes


def test_racing_submissions_of_one_name_land_exactly_one(run_dir, data, tmp_path):
    spec = spec_file(tmp_path, good_spec(data))
    outcomes = _race(run_dir, [spec] * 8)
    assert sorted(code for code, _ in outcomes) == [0] + [2] * 7
    for code, err in outcomes:
        assert code == 0 or "a job of that name was already submitted" in err
    assert sorted(os.listdir(folder.serve_dir(run_dir) / "submitted")) == ["newjob.json"]


def test_racing_submissions_of_two_names_both_land(run_dir, data, tmp_path):
    specs = [spec_file(tmp_path, good_spec(data, name=n), name=f"{n}.json") for n in ("a1", "b2")]
    assert [code for code, _ in _race(run_dir, specs)] == [0, 0]
    assert sorted(os.listdir(folder.serve_dir(run_dir) / "submitted")) == ["a1.json", "b2.json"]


# ---------------------------------------------------------------------------------------------
# status


def _submit(run_dir: Path, data: Path, tmp_path: Path, name: str) -> None:
    spec = spec_file(tmp_path, good_spec(data, name=name), name=f"{name}.json")
    assert run_cli("submit", "--run-dir", run_dir, spec)[0] == 0


def test_status_merges_reports_submissions_cancels_and_refusals(
    run_dir, data, tmp_path, monkeypatch
):
    _submit(run_dir, data, tmp_path, "pending")
    _submit(run_dir, data, tmp_path, "turned-down")
    folder.append_event(
        run_dir,
        {
            "event": "refuse",
            "name": "turned-down",
            "step": 11,
            "reason": "rank 16 exceeds the free memory",
        },
    )
    folder.request_cancel(run_dir, "reverse")
    status = live_status()
    folder.write_status(run_dir, status)
    # Read 64.6 s after the report, however slow this machine's disk: "updated 1m05s ago".
    monkeypatch.setattr(
        jobs_cli, "time", types.SimpleNamespace(time=lambda: status["updated_at"] + 64.6)
    )
    code, out, err = run_cli("status", "--run-dir", run_dir)
    assert (code, err) == (0, "")
    header, _, columns, *rows = out.splitlines()
    assert "trainer training at step 12" in header and "updated 1m05s ago" in header
    assert f"process {os.getpid()} alive" in header
    assert columns.split()[:4] == ["NAME", "STATE", "SLOT", "STEP"]
    table = {row.split()[0]: row for row in rows}
    assert table["reverse"].split()[1:] == [
        "active",
        "(cancelling)",
        "0",
        "10/500",
        "3.2100",
        "3.4000",
        "1234",
        "1m05s",
    ]
    assert table["add"].split()[1:4] == ["done", "-", "500/500"]
    assert table["pending"].split()[1:4] == ["submitted", "-", "0/20"]
    assert table["turned-down"].split()[1] == "refused"
    assert "refused turned-down at step 11: rank 16 exceeds the free memory" in out


def test_status_without_a_trainer_report_lists_submissions(run_dir, data, tmp_path):
    code, out, _ = run_cli("status", "--run-dir", run_dir)
    assert code == 0 and "has not reported yet" in out and "(no jobs)" in out
    _submit(run_dir, data, tmp_path, "early")
    code, out, _ = run_cli("status", "--run-dir", run_dir)
    assert code == 0 and "has not reported yet" in out
    assert out.splitlines()[-1].split()[:2] == ["early", "submitted"]


def test_status_json_and_a_dead_trainer(run_dir, data, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer lives
    folder.write_status(run_dir, live_status(pid=dead.pid))
    _submit(run_dir, data, tmp_path, "pending")
    folder.request_stop(run_dir)
    code, out, _ = run_cli("status", "--run-dir", run_dir, "--json")
    report = json.loads(out)
    assert code == 0 and report["trainer_alive"] is False and report["stop_requested"] is True
    assert report["trainer"]["step"] == 12
    assert [(j["name"], j["status"]) for j in report["jobs"]] == [
        ("reverse", "active"),
        ("add", "done"),
        ("pending", "submitted"),
    ]
    assert "not running" in run_cli("status", "--run-dir", run_dir)[1]


def test_status_refuses_a_folder_that_is_not_a_run_directory(tmp_path):
    code, _, err = run_cli("status", "--run-dir", tmp_path)
    assert code == 2 and "is not a run directory" in err


# ---------------------------------------------------------------------------------------------
# cancel and stop


def test_cancel_refuses_unknown_and_ended_jobs(run_dir):
    folder.write_status(run_dir, live_status())
    before = snapshot(run_dir)
    code, _, err = run_cli("cancel", "--run-dir", run_dir, "nosuch")
    assert code == 2 and "no job named 'nosuch'" in err and "reverse" in err
    code, _, err = run_cli("cancel", "--run-dir", run_dir, "add")
    assert code == 2 and "'add'" in err and "already ended (done)" in err
    assert snapshot(run_dir) == before


def test_cancel_requests_an_active_a_configured_and_a_submitted_job(run_dir, data, tmp_path):
    folder.write_status(run_dir, live_status())
    _submit(run_dir, data, tmp_path, "pending")
    for name in ("reverse", "sort", "pending"):  # reported, config only, submission only
        code, out, err = run_cli("cancel", "--run-dir", run_dir, name)
        assert (code, err) == (0, "") and "at its next step boundary" in out
    assert folder.cancel_requests(run_dir) == {"reverse", "sort", "pending"}


def test_stop_requests_a_stop(run_dir):
    folder.write_status(run_dir, live_status())
    code, out, _ = run_cli("stop", "--run-dir", run_dir)
    assert code == 0 and "same launch command" in out
    assert folder.stop_requested(run_dir)


def test_stop_refuses_a_folder_that_is_not_a_run_directory(tmp_path):
    code, _, err = run_cli("stop", "--run-dir", tmp_path)
    assert code == 2 and "is not a run directory" in err
    assert not folder.stop_requested(tmp_path)


# ---------------------------------------------------------------------------------------------
# As a program


def test_runs_as_a_module(run_dir, data, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "megatron_multilora.cli"]
    spec = spec_file(tmp_path, good_spec(data, rank=99))
    bad = subprocess.run(
        command + ["submit", "--run-dir", str(run_dir), str(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "rank=99" in bad.stderr and bad.stdout == ""
    good = subprocess.run(
        command + ["status", "--run-dir", str(run_dir), "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert good.returncode == 0 and json.loads(good.stdout)["jobs"] == []
    usage = subprocess.run(
        command + ["status"], env=env, capture_output=True, text=True, timeout=120
    )
    assert usage.returncode == 2 and "--run-dir" in usage.stderr


def test_installed_as_the_mmlora_command(run_dir):
    script = Path(sys.executable).with_name("mmlora")
    assert script.is_file(), "pyproject's [project.scripts] installs mmlora (pip install -e .)"
    done = subprocess.run(
        [str(script), "stop", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0 and folder.stop_requested(run_dir), done.stderr


def test_no_command_loads_torch_or_megatron(run_dir, data, tmp_path):
    # Seconds of imports would stand between a user and every answer, a submission's checks
    # included.
    spec = spec_file(tmp_path, good_spec(data))
    commands = [
        ["submit", "--run-dir", str(run_dir), str(spec)],
        ["status", "--run-dir", str(run_dir)],
        ["cancel", "--run-dir", str(run_dir), "newjob"],
        ["stop", "--run-dir", str(run_dir)],
    ]
    code = (
        "import json, sys; from megatron_multilora import cli; "
        "codes = [cli.main(argv) for argv in json.loads(sys.argv[1])]; "
        "print(json.dumps([codes, [m for m in ('torch', 'megatron') if m in sys.modules]]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[0, 0, 0, 0], []], done.stdout
    assert folder.submitted_names(run_dir) == {"newjob"} and folder.stop_requested(run_dir)


def test_version_and_the_verbs_a_user_looks_for():
    from importlib import metadata

    code, out, _ = run_cli("--version")
    assert (
        code == 0
        and out.strip() == f"mmlora (megatron-multilora) {metadata.version('megatron-multilora')}"
    )
    code, out, _ = run_cli("--help")
    assert code == 0 and all(
        verb in out for verb in ("train", "export", "submit", "status", "cancel", "stop")
    )
    code, _, err = run_cli("train", "--nproc", "0")
    assert code == 2 and "--nproc 0: give at least 1 process" in err
    code, _, err = run_cli("export", "only-one-argument")
    assert code == 2 and "out" in err


def test_status_into_a_pipe_that_closes_early_is_no_error(run_dir):
    """`mmlora status --json | head -1`: the reader goes away before the output is written;
    the command ends quietly (no BrokenPipeError traceback), as a Unix tool does. Here the
    pipe's reading end is closed before the command starts, so every write fails."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "megatron_multilora.cli",
                "status",
                "--run-dir",
                str(run_dir),
                "--json",
            ],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
