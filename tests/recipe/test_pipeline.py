"""Pipeline parallelism through the recipe, as users launch it (torchrun CLI): a PP=2 run
(``parallel=pp2``, 2 processes, one stage each) and a PP=1 run (1 process) of the same jobs
from the same HF base train the same trajectories and export the same adapter and PEFT
folders; their checkpoints hold the same layout-independent tensors and resume under the
other layout; a MoE base built from its config does the same at PP=2.

Three jobs on two slots: ``srt`` waits for ``rev``'s slot, so a slot is handed on under PP.
Every job has LoRA dropout 0: dropout masks come from the default generator in an order that
depends on the layout, so with dropout the layouts train (slightly) different adapters.

Measured on CPU (the same comparisons, thresholds removed): dense losses PP=2 vs PP=1
<= 8.1e-9 relative, adapter and PEFT tensors <= 5.4e-8 (norm of the difference over the
norm), checkpoints after steps 3 and 6 bitwise equal; the resumed runs equal one of the two
uninterrupted runs bitwise and the other to those figures; MoE losses <= 1.1e-8, adapter
tensors <= 2.8e-7.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_multilora.models.tiny_hf import write_tiny_llama
from tests.recipe.conftest import job, losses_by_adapter
from tests.recipe.test_cli import TORCHRUN, finish, launch

LOSS_RTOL = 1e-6  # per-step train loss, relative (measured <= 1.1e-8)
TENSOR_RTOL = 1e-5  # ||a - b|| / ||a|| per tensor (measured <= 2.8e-7)
NUM_LAYERS = 4  # two per stage: stage 1's local layers 0, 1 are global layers 2, 3
STEPS = {"rev": 4, "add": 6, "srt": 4}  # srt takes rev's slot 0 after step 4
DONE_AT = {"rev": 4, "add": 6, "srt": 8}  # the trainer step after which each job is exported
TOTAL, SAVE_EVERY = 8, 3  # checkpoints after steps 3, 6 and 8
LAYOUTS = {"pp2": 2, "pp1": 1}  # name -> processes
PARALLEL = {"pp2": "parallel=pp2", "pp1": "parallel=dp"}


def dense_jobs(demo: Path) -> list[str]:
    # different ranks, warmup and schedules: a resume that restored the wrong lr or rank shows
    return [
        job("rev", demo, "reverse", STEPS["rev"], warmup_steps=2, dropout=0.0),
        job("add", demo, "add", STEPS["add"], rank=4, alpha=8, schedule="linear", dropout=0.0),
        job("srt", demo, "sort", STEPS["srt"], dropout=0.0),
    ]


def command(
    run_dir: Path, layout: str, jobs: list[str], base: list[str], extra: list[str] = ()
) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        f"--nproc-per-node={LAYOUTS[layout]}",
        "--local-ranks-filter=0",
        "recipes/multi_lora_finetune.py",
        f"run_dir={run_dir}",
        *base,
        PARALLEL[layout],
        f"adapters=[{','.join(jobs)}]",
        "lora.slots=2",
        "trainer.log_interval=1",
        "trainer.eval_interval=0",
        "trainer.micro_batch_tokens=512",
        "trainer.eval_samples=4",
        "trainer.max_new_tokens=4",
        f"checkpoint.save_interval={SAVE_EVERY}",
        "checkpoint.keep_last=5",
        "logging.wandb_mode=disabled",
        "logging.plots=false",
        *extra,
    ]


def run(cmd: list[str], log: Path) -> str:
    return finish(launch(cmd, log), log)


def start_line(out: str) -> re.Match:
    """The run's start line: world, pp, dp, precision, trainable parameters per rank, first
    step."""
    found = re.search(
        r"world (\d+) \(tp 1, sp False, ep 1, pp (\d+), dp 1\), fp32, ([\d,]+) trainable "
        r"parameters per rank, starting at step (\d+)",
        out,
    )
    assert found, f"no start line:\n{out[-3000:]}"
    return found


def logged_steps(out: str) -> list[int]:
    """Trainer steps with a train line in the console output."""
    return [int(s) for s in re.findall(r"^step +(\d+) \| ", out, re.MULTILINE)]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / a.norm().clamp_min(1e-30)).item()


def assert_same_tensors(want: Path, got: Path) -> dict[str, torch.Tensor]:
    """Same keys, shapes and values (to TENSOR_RTOL); returns ``want``'s tensors."""
    a, b = load_file(str(want)), load_file(str(got))
    assert sorted(a) == sorted(b), f"{got}: keys differ from {want}"
    for k in a:
        assert a[k].shape == b[k].shape, (got, k)
        assert a[k].norm() > 0 or k.startswith("exp_avg"), f"{want}: {k} is all zeros"
        assert rel_diff(a[k], b[k]) < TENSOR_RTOL, (
            f"{got}: {k} differs by {rel_diff(a[k], b[k]):.2e}"
        )
    return a


def assert_same_losses(want: dict, got: dict, what: str) -> None:
    assert set(got) == set(want) == set(STEPS), (what, set(got))
    for name, steps in STEPS.items():
        assert len(want[name]) == len(got[name]) == steps, (what, name, len(got[name]))
        worst = max(abs(g - w) / abs(w) for g, w in zip(got[name], want[name]))
        assert worst < LOSS_RTOL, f"{what}: {name}'s losses differ by {worst:.2e} relative"


def assert_same_exports(want: Path, got: Path) -> None:
    """adapters/<job> and peft/<job> of two runs: the same files, configs and tensors; the
    tensors cover every global layer."""
    for folder, tensors, layer in (
        ("adapters", "adapter.safetensors", "decoder.layers.{}."),
        ("peft", "adapter_model.safetensors", "model.layers.{}."),
    ):
        for name in STEPS:
            a, b = want / folder / name, got / folder / name
            assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir()), b
            config = json.loads((a / "adapter_config.json").read_text())
            assert config == json.loads((b / "adapter_config.json").read_text()), b
            keys = assert_same_tensors(a / tensors, b / tensors)
            for i in range(NUM_LAYERS):
                assert any(layer.format(i) in k for k in keys), f"{a}: no tensors of layer {i}"


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> Path:
    return write_tiny_llama(
        tmp_path_factory.mktemp("base") / "tiny-llama", hidden_size=64, num_layers=NUM_LAYERS
    )


@pytest.fixture(scope="module")
def runs(demo_data, hf_base, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The uninterrupted runs: {layout: (run_dir, console output)}."""
    tmp = tmp_path_factory.mktemp("pipeline")
    out = {}
    for layout in LAYOUTS:
        out[layout] = (
            tmp / layout,
            run(
                command(tmp / layout, layout, dense_jobs(demo_data), [f"hf_dir={hf_base}"]),
                tmp / f"{layout}.log",
            ),
        )
    return out


def test_pp2_run_splits_the_model_and_hands_a_slot_on(runs):
    pp2, pp1 = start_line(runs["pp2"][1]), start_line(runs["pp1"][1])
    assert (pp2[1], pp2[2], pp2[4]) == ("2", "2", "0") and (pp1[1], pp1[2], pp1[4]) == (
        "1",
        "1",
        "0",
    )
    # each stage holds half of the layers, so half of the adapter parameters
    assert 2 * int(pp2[3].replace(",", "")) == int(pp1[3].replace(",", ""))
    for _, out in runs.values():
        assert "step 4: job rev done (4 steps); slot 0 is free" in out
        assert "step 4: job srt starts on slot 0 (4 steps, rank" in out
        for name, steps in STEPS.items():
            assert f"job {name}: done after {steps} steps" in out
        assert logged_steps(out) == sorted(2 * list(range(1, TOTAL - 1)) + [TOTAL - 1, TOTAL])


def test_pp2_losses_equal_pp1(runs):
    assert_same_losses(
        losses_by_adapter(runs["pp1"][0]), losses_by_adapter(runs["pp2"][0]), "PP=2 vs PP=1"
    )


def test_pp2_adapter_and_peft_exports_equal_pp1(runs):
    assert_same_exports(runs["pp1"][0], runs["pp2"][0])


def test_checkpoints_hold_the_same_tensors_under_both_layouts(runs):
    pp1, pp2 = (runs[layout][0] / "checkpoints" for layout in ("pp1", "pp2"))
    # jobs training: rev and add after step 3; srt (in rev's old slot) after 6; none at the end
    for step, held in ((SAVE_EVERY, ["add", "rev"]), (2 * SAVE_EVERY, ["srt"]), (TOTAL, [])):
        folder = f"step_{step:08d}"
        a = torch.load(pp1 / folder / "state.pt", weights_only=False)
        b = torch.load(pp2 / folder / "state.pt", weights_only=False)
        assert (a["world_size"], b["world_size"]) == (1, 2)
        assert sorted(a["jobs"]) == sorted(b["jobs"]) == held, (step, sorted(b["jobs"]))
        assert a["trainer"]["queue"] == b["trainer"]["queue"]
        for name in a["jobs"]:
            assert a["jobs"][name]["rank"] == b["jobs"][name]["rank"]
            keys = assert_same_tensors(
                pp1 / folder / f"job.{name}.safetensors", pp2 / folder / f"job.{name}.safetensors"
            )
            assert any(k.startswith(f"param/decoder.layers.{NUM_LAYERS - 1}.") for k in keys)


@pytest.mark.parametrize(
    "source,target,step", [("pp2", "pp1", SAVE_EVERY), ("pp1", "pp2", 2 * SAVE_EVERY)]
)
def test_checkpoint_resumes_under_the_other_layout(
    source, target, step, runs, demo_data, hf_base, tmp_path
):
    """From step 3 (rev and add training, srt queued: the hand-off happens after the resume)
    or step 6 (srt two steps into rev's old slot, add just done)."""
    assert 0 < step < TOTAL
    run_dir = tmp_path / "run"
    shutil.copytree(runs[source][0], run_dir)
    for name, done_at in DONE_AT.items():  # exports due after the checkpoint: the resumed run's
        if done_at > step:
            for folder in ("adapters", "peft"):
                shutil.rmtree(run_dir / folder / name)
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    out = run(
        command(
            run_dir,
            target,
            dense_jobs(demo_data),
            [f"hf_dir={hf_base}"],
            [f"checkpoint.resume={checkpoint}"],
        ),
        tmp_path / "resume.log",
    )

    assert f"resumed from {checkpoint} at step {step}" in out
    line = start_line(out)
    assert (line[1], line[2], line[4]) == (str(LAYOUTS[target]), str(LAYOUTS[target]), str(step))
    steps = logged_steps(out)  # only steps after the checkpoint ran, up to the end
    assert steps and min(steps) == step + 1 and max(steps) == TOTAL, steps
    assert ("step 4: job srt starts on slot 0" in out) == (step < STEPS["rev"])
    for name, n in STEPS.items():
        assert f"job {name}: done after {n} steps" in out

    got = losses_by_adapter(run_dir)  # records up to the checkpoint kept, later ones logged once
    for layout, (whole, _) in runs.items():
        assert_same_losses(
            losses_by_adapter(whole), got, f"{source} step {step} -> {target} vs {layout}"
        )
        assert_same_exports(whole, run_dir)


def test_moe_base_trains_the_same_at_pp2(demo_data, tmp_path):
    """A tiny MoE built from its config (its init does not depend on the layout), two layers
    split over two stages."""
    jobs = [
        job("rev", demo_data, "reverse", 3, dropout=0.0),
        job("add", demo_data, "add", 3, rank=4, alpha=8, dropout=0.0),
    ]
    losses = {}
    for layout in LAYOUTS:
        out = run(
            command(
                tmp_path / layout,
                layout,
                jobs,
                ["hf_dir=null", "model=tiny_moe"],
                ["checkpoint.save_interval=null"],
            ),
            tmp_path / f"{layout}.log",
        )
        assert start_line(out)[2] == str(LAYOUTS[layout])
        assert "rev: done after 3 steps" in out and "add: done after 3 steps" in out
        losses[layout] = losses_by_adapter(tmp_path / layout)
    for name in ("rev", "add"):
        assert len(losses["pp1"][name]) == len(losses["pp2"][name]) == 3
        worst = max(abs(g - w) / abs(w) for g, w in zip(losses["pp2"][name], losses["pp1"][name]))
        assert worst < LOSS_RTOL, f"MoE {name}: PP=2 losses differ by {worst:.2e} relative"
        assert_same_tensors(
            tmp_path / "pp1" / "adapters" / name / "adapter.safetensors",
            tmp_path / "pp2" / "adapters" / name / "adapter.safetensors",
        )
