"""The report: rows (A vs B, both medians and their ratio), hardware, versions, markdown."""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess

import torch

import megatron_multilora as mm
from benchmarks.settings import REPO

MiB = 2.0**20


@dataclasses.dataclass
class Row:
    """One comparison: A vs B with both medians and their ratio, or why it was skipped."""

    id: str
    title: str
    what: str
    a: str
    b: str
    unit: str  # "ms", "s", "MiB", or a count ("aten ops", "host reads")
    a_value: float | None = None
    b_value: float | None = None
    ratio: float | None = None
    skipped: str | None = None
    note: str = ""

    def fill(self, a_value: float, b_value: float) -> Row:
        self.a_value, self.b_value = a_value, b_value
        self.ratio = a_value / b_value if b_value > 0 else None
        return self


@dataclasses.dataclass
class Results:
    """What the sections measured so far (the report is rewritten from it after each one)."""

    rows: list[Row] = dataclasses.field(default_factory=list)
    samples: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)
    probes: dict[str, list[dict]] = dataclasses.field(default_factory=dict)
    peers: dict | None = None
    mainjob: dict | None = None
    soak: dict | None = None  # per base: RSS and the service's kept structures over time
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # section -> error


def hardware(device: torch.device) -> dict:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu
            )
    except OSError:
        pass
    # The vector units decide the GEMM rates (and whether the main job multiplies in bf16):
    # "AMD EPYC" alone names both a Zen 2 without AVX-512 and a Zen 4 with AVX-512 BF16.
    units = [torch.backends.cpu.get_cpu_capability()] + [
        name
        for name, has in (
            ("AVX-512 BF16", torch.cpu._is_avx512_bf16_supported()),
            ("AMX", torch.cpu._is_amx_tile_supported()),
        )
        if has
    ]
    info = {
        "cpu": cpu,
        "cpu_units": ", ".join(units),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), gpu_count=torch.cuda.device_count())
    return info


def versions() -> dict:
    from importlib import metadata

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "megatron-core": metadata.version("megatron-core"),
    }
    try:
        out["transformer-engine"] = metadata.version("transformer-engine")
    except metadata.PackageNotFoundError:
        pass
    try:  # a machine without git (or a copy without .git) reports no commit
        git = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        status = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        )
    except OSError:
        return out
    if git.returncode == 0:
        dirty = " + uncommitted changes" if status.stdout.strip() else ""
        out["git"] = git.stdout.strip() + dirty
    return out


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value:.3f} s"
    return f"{value:.2f} {unit}" if unit in ("ms", "MiB") else f"{value:,.0f} {unit}"


def markdown(meta: dict, rows: list[Row]) -> str:
    hw, ver, s = meta["hardware"], meta["versions"], meta["settings"]
    defaults = dataclasses.asdict(mm.GPTModelConfig())
    device = hw.get("gpu", hw["cpu"])
    lines = [
        f"# multi-LoRA benchmark ({meta['device']})",
        "",
        f"- hardware: {device}"
        + (
            f" (host CPU {hw['cpu']}, {hw['cpu_units']})"
            if "gpu" in hw
            else f" ({hw['cpu_units']})"
        )
        + f"; {hw['cpu_cores']} CPU cores; torch threads: {hw['torch_threads']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()),
        f"- dtype {s['dtype']}; load average (1, 5, 15 min) at start {meta['load_start']}, at end "
        f"{meta['load_end']}; total run time {meta['runtime_s']:.0f} s",
        "- sections: "
        + ", ".join(
            f"{name} ({'FAILED' if name in meta['failed'] else 'done'})"
            for name in meta["sections_done"]
        )
        + "".join(
            f", {name} (not run yet)" for name in meta["sections"][len(meta["sections_done"]) :]
        ),
        "- settings: " + ", ".join(f"{k}={v}" for k, v in s.items()),
        *(
            f"- whole model {kind}: GPTModelConfig("
            + ", ".join(f"{k}={v}" for k, v in cfg.items() if defaults.get(k) != v)
            + "), other fields at their defaults (full configs in the JSON)"
            for kind, cfg in meta["models"].items()
        ),
        "- method: every time is the median over the rounds; each round runs every variant of "
        "its group once, in turn, in one process, so machine noise hits all alike. A / B is the "
        "ratio of the medians.",
        "",
        "| row | comparison | A | B | median A | median B | A / B |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else (r.skipped or "-")
        lines.append(
            f"| {r.id} | {r.title} | {r.a} | {r.b} | {fmt(r.a_value, r.unit)} | "
            f"{fmt(r.b_value, r.unit)} | {ratio} |"
        )
    lines += ["", "What each row measures:", ""]
    lines += [f"- **{r.id}**: {r.what}." + (f" {r.note}" if r.note else "") for r in rows]
    return "\n".join(lines) + "\n"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
