"""Rows 13: the main job (``conf/smollm2.yaml``: 4 word jobs on SmolLM2-135M-Instruct, as
``bash scripts/demo.sh`` trains them) against the machine's compute limit and against what a
user would run instead, on the same cores:

* ours: ``mmlora train --nproc 2 --config-name smollm2`` (2 processes x 1 thread);
* peft-par: 2 independent transformers + peft processes at once (1 thread each), the jobs
  split by work (examples x steps) as evenly as whole jobs allow;
* peft-seq-1t: one transformers + peft process, the jobs one after another, 1 thread;
* peft-par-bf16: peft-par under ``torch.autocast("cpu", torch.bfloat16)``, run where ours
  multiplies its frozen base in bf16 (``trainer.cpu_base_gemms=auto`` on a CPU with AMX or
  AVX-512 BF16), so that ours also meets peft at the same precision.

The compute limit: the frozen base's forward and input-gradient backward, 4 FLOPs per matmul
parameter (the decoder's and the output layer's) per trained position, at the fp32 GEMM rate
the cores give when they all multiply at once (one 1-thread GEMM process per core, measured
here, side by side with one process alone); where ours multiplies in bf16, at the bf16 rate
too. Needs the main job's model and data (``bash scripts/demo.sh`` writes them once).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.children import child_env
from benchmarks.peers.launch import run_ours, run_peft
from benchmarks.peers.spec import job_spec
from benchmarks.report import Results, Row
from benchmarks.settings import REPO, Settings
from benchmarks.timing import Clock

HF_DIR, DATA_DIR = REPO / "data" / "smollm2-135m-instruct", REPO / "data" / "demo-words"
WAYS = ("ours", "peft-par", "peft-seq-1t")
BF16_WAY = "peft-par-bf16"
GEMM_SHAPES = ((1024, 1024, 1024), (512, 576, 1536))


def gemm_rate(seconds: float = 3.0, dtype: str = "float32") -> float:
    """Median GFLOP/s of 1-thread GEMMs in ``dtype`` of :data:`GEMM_SHAPES` for about
    ``seconds``: the faster of ``a @ b`` (MKL for fp32, oneDNN for bf16) and oneDNN's on a
    packed ``b`` (what our frozen linears run, ops/packed_linear.py), so the limit is the
    best GEMM this machine offers."""
    torch.set_num_threads(1)
    kind = getattr(torch, dtype)
    ways = {"mkl": lambda a, b, packed: a @ b}
    if torch.backends.mkldnn.is_available():
        ways["onednn"] = lambda a, b, packed: torch.ops.mkldnn._linear_pointwise(
            a, packed, None, "none", [], ""
        )
    rates: dict[str, list[float]] = {way: [] for way in ways}
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for m, k, n in GEMM_SHAPES:
            a, b = torch.randn(m, k, dtype=kind), torch.randn(k, n, dtype=kind)
            packed = (
                torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous())
                if "onednn" in ways
                else None
            )
            for way, run in ways.items():
                run(a, b, packed)
                start = time.perf_counter()
                run(a, b, packed)
                rates[way].append(2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return max(statistics.median(r) for r in rates.values())


def gemm_rates(processes: int, dtype: str = "float32") -> list[float]:
    """:func:`gemm_rate` in ``processes`` fresh processes at once."""
    code = f"from benchmarks.mainjob import gemm_rate; print(gemm_rate(dtype={dtype!r}))"
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
        )
        for _ in range(processes)
    ]
    return [float(p.communicate()[0].split()[-1]) for p in procs]


def matmul_parameters(hf_dir: Path) -> int:
    """The base's matmul weights: every decoder layer's attention and MLP, and the output
    layer (tied or not, it multiplies every position)."""
    c = json.loads((hf_dir / "config.json").read_text())
    h, ffn = c["hidden_size"], c["intermediate_size"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * (h // c["num_attention_heads"])
    return c["num_hidden_layers"] * (h * (h + 2 * kv) + h * h + 3 * h * ffn) + c["vocab_size"] * h


def split_by_work(jobs: list[dict], parts: int) -> list[list[int]]:
    """Job indices in ``parts`` groups of whole jobs, the largest first to the least loaded."""
    work = [job["global_batch_size"] * job["max_steps"] for job in jobs]
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(jobs)), key=lambda i: -work[i]):
        k = load.index(min(load))
        groups[k].append(i)
        load[k] += work[i]
    return [g for g in groups if g]


def run_main_job(rounds: int, say) -> dict:
    """Every way once per round, in turn, and the GEMM rates between rounds (bf16 ones too,
    and the bf16 peft way, where ours multiplies in bf16)."""
    spec = job_spec(DATA_DIR, None, "smollm2", [f"hf_dir={HF_DIR}"])
    groups = split_by_work(spec["jobs"], 2)
    results: dict[str, list[dict]] = {w: [] for w in WAYS}
    gemm: dict[str, list] = {"alone": [], "together": []}
    with tempfile.TemporaryDirectory(prefix="bench-mainjob-") as tmp_name:
        tmp = Path(tmp_name)
        for r in range(rounds):
            for way in WAYS + (BF16_WAY,):
                if way == "ours":
                    got = run_ours(spec, DATA_DIR, tmp / f"ours-{r}", 2)
                elif way == BF16_WAY:
                    if "bf16" not in results["ours"][-1]["precision"]:
                        continue
                    got = run_peft({**spec, "autocast": "bf16"}, groups, 1, tmp)
                else:
                    got = run_peft(
                        spec,
                        groups if way == "peft-par" else [list(range(len(spec["jobs"])))],
                        1,
                        tmp,
                    )
                results.setdefault(way, []).append(got)
                say(
                    f"main job round {r + 1}/{rounds}: {way}: training {got['train_s']:.1f} s, "
                    f"launch {got['launch_s']:.1f} s, CPU {got['cpu_s']:.1f} s; held-out loss "
                    + ", ".join(f"{k} {v:.3f}" for k, v in got["eval_loss"].items())
                )
            for dtype in ("float32", "bfloat16") if BF16_WAY in results else ("float32",):
                key = "" if dtype == "float32" else "_bf16"
                gemm.setdefault(f"alone{key}", []).extend(gemm_rates(1, dtype))
                gemm.setdefault(f"together{key}", []).append(gemm_rates(2, dtype))
                say(
                    f"main job round {r + 1}/{rounds}: 1-thread {dtype} GEMM "
                    f"{gemm[f'alone{key}'][-1]:.1f} GFLOP/s alone, "
                    f"{' + '.join(f'{g:.1f}' for g in gemm[f'together{key}'][-1])} GFLOP/s at once"
                )
    return {
        "spec": {k: v for k, v in spec.items() if k not in ("hf_dir", "overrides")},
        "groups": [[spec["jobs"][i]["name"] for i in g] for g in groups],
        "results": results,
        "gemm": gemm,
        "matmul_parameters": matmul_parameters(HF_DIR),
    }


def main_job_rows(m: dict) -> list[Row]:
    res = m["results"]
    med = {
        w: {k: statistics.median(r[k] for r in rs) for k in ("train_s", "launch_s", "cpu_s")}
        for w, rs in res.items()
    }
    ours = res["ours"]
    phases = {
        k: statistics.median(r[k] for r in ours)
        for k in ("first_step_at_s", "last_step_at_s", "table_at_s", "launch_s")
    }
    positions = res["peft-par"][0]["positions"]
    flops = 4 * m["matmul_parameters"] * positions
    together = statistics.median(sum(g) for g in m["gemm"]["together"])
    alone = statistics.median(m["gemm"]["alone"])
    limit_s = flops / (together * 1e9)
    names = [j["name"] for j in m["spec"]["jobs"]]
    loss = {
        w: {n: statistics.median(r["eval_loss"][n] for r in rs) for n in names}
        for w, rs in res.items()
    }
    setting = (
        "the main job (conf/smollm2.yaml: "
        + ", ".join(
            f"{j['name']} {j['max_steps']} steps of {j['global_batch_size']}"
            for j in m["spec"]["jobs"]
        )
        + f"; {positions:,} trained positions); ours "
        f"{ours[0]['precision']}, peft fp32"
    )
    peft_par = (
        "2 independent transformers + peft processes at once, 1 thread each, jobs "
        f"split by work ({' | '.join(', '.join(g) for g in m['groups'])})"
    )
    rows = []
    train = Row(
        "13a",
        "main job: training wall, ours vs 2 independent peft processes",
        f"{setting}: mmlora train --nproc 2 (2 x 1 thread) vs {peft_par}; training wall as rows 10",
        "ours",
        "peft-par",
        "s",
    ).fill(med["ours"]["train_s"], med["peft-par"]["train_s"])
    train.note = (
        "Held-out loss per job (ours / peft-par / peft-seq-1t): "
        + ", ".join(
            f"{n} {loss['ours'][n]:.3f} / {loss['peft-par'][n]:.3f} / {loss['peft-seq-1t'][n]:.3f}"
            for n in names
        )
        + f". peft one after another, 1 thread: "
        f"{med['peft-seq-1t']['train_s']:.1f} s."
    )
    if BF16_WAY in res:
        train.note += (
            " peft-par under bf16 autocast: "
            + ", ".join(f"{n} {loss[BF16_WAY][n]:.3f}" for n in names)
            + "."
        )
    rows.append(train)
    limit = Row(
        "13b",
        "main job: training wall, ours vs the machine's compute limit",
        (
            f"as row 13a; the limit: 4 x {m['matmul_parameters'] / 1e6:.1f} M matmul parameters x "
            f"{positions:,} positions = {flops / 1e12:.2f} TFLOP at {together:.0f} GFLOP/s (two "
            f"1-thread fp32 GEMM processes at once, {GEMM_SHAPES}, MKL or packed oneDNN, the faster; one alone: {alone:.0f} GFLOP/s, "
            f"so {flops / (2 * alone * 1e9):.1f} s if the cores did not slow each other)"
        ),
        "ours",
        "limit",
        "s",
    ).fill(med["ours"]["train_s"], limit_s)
    rows.append(limit)
    if BF16_WAY in res:
        rows.append(
            Row(
                "13e",
                "main job: training wall, ours vs 2 independent peft processes under bf16 autocast",
                "as row 13a, peft under torch.autocast('cpu', "
                "torch.bfloat16) (ours multiplies its frozen base in bf16 here)",
                "ours",
                BF16_WAY,
                "s",
            ).fill(med["ours"]["train_s"], med[BF16_WAY]["train_s"])
        )
        together16 = statistics.median(sum(g) for g in m["gemm"]["together_bf16"])
        rows.append(
            Row(
                "13f",
                "main job: training wall, ours vs the machine's bf16 compute limit",
                f"as row 13b at {together16:.0f} GFLOP/s (two 1-thread bf16 GEMM "
                f"processes at once; one alone: "
                f"{statistics.median(m['gemm']['alone_bf16']):.0f} GFLOP/s)",
                "ours",
                "limit",
                "s",
            ).fill(med["ours"]["train_s"], flops / (together16 * 1e9))
        )
    whole = Row(
        "13c",
        "main job: whole command, ours vs 2 independent peft processes",
        "as row 13a: launch to exit (ours: set-up, training, final checkpoint, "
        "exports, the adapter x task tables; peft: imports, loading, training, its "
        "held-out losses)",
        "ours",
        "peft-par",
        "s",
    ).fill(med["ours"]["launch_s"], med["peft-par"]["launch_s"])
    whole.note = (
        f"Ours: first step {phases['first_step_at_s']:.1f} s after the launch, last "
        f"step ended at {phases['last_step_at_s']:.1f} s, the tables printed at "
        f"{phases['table_at_s']:.1f} s (final checkpoint, exports, 5 adapter rows x "
        f"{len(names)} tasks of held-out loss and greedy generations), exit at "
        f"{phases['launch_s']:.1f} s."
    )
    rows.append(whole)
    cpu = Row(
        "13d",
        "main job: CPU seconds of the whole command, ours vs peft one after another (1 thread)",
        "as row 13c: user + system seconds of every process",
        "ours",
        "peft-seq-1t",
        "s",
    ).fill(med["ours"]["cpu_s"], med["peft-seq-1t"]["cpu_s"])
    rows.append(cpu)
    return rows


def section_mainjob(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    if not (HF_DIR / "config.json").is_file() or not DATA_DIR.is_dir():
        out.rows.append(
            Row(
                "13a",
                "main job",
                "",
                "",
                "",
                "s",
                skipped=(
                    f"skipped: {HF_DIR} or {DATA_DIR} is missing; bash scripts/demo.sh writes them"
                ),
            )
        )
        return
    out.mainjob = run_main_job(s.peer_rounds, clock.say)
    out.rows += main_job_rows(out.mainjob)
