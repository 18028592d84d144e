"""The lent GPU machine as scripts/gpu_check.sh and scripts/gpu_wheels.sh see it.

    python scripts/gpu_machine.py check-wheels [DIR]   # here: is DIR (.whl) complete for it?
    python scripts/gpu_machine.py pins                 # the wheels DIR must hold (name==version)
    python scripts/gpu_machine.py env                  # there: GPU, driver, versions
    python scripts/gpu_machine.py pytest-result LOG RC # there: the report's line for pytest

The machine (the device tool's ``nvidia-h200``): one H200, Python 3.12 with torch
2.11.0+cu130, transformers 5.17 and peft installed, no package registry, and the working tree
without ``.venv``. What the project imports beyond that image travels as wheels in ``.whl/``
(scripts/gpu_wheels.sh builds them here), installed there with ``pip --no-index --no-deps
--target``. ``check-wheels`` proves the folder complete without that machine: every wheel
installs on CPython 3.12 / manylinux x86_64, one version each, every requirement of every
wheel is met by another wheel or by the image, and every third-party module the repository
imports comes from one of the two.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
PYTHON = "3.12"
# The wheels .whl/ must hold (what scripts/gpu_wheels.sh fetches): the versions the CPU
# suite runs; hydra-core 1.3.8 takes omegaconf < 2.4 and antlr4 4.9.*.
CARRIED = {
    "megatron-core": "0.16.1",
    "hydra-core": "1.3.8",
    "omegaconf": "2.3.1",
    "antlr4-python3-runtime": "4.9.3",
}
# The image's packages (the device tool's KINDS.md, read 2026-11-17), with the versions
# known from a session's pip list there; None: installed, version not read.
IMAGE = dict.fromkeys(
    """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
)
IMAGE.update(
    {
        "torch": "2.11.0",
        "transformers": "5.17.0",
        "numpy": "2.5.2",
        "safetensors": "0.8.0",
        "tokenizers": "0.23.2",
        "huggingface-hub": "1.33.0",
        "accelerate": "1.15.0",
        "triton": "3.6.0",
        "sentencepiece": "0.2.2",
    }
)
# Import names that differ from their distribution's name.
IMPORT_OF = {
    "pyyaml": "yaml",
    "pillow": "PIL",
    "scikit-learn": "sklearn",
    "python-dateutil": "dateutil",
    "protobuf": "google",
    "megatron-core": "megatron",
    "hydra-core": "hydra",
    "antlr4-python3-runtime": "antlr4",
    "opencv-python-headless": "cv2",
    "huggingface-hub": "huggingface_hub",
}
# Imported by the repository but not by anything gpu_check.sh runs there.
NOT_NEEDED = {
    "wandb": "imported only when logging.wandb_mode is not 'disabled' (gpu_check.sh disables it)",
    "datasets": "imported only for Parquet, JSON and save_to_disk datasets (gpu_check.sh "
    "reads JSONL)",
    "trl": "imported only by the CPU tests that compare with TRL",
}
PLATFORMS = re.compile(r"any|manylinux(1|2010|2014|_2_(\d+))_x86_64")
MAX_GLIBC = 28  # what every carried wheel needs at most (the image is newer)


def _marker_env() -> dict[str, str]:
    env = default_environment()
    env.update(
        python_version=PYTHON,
        python_full_version=f"{PYTHON}.3",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    return env


def _wheel_problems(path: Path) -> list[str]:
    """Why ``path`` would not install on the machine's CPython 3.12 / Linux x86_64."""
    _, _, _, tags = parse_wheel_filename(path.name)
    for tag in tags:
        platform = PLATFORMS.fullmatch(tag.platform)
        glibc_ok = platform and (platform.group(2) is None or int(platform.group(2)) <= MAX_GLIBC)
        if (
            tag.interpreter in ("py3", "cp312")
            and tag.abi in ("none", "abi3", "cp312")
            and glibc_ok
        ):
            return []
    return [f"{path.name}: no tag for CPython {PYTHON} on manylinux (<= 2_{MAX_GLIBC}) x86_64"]


def _metadata(path: Path) -> tuple[list[str], set[str]]:
    """A wheel's Requires-Dist lines and the top-level modules it installs."""
    with zipfile.ZipFile(path) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(z.read(meta_name).decode()).get_all("Requires-Dist") or []
        tops = {
            n.split("/")[0].removesuffix(".py")
            for n in z.namelist()
            if not n.split("/")[0].endswith((".dist-info", ".data"))
        }
    return requires, tops


# The training service (the optional `api` extra), its tests and benchmark: not installed
# or run on the GPU machine.
NOT_ON_THE_MACHINE = (
    "megatron_multilora/api/",
    "tests/recipe/test_api_service.py",
    "tests/recipe/test_api_cookbook.py",
    "tests/recipe/test_api_rl_loop.py",
    "tests/recipe/test_api_model_families.py",
    "tests/recipe/test_api_paging.py",
    "tests/recipe/run_rl_loop.py",
    "benchmarks/api_service.py",
    "benchmarks/api_paging.py",
    "benchmarks/rl_tenants.py",
    "benchmarks/soak.py",
)


def repo_imports() -> dict[str, str]:
    """Third-party top-level modules the repository imports (but NOT_ON_THE_MACHINE) -> one
    file importing each."""
    local = {p.stem for p in (REPO / "scripts").glob("*.py")} | {
        p.name for p in REPO.iterdir() if p.is_dir()
    }
    found: dict[str, str] = {}
    for folder in ("megatron_multilora", "benchmarks", "recipes", "scripts", "tests"):
        for f in sorted((REPO / folder).rglob("*.py")):
            if str(f.relative_to(REPO)).startswith(NOT_ON_THE_MACHINE):
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in local:
                        found.setdefault(top, str(f.relative_to(REPO)))
    return found


def check_wheels(folder: Path, carried: dict[str, str] = CARRIED) -> list[str]:
    """Everything that keeps ``folder`` from being complete for the machine (empty: none)."""
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        return [f"{folder}: no wheels (build them with: bash scripts/gpu_wheels.sh)"]
    problems: list[str] = []
    have: dict[str, Version] = {}
    tops: set[str] = set()
    requires: dict[str, list[str]] = {}
    for path in wheels:
        problems += _wheel_problems(path)
        name, version, _, _ = parse_wheel_filename(path.name)
        if name in have:
            problems.append(f"{name}: two versions ({have[name]}, {version}); keep one")
        have[name] = version
        requires[path.name], installs = _metadata(path)
        tops |= installs
    for name, version in carried.items():
        got = have.get(canonicalize_name(name))
        if got is None:
            problems.append(f"{name}=={version}: missing")
        elif got != Version(version):
            problems.append(f"{name}: {got} in {folder}, {version} expected")
    env = _marker_env()
    for wheel, lines in requires.items():
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            name = canonicalize_name(req.name)
            version = have.get(name) or (Version(IMAGE[name]) if IMAGE.get(name) else None)
            if name not in have and name not in IMAGE:
                problems.append(f"{wheel} needs {req}: neither in {folder} nor in the image")
            elif version is not None and not req.specifier.contains(version, prereleases=True):
                problems.append(f"{wheel} needs {req}, but {version} is what the machine gets")
    provided = tops | {IMPORT_OF.get(name, name.replace("-", "_")) for name in IMAGE}
    for module, where in repo_imports().items():
        if module not in provided and module not in NOT_NEEDED:
            problems.append(f"{where} imports {module}: neither in {folder} nor in the image")
    return problems


def print_env() -> None:
    """What the report's environment section says (run on the GPU machine)."""
    import platform
    import subprocess
    from importlib import metadata

    import torch

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    print(f"python {platform.python_version()} ({sys.executable})")
    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
        f"{torch.backends.cudnn.version()}, NCCL "
        f"{'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}"
    )
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        print(
            f"GPU {i}: {props.name}, capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
        )
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch")
    print(f"torch._grouped_mm: {'present' if hasattr(torch, '_grouped_mm') else 'absent'}")
    for dist in (
        "megatron-core",
        "transformer-engine",
        "transformers",
        "peft",
        "hydra-core",
        "omegaconf",
        "safetensors",
        "pytest",
    ):
        print(f"{dist} {version(dist)}")
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        print(f"nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}")
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"nvidia-smi: {e}")


# Skips that the machine cannot avoid (named in the report, not counted against it).
EXPECTED_SKIPS = re.compile(r"transformer_engine")


def pytest_result(log: Path, returncode: int) -> str:
    """The report's line for a pytest run: ``pass``, ``INCOMPLETE`` (a test skipped for a
    reason the machine should not have, e.g. an old GPU) or ``FAIL``, then the counts and
    each skip's reason."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    summary = next(
        (
            line.strip("= ")
            for line in reversed(text.splitlines())
            if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", line)
        ),
        "no pytest summary (see the log)",
    )
    skips: dict[str, int] = {}  # reason -> tests skipped for it
    for count, reason in re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: ([^\n]+)", text, re.M):
        skips[reason] = skips.get(reason, 0) + int(count)
    unexpected = {r: n for r, n in skips.items() if not EXPECTED_SKIPS.search(r)}
    status = (
        "FAIL"
        if returncode != 0 or "passed" not in summary
        else "INCOMPLETE"
        if unexpected
        else "pass"
    )
    return f"{status}: {summary}" + "".join(
        f"; {n} skipped{'' if r in unexpected else ' as expected'}: {r}" for r, n in skips.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check-wheels", help="is the wheels folder complete for the machine?")
    check.add_argument("folder", nargs="?", type=Path, default=REPO / ".whl")
    sub.add_parser("pins", help="the wheels the folder must hold, as name==version")
    sub.add_parser("env", help="GPU, driver and versions (on the GPU machine)")
    result = sub.add_parser("pytest-result", help="the report's line for a pytest run")
    result.add_argument("log", type=Path)
    result.add_argument("returncode", type=int)
    args = parser.parse_args()
    if args.command == "pins":
        print(" ".join(f"{name}=={version}" for name, version in CARRIED.items()))
    elif args.command == "env":
        print_env()
    elif args.command == "pytest-result":
        print(pytest_result(args.log, args.returncode))
    else:
        problems = check_wheels(args.folder)
        wheels = sorted(args.folder.glob("*.whl")) if args.folder.is_dir() else []
        size = sum(p.stat().st_size for p in wheels)
        for path in wheels:
            print(f"  {path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
        print(
            f"{args.folder}: {len(wheels)} wheels, {size / 2**20:.1f} MiB; "
            + (
                "complete for CPython 3.12 on the GPU machine"
                if not problems
                else f"INCOMPLETE ({len(problems)} problems):"
            )
        )
        for problem in problems:
            print(f"  - {problem}")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
