"""scripts/gpu_check.sh and its helpers, as far as a machine without a GPU can check them: the
scripts parse, the wheels folder check finds what the GPU machine would lack, the dry run
prints every stage, the report's lines say what ran (a skip is no pass), and a rehearsal of
two stages here writes its report and logs under $OUT only."""

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
ALL_STAGES = (
    "install",
    "env",
    "tests",
    "recipe-dense",
    "recipe-graphs",
    "bench-graphs",
    "recipe-moe",
    "bench",
)
spec = importlib.util.spec_from_file_location("gpu_machine", REPO / "scripts" / "gpu_machine.py")
gpu_machine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_machine)

# The carried wheels as published (requirements from their METADATA), with their modules.
REAL = {
    "megatron-core": (
        "0.16.1",
        "cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64",
        ["torch>=2.6.0", "numpy", "packaging>=24.2", 'wandb; extra == "mlm"'],
        ["megatron"],
    ),
    "hydra-core": (
        "1.3.8",
        "py3-none-any",
        [
            "omegaconf<2.4,>=2.2",
            "antlr4-python3-runtime==4.9.*",
            'importlib-resources; python_version < "3.9"',
            "packaging",
        ],
        ["hydra"],
    ),
    "omegaconf": (
        "2.3.1",
        "py3-none-any",
        ["antlr4-python3-runtime==4.9.*", "PyYAML>=5.1.0"],
        ["omegaconf"],
    ),
    "antlr4-python3-runtime": ("4.9.3", "py3-none-any", [], ["antlr4"]),
}


def fake_wheel(
    folder: Path, name: str, version: str, tag: str, requires: list[str], modules: list[str]
) -> Path:
    stem = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{stem}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"{stem}.dist-info/METADATA",
            "Metadata-Version: 2.1\n"
            f"Name: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        )
        for module in modules:
            z.writestr(f"{module}/__init__.py", "")
    return path


def replace_wheel(folder: Path, name: str, version: str, tag: str, modules: list[str]) -> None:
    for old in folder.glob(f"{name.replace('-', '_')}-*.whl"):
        old.unlink()
    fake_wheel(folder, name, version, tag, [], modules)


@pytest.fixture
def wheels(tmp_path) -> Path:
    folder = tmp_path / "whl"
    folder.mkdir()
    for name, (version, tag, requires, modules) in REAL.items():
        fake_wheel(folder, name, version, tag, requires, modules)
    return folder


def test_scripts_parse():
    for script in ("gpu_check.sh", "gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


def test_a_complete_folder_passes(wheels):
    assert gpu_machine.check_wheels(wheels) == []


@pytest.mark.parametrize(
    "break_it,expected",
    [
        (
            lambda f: (f / "omegaconf-2.3.1-py3-none-any.whl").unlink(),
            [
                "omegaconf==2.3.1: missing",
                "needs omegaconf<2.4,>=2.2: neither in",
                "imports omegaconf: neither in",
            ],
        ),
        (
            lambda f: fake_wheel(f, "omegaconf", "2.4.0", "py3-none-any", [], ["omegaconf"]),
            ["omegaconf: two versions"],
        ),
        (
            lambda f: replace_wheel(
                f, "megatron-core", "0.16.1", "cp311-cp311-manylinux_2_28_x86_64", ["megatron"]
            ),
            ["no tag for CPython 3.12"],
        ),
        (
            lambda f: fake_wheel(f, "tiny", "1.0", "py3-none-manylinux_2_34_x86_64", [], ["tiny"]),
            ["tiny-1.0-py3-none-manylinux_2_34_x86_64.whl: no tag"],
        ),
        (
            lambda f: fake_wheel(f, "needy", "1.0", "py3-none-any", ["torch>=2.12"], ["needy"]),
            ["needs torch>=2.12, but 2.11.0 is what the machine gets"],
        ),
        (
            lambda f: fake_wheel(f, "needy", "1.0", "py3-none-any", ["wandb>=0.17"], ["needy"]),
            ["needs wandb>=0.17: neither in"],
        ),
    ],
    ids=["missing", "two-versions", "cp311", "new-glibc", "torch-too-old", "not-in-image"],
)
def test_an_incomplete_folder_is_explained(wheels, break_it, expected):
    break_it(wheels)
    problems = "\n".join(gpu_machine.check_wheels(wheels))
    for text in expected:
        assert text in problems, problems


def test_every_third_party_import_of_the_repository_is_accounted_for():
    imports = gpu_machine.repo_imports()
    assert {"torch", "megatron", "hydra", "omegaconf", "safetensors"} <= set(imports)
    assert "wandb" in imports and "wandb" in gpu_machine.NOT_NEEDED
    assert "megatron_multilora" not in imports and "os" not in imports


def run(args, tmp_path, **env):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TMPDIR": str(tmp_path), **env},
    )


def test_dry_run_prints_every_stage_and_checks_the_wheels(wheels, tmp_path):
    done = run(["--dry-run"], tmp_path, GPU_WHEELS=str(wheels))
    assert done.returncode == 0, done.stdout + done.stderr
    for stage in ALL_STAGES:
        assert f"[{stage}, limit" in done.stdout
    assert "--no-index --no-deps" in done.stdout and "--device cuda" in done.stdout
    assert "4 wheels" in done.stdout and "complete for CPython 3.12" in done.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run(["--dry-run"], tmp_path, GPU_WHEELS=str(empty))
    assert done.returncode == 1 and "no wheels" in done.stdout
    assert run(["--bogus"], tmp_path).returncode == 2
    assert run([], tmp_path, GPU_CHECK_STAGES="tests nonsense").returncode == 2


@pytest.mark.parametrize(
    "log,rc,status",
    [
        (
            "SKIPPED [2] tests/gpu/a.py:9: needs transformer_engine\n5 passed, 2 skipped in 3.1s\n",
            0,
            "pass: 5 passed, 2 skipped in 3.1s; 2 skipped as expected: needs transformer_engine",
        ),
        (
            "SKIPPED [1] tests/gpu/a.py:9: needs Hopper or newer\n4 passed, 1 skipped in 3.1s\n",
            0,
            "INCOMPLETE: 4 passed, 1 skipped in 3.1s; 1 skipped: needs Hopper or newer",
        ),
        (
            "FAILED tests/gpu/a.py::t - AssertionError\n1 failed, 4 passed in 3.1s\n",
            1,
            "FAIL: 1 failed, 4 passed in 3.1s",
        ),
        (
            "SKIPPED [3] tests/gpu/a.py:9: needs a CUDA GPU\n3 skipped in 0.1s\n",
            0,
            "FAIL: 3 skipped in 0.1s; 3 skipped: needs a CUDA GPU",
        ),
    ],
    ids=["pass", "unexpected-skip", "failure", "nothing-ran"],
)
def test_the_report_line_of_the_tests_says_what_ran(tmp_path, log, rc, status):
    path = tmp_path / "tests.log"
    path.write_text(log)
    assert gpu_machine.pytest_result(path, rc) == status


def test_a_rehearsal_writes_its_report_and_logs_under_out(tmp_path):
    out = tmp_path / "out"
    done = run([], tmp_path, OUT=str(out), PYTHON=sys.executable, GPU_CHECK_STAGES="env tests")
    report = (out / "gpu_check.md").read_text()
    assert done.returncode == 1, report  # no GPU here: the tests stage cannot pass
    assert "| env | pass: python" in report
    assert "| tests | FAIL: " in report and "skipped: needs a CUDA GPU" in report
    assert "Not checked here (one GPU): NCCL between ranks" in report
    assert sorted(p.name for p in out.iterdir()) == ["env.txt", "gpu_check.md", "tests.log"]


def test_the_pinned_wheels_build_complete(tmp_path):
    """scripts/gpu_wheels.sh against PyPI: the real pins download (or build) and pass the
    check; a failed build would leave no folder behind."""
    dest = tmp_path / "whl"
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_wheels.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "GPU_WHEELS": str(dest), "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name.split("-")[0] for p in dest.glob("*.whl")) == [
        "antlr4_python3_runtime",
        "hydra_core",
        "megatron_core",
        "omegaconf",
    ]
    assert gpu_machine.check_wheels(dest) == []
