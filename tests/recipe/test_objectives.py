"""SFT, DPO and GRPO jobs in one run, through the recipe: each job trains as if alone (the
same trajectory, samples and exported adapter), a GRPO job's rewards and KL are reported,
and a job whose reward fails ends alone while the others go on."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_multilora.data.demo_tasks import write_post_training_datasets
from megatron_multilora.training.checkpoints import read_training_state
from megatron_multilora.training.checks import validate
from megatron_multilora.training.config import ConfigError
from megatron_multilora.training.objectives.registry import JOB_OBJECTIVES
from megatron_multilora.training.report.metrics import read_metrics
from tests.recipe.conftest import compose_run, run_in_process
from tests.recipe.test_cli import (
    TORCHRUN,
    finish,
    last_train_step,
    latest_step,
    launch,
    wait_for_step,
)
from tests.recipe.test_serve import launch as launch_killed_at_end  # noqa: F401 (a fixture)

STEPS = 6
REL = 1e-5
# The exported weights after STEPS Adam steps: Adam's update of a coordinate whose gradient
# is near zero turns fp32 rounding (the base GEMMs round differently for other row counts on
# some CPUs) into up to lr: 1.5e-5 was measured mixed vs alone on an AVX-512 Xeon, under 1e-5
# on an EPYC. A job that leaked into another would move its weights by far more.
REL_WEIGHTS = 1e-4
# Metrics that depend on the run's speed, not on its training.
TIMING = {"tokens_per_s", "loss_tokens_per_s"}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("post")
    write_post_training_datasets(out, n_train=32, n_eval=8, seed=0)
    return out


def fields(name: str, data: Path, **extra) -> str:
    values = {
        "name": name,
        "rank": 8,
        "alpha": 16,
        "lr": 3e-3,
        "max_steps": STEPS,
        "warmup_steps": 1,
        **extra,
    }
    return "{" + ",".join(f"{k}:{v}" for k, v in values.items()) + "}"


def sft(data: Path) -> str:
    return fields(
        "sft",
        data,
        dataset=f"{data}/add.train.jsonl",
        eval_dataset=f"{data}/add.eval.jsonl",
        global_batch_size=4,
    )


def dpo(data: Path) -> str:
    return fields(
        "dpo",
        data,
        objective="dpo",
        dataset=f"{data}/reverse.pairs.train.jsonl",
        eval_dataset=f"{data}/reverse.pairs.eval.jsonl",
        global_batch_size=4,
        rank=4,
        alpha=8,
        lr=1e-2,
        dpo="{beta:0.5}",
    )


def simpo(data: Path) -> str:
    return fields(
        "simpo",
        data,
        objective="simpo",
        dataset=f"{data}/reverse.pairs.train.jsonl",
        eval_dataset=f"{data}/reverse.pairs.eval.jsonl",
        global_batch_size=4,
        rank=4,
        alpha=8,
        lr=1e-2,
        simpo="{beta:2.0,gamma:0.5}",
    )


def grpo(data: Path, reward: str = "tests.recipe.rewards:letters", name: str = "grpo") -> str:
    return fields(
        name,
        data,
        objective="grpo",
        dataset=f"{data}/sort.prompts.train.jsonl",
        eval_dataset=f"{data}/sort.prompts.eval.jsonl",
        global_batch_size=2,
        lr=1e-2,
        grpo=f"{{group_size:4,max_new_tokens:6,kl_coef:0.05,inner_steps:2,loss:gspo,"
        f"temperature:1.0,top_p:0.9,reward:'{reward}'}}",
    )


OVERRIDES = [
    "lora.slots=3",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "trainer.eval_interval=3",
    "trainer.eval_samples=4",
    "trainer.max_new_tokens=6",
    "checkpoint.save_interval=4",
    "checkpoint.resume=never",
]


def train_records(run_dir: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for record in read_metrics(run_dir / "metrics.jsonl"):
        if record["kind"] == "train":
            for name, metrics in record["adapters"].items():
                out.setdefault(name, []).append(
                    {k: v for k, v in metrics.items() if k not in TIMING}
                )
    return out


def assert_same_records(want: list[dict], got: list[dict], what: str) -> None:
    assert len(want) == len(got) == STEPS, (what, len(want), len(got))
    for step, (w, g) in enumerate(zip(want, got), start=1):
        assert w.keys() == g.keys(), (what, step)
        for key in w:
            if key == "preference_accuracy" and abs(w["margin"]) < 1e-4:
                continue  # a tie (a fresh adapter): which side wins is rounding
            # rewards and margins are differences of log-prob sums (~10): float32 rounding of
            # those, not the value's own size, bounds how equal they can be
            scale = max(abs(w[key]), 0.1)
            assert abs(w[key] - g[key]) <= REL * scale, (
                f"{what} step {step} {key}: {w[key]} vs {g[key]}"
            )


def rollout(run_dir: Path, step: int, name: str) -> dict:
    state = read_training_state(run_dir / "checkpoints" / f"step_{step:08d}")
    (progress,) = [p for p in state["trainer"]["queue"] if p["name"] == name]
    return progress["rollout"]


def mixed(data: Path, reward: str = "tests.recipe.rewards:letters") -> list[str]:
    return [sft(data), dpo(data), grpo(data, reward)]


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory) -> dict[str, Path]:
    """The three jobs together, and each alone (the same slots and settings), in one process;
    and together on the tiny MoE model."""
    tmp = tmp_path_factory.mktemp("runs")
    out = {}
    for what, jobs, extra in (
        ("mixed", mixed(data), ["logging.plots=true"]),
        ("sft", [sft(data)], []),
        ("dpo", [dpo(data)], []),
        ("grpo", [grpo(data)], []),
        ("moe", mixed(data), ["model=tiny_moe"]),
    ):
        run_in_process(tmp / what, jobs, [*OVERRIDES, *extra])
        out[what] = tmp / what
    return out


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_each_objective_trains_in_a_mixed_step_as_alone(runs, name):
    mixed, alone = train_records(runs["mixed"])[name], train_records(runs[name])[name]
    assert alone[-1]["loss"] != alone[0]["loss"]  # it trained
    assert_same_records(alone, mixed, name)
    a = load_file(str(runs[name] / "adapters" / name / "adapter.safetensors"))
    b = load_file(str(runs["mixed"] / "adapters" / name / "adapter.safetensors"))
    assert sorted(a) == sorted(b)
    for key in a:
        assert (a[key] - b[key]).norm() <= REL_WEIGHTS * max(float(a[key].norm()), 1e-12), key


def test_an_objective_added_in_its_module_alone_trains_mixed_as_alone(data, tmp_path):
    """SimPO, added as its module and a registry line: configured by its own section, its
    metrics logged, the same trajectory beside an SFT job as alone, exported."""
    for what, jobs in (("mixed", [sft(data), simpo(data)]), ("alone", [simpo(data)])):
        run_in_process(tmp_path / what, jobs, OVERRIDES)
    mixed = train_records(tmp_path / "mixed")["simpo"]
    alone = train_records(tmp_path / "alone")["simpo"]
    assert {"chosen_reward", "margin", "preference_accuracy"} <= alone[0].keys()
    assert alone[-1]["loss"] != alone[0]["loss"]  # it trained
    assert_same_records(alone, mixed, "simpo")
    assert (tmp_path / "mixed" / "adapters" / "simpo" / "adapter.safetensors").is_file()
    with pytest.raises(ConfigError, match=r"adapters\.0\.simpo\.beta=0\.0: must be > 0"):
        validate(compose_run([f"adapters=[{simpo(data).replace('beta:2.0', 'beta:0.0')}]"]))


def test_grpo_samples_do_not_depend_on_the_other_jobs(runs):
    alone, mixed = rollout(runs["grpo"], 4, "grpo"), rollout(runs["mixed"], 4, "grpo")
    assert alone["index"] == 1  # steps 3 and 4 trained on the second rollout
    assert [e["tokens"] for e in alone["examples"]] == [e["tokens"] for e in mixed["examples"]]
    assert alone["rewards"] == mixed["rewards"]
    assert len(set(alone["rewards"])) > 1  # the rewards vary: the advantages are not all zero


def torchrun(
    run_dir: Path,
    data: Path,
    layout: str,
    extra: list[str] = (),
    reward: str = "tests.recipe.rewards:letters",
) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "--local-ranks-filter=0",
        "recipes/multi_lora_finetune.py",
        f"run_dir={run_dir}",
        "hf_dir=null",
        f"adapters=[{','.join(mixed(data, reward))}]",
        f"parallel={layout}",
        "trainer.log_interval=1",
        "trainer.micro_batch_tokens=512",
        "logging.wandb_mode=disabled",
        "logging.plots=false",
        *OVERRIDES,
        *extra,
    ]


@pytest.fixture(scope="module")
def dp_run(data, tmp_path_factory) -> Path:
    """The three jobs together in a 2-process data-parallel launch, uninterrupted: the layout
    test below compares it with one process, the SIGKILL test's resumed run must repeat it."""
    tmp = tmp_path_factory.mktemp("dp")
    finish(launch(torchrun(tmp / "run", data, "dp"), tmp / "log"), tmp / "log")
    return tmp / "run"


@pytest.mark.parametrize(
    "layout,reference", [("dp", "mixed"), ("tp2", "mixed"), ("pp2", "mixed"), ("ep2", "moe")]
)
def test_every_layout_trains_each_objective_as_one_process(
    runs, data, tmp_path, request, layout, reference
):
    """Two processes (data, tensor, pipeline or expert parallel): the same samples, losses,
    metrics and exports as one process; under data parallelism each job as if alone."""
    run_dir = tmp_path / "run"
    if layout == "dp":
        run_dir = request.getfixturevalue("dp_run")  # shared with the SIGKILL test
    else:
        extra = ["model=tiny_moe"] if layout == "ep2" else []
        finish(launch(torchrun(run_dir, data, layout, extra), tmp_path / "log"), tmp_path / "log")
    got, want = train_records(run_dir), train_records(runs[reference])
    for name in ("sft", "dpo", "grpo"):
        assert_same_records(want[name], got[name], f"{layout} {name}")
        if layout == "dp":
            assert_same_records(train_records(runs[name])[name], got[name], f"dp alone {name}")
    saved = rollout(run_dir, 4, "grpo")
    assert [e["tokens"] for e in saved["examples"]] == [
        e["tokens"] for e in rollout(runs[reference], 4, "grpo")["examples"]
    ]


def test_sigkill_of_every_worker_then_resume_repeats_the_trajectories(data, dp_run, tmp_path):
    """Every process SIGKILLed after the step-3 checkpoint (between a GRPO rollout's two
    inner steps: the resumed run must train step 4 on the saved samples), then resumed:
    each job's records equal the uninterrupted run's (``dp_run``: the same launch but for its
    checkpoint interval and its reward's speed, neither of which changes a record)."""
    import signal

    import psutil

    slow, every3 = "tests.recipe.rewards:slow_letters", ["checkpoint.save_interval=3"]
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(torchrun(run_dir, data, "dp", every3, slow), log)
    processes = [psutil.Process(proc.pid), *wait_for_step(proc, run_dir, 4, log)]
    for p in processes:
        p.send_signal(signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive, f"still running after SIGKILL: {alive}"
    assert latest_step(run_dir) == 3 and 3 < last_train_step(run_dir) < STEPS
    assert rollout(run_dir, 3, "grpo")["index"] == 1  # saved mid-rollout
    out = finish(
        launch(torchrun(run_dir, data, "dp", [*every3, "checkpoint.resume=auto"], slow), log), log
    )
    assert "starting at step 3" in out
    want, got = train_records(dp_run), train_records(run_dir)
    for name in ("sft", "dpo", "grpo"):
        # steps the killed run logged after 3 may be there twice: the resumed run's are last
        assert_same_records(want[name], got[name][:3] + got[name][-(STEPS - 3) :], name)


def test_objective_metrics_are_reported(runs):
    records = train_records(runs["mixed"])
    assert {"chosen_reward", "rejected_reward", "margin", "preference_accuracy"} <= records["dpo"][
        0
    ].keys()
    assert {"reward_mean", "reward_std", "kl", "clip_fraction"} <= records["grpo"][0].keys()
    assert records["grpo"][-1]["kl"] > 0  # the adapter has moved away from the base
    assert records["dpo"][-1]["margin"] > records["dpo"][0]["margin"]
    evals = [r for r in read_metrics(runs["mixed"] / "metrics.jsonl") if r["kind"] == "eval"]
    assert "preference_accuracy" in evals[0]["adapters"]["dpo"]
    assert "loss" in evals[0]["adapters"]["grpo"]
    # The final table: each adapter's held-out preference accuracy on the DPO job's pairs.
    final = evals[-1]["adapters"]
    pairs = 4  # trainer.eval_samples
    accuracy = final["dpo"]["preference_accuracy_on_dpo"]
    assert 0 <= accuracy <= 1 and float(accuracy * pairs).is_integer(), accuracy
    assert abs(final["dpo"]["margin_on_dpo"]) > 1e-3  # the adapter prefers one side
    assert abs(final["base"]["margin_on_dpo"]) < 1e-4  # the base is the reference: no margin
    assert "preference_accuracy_on_sft" not in final["base"]  # SFT tasks have no such metric
    assert (runs["mixed"] / "reward_curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "reward,why",
    [("raises", "raised RuntimeError: the grader is down"), ("not_a_number", "returned 'high'")],
)
def test_a_failing_reward_ends_its_job_alone(data, tmp_path, capsys, reward, why):
    _, trainer = run_in_process(
        tmp_path / "run",
        [sft(data), grpo(data, f"tests.recipe.rewards:{reward}", "bad")],
        OVERRIDES,
    )
    out = capsys.readouterr().out
    jobs = {job.name: job for job in trainer.board.jobs}
    assert jobs["bad"].status == "failed" and why in jobs["bad"].reason
    assert f"{data}/sort.prompts.train.jsonl record" in jobs["bad"].reason
    assert jobs["sft"].status == "done" and jobs["sft"].steps_done == STEPS
    assert "job bad failed" in out


def problems(jobs: list[str], *overrides: str) -> str:
    """The config check's message for a run of ``jobs``: it must refuse it, at once."""
    run = compose_run(["hf_dir=null", f"adapters=[{','.join(jobs)}]", *overrides])
    with pytest.raises(ConfigError) as err:
        validate(run)
    return str(err.value)


def test_bad_preference_and_prompt_records_are_named_by_file_and_line(data, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        '{"prompt": "a=", "chosen": "b", "rejected": "c"}\n{"prompt": "a=", "chosen": "b"}\n'
    )
    msg = problems([fields("p", data, objective="dpo", dataset=pairs, global_batch_size=2)])
    assert f"adapters.0.dataset: {pairs}:2: missing 'rejected'" in msg
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a=", "answer": "b"}\n{"prompt": "c="}\n')
    msg = problems([fields("g", data, objective="grpo", dataset=prompts, global_batch_size=2)])
    assert (
        f'adapters.0.dataset: {prompts}: record 1 has no "answer", which '
        "grpo.reward=exact_match compares the completion with"
    ) in msg
    # a column mapping makes the same file readable
    columns = tmp_path / "columns.jsonl"
    columns.write_text('{"question": "a=", "solution": "b"}\n')
    validate(
        compose_run(
            [
                "hf_dir=null",
                "adapters=["
                + fields(
                    "g",
                    data,
                    objective="grpo",
                    dataset=columns,
                    global_batch_size=2,
                    columns="{prompt:question,answer:solution}",
                )
                + "]",
            ]
        )
    )


@pytest.mark.parametrize(
    "setting,message",
    [
        ("group_size:1", "adapters.0.grpo.group_size=1: must be >= 2"),
        ("top_p:0", "adapters.0.grpo.top_p=0.0: must be in (0, 1]"),
        ("clip_low:1.5", "adapters.0.grpo.clip_low=1.5: must be in [0.0, 1.0)"),
        (
            "aggregation:sum",
            "adapters.0.grpo.aggregation='sum': must be one of 'token_mean', 'sequence_mean'",
        ),
        (
            "reward:'nosuch.module:score'",
            "adapters.0.grpo.reward='nosuch.module:score': cannot import "
            "nosuch.module (ModuleNotFoundError",
        ),
        ("reward:'tests.recipe.rewards:nothing'", "tests.recipe.rewards has no function 'nothing'"),
        (
            "max_new_tokens:64",
            "adapters.0.grpo.max_new_tokens=64: must be below trainer.max_seq_len=64",
        ),
    ],
)
def test_grpo_settings_out_of_range_are_refused(data, setting, message):
    job = fields(
        "g",
        data,
        objective="grpo",
        dataset=f"{data}/sort.prompts.train.jsonl",
        global_batch_size=2,
        grpo="{" + setting + "}",
    )
    assert message in problems([job], "trainer.max_seq_len=64")


def test_an_unknown_objective_is_refused(data):
    msg = problems(
        [fields("x", data, objective="ppo", dataset=f"{data}/add.train.jsonl", global_batch_size=2)]
    )
    names = ", ".join(f"'{name}'" for name in JOB_OBJECTIVES)  # the registry's
    assert msg.endswith(f"\n  - adapters.0.objective='ppo': must be one of {names}"), msg


def test_dpo_settings_out_of_range_are_refused(data):
    job = fields(
        "p",
        data,
        objective="dpo",
        dataset=f"{data}/reverse.pairs.train.jsonl",
        global_batch_size=2,
        dpo="{beta:0,loss_type:hinge}",
    )
    msg = problems([job])
    assert "adapters.0.dpo.beta=0.0: must be > 0" in msg
    assert "adapters.0.dpo.loss_type='hinge': must be one of 'sigmoid', 'ipo'" in msg


def test_dpo_and_grpo_jobs_submitted_to_a_serving_trainer_train_and_export(
    data,
    tmp_path,
    launch_killed_at_end,  # noqa: F811 (the fixture imported above)
):
    """`mmlora submit` of a DPO and a GRPO job (YAML specs) into a serving 2-process run:
    both train next to its SFT job and export; a DPO spec whose data lacks "rejected" is
    refused by `mmlora submit` itself, naming the file and line."""
    import yaml

    from tests.recipe.test_serve import command as serve_command
    from tests.recipe.test_serve import mmlora, status, submit, wait_for

    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch_killed_at_end(
        serve_command(
            run,
            [sft(data).replace(f"max_steps:{STEPS}", "max_steps:40")],
            ["trainer.serve=true", "lora.slots=3"],
        ),
        log,
    )
    wait_for(lambda: last_train_step(run) >= 1, proc, log)
    specs = {
        "pdpo": {
            "objective": "dpo",
            "dataset": f"{data}/reverse.pairs.train.jsonl",
            "global_batch_size": 4,
            "dpo": {"beta": 0.5},
        },
        "pgrpo": {
            "objective": "grpo",
            "dataset": f"{data}/sort.prompts.train.jsonl",
            "global_batch_size": 2,
            "grpo": {
                "group_size": 4,
                "max_new_tokens": 6,
                "reward": "tests.recipe.rewards:letters",
            },
        },
    }
    for name, extra in specs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            yaml.safe_dump(
                {"name": name, "rank": 4, "alpha": 8, "lr": 1e-2, "max_steps": 4, **extra}
            )
        )
        submit(run, path)
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text('{"prompt": "a=", "chosen": "b"}\n')
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "name": "bad",
                "objective": "dpo",
                "dataset": str(bad_data),
                "max_steps": 2,
                "global_batch_size": 2,
            }
        )
    )
    refused = mmlora("submit", "--run-dir", run, bad)
    assert refused.returncode != 0 and f"{bad_data}:1: missing 'rejected'" in refused.stderr
    wait_for(
        lambda: (
            {j["name"]: j["status"] for j in status(run)["jobs"]}.get("pgrpo") == "done"
            and {j["name"]: j["status"] for j in status(run)["jobs"]}.get("pdpo") == "done"
        ),
        proc,
        log,
    )
    assert mmlora("stop", "--run-dir", run).returncode == 0
    finish(proc, log)
    records = train_records(run)
    assert "preference_accuracy" in records["pdpo"][0] and "reward_mean" in records["pgrpo"][0]
    assert len(records["pdpo"]) == len(records["pgrpo"]) == 4
    for name in specs:
        assert (run / "adapters" / name / "adapter.safetensors").is_file()


def test_every_objective_paged_through_one_slot_trains_as_alone(runs, data, tmp_path):
    """The SFT, DPO and GRPO jobs taking turns in one device slot (trainer.active_jobs=3),
    each paged out while the others step: every job's records equal its run alone, and
    GRPO's samples are the same tokens."""
    _, trainer = run_in_process(
        tmp_path / "paged",
        mixed(data),
        [*OVERRIDES, "lora.slots=1", "trainer.active_jobs=3", "checkpoint.keep_last=0"],
    )
    assert trainer.rt.table.stats.pages_out >= 2 * STEPS  # every turn paged another job out
    paged = train_records(tmp_path / "paged")
    for name in ("sft", "dpo", "grpo"):
        assert_same_records(train_records(runs[name])[name], paged[name], f"{name} paged")
    alone, got = rollout(runs["grpo"], 4, "grpo"), rollout(tmp_path / "paged", 12, "grpo")
    assert [e["tokens"] for e in alone["examples"]] == [e["tokens"] for e in got["examples"]]
