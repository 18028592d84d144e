"""Rows 10 of scripts/bench.py: our recipe vs what a user would run instead to train the same
adapter jobs: transformers + peft, one process training the adapters one after another (1 or 2
threads), or independent peft processes at once over the same cores.

Every way trains conf/jobs/demo4.yaml's jobs (rank, alpha, dropout, lr, warmup, schedule,
global batch, grad clip, weight decay) for the same number of steps on the same data, written
by scripts/make_demo_data.py (the tiny random HF Llama and the letter tasks):

* ours: ``torchrun --standalone --nproc-per-node 2 recipes/multi_lora_finetune.py`` with
  OMP_NUM_THREADS=1, as a user launches it (scripts/demo.sh --tiny), with evaluation during
  training and intermediate checkpoints off (``trainer.eval_interval=0
  checkpoint.save_interval=0``), a metrics record every step (``trainer.log_interval=1``);
* peft: ``python scripts/bench_peers.py --peft-worker ...`` (this file, run as a script: it
  imports neither megatron nor scripts/bench.py), a plain loop over ``AutoModelForCausalLM`` +
  ``peft.get_peft_model`` with LoRA on the HF modules our targets map to (q/k/v/o, gate/up/
  down), torch AdamW and our LR schedule (``slot_optimizer.lr_factor``), the same token ids and
  loss masks (``datasets.load_dataset`` with the HF tokenizer, as the recipe's), the same sample
  order (``JobQueue.next_samples`` with the run's seed), labels -100 outside the completion, so
  the loss is the mean over the job's loss tokens in its global batch, like ours.

Held-out loss: the mean over the loss tokens of the first ``trainer.eval_samples`` records of
each job's eval file (ours: its end-of-run adapter x task table; peft: the same examples
through the PEFT model).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
WAYS = ("ours", "peft-seq-1t", "peft-seq-2t", "peft-par")
WAY_TEXT = {
    "ours": "ours: every job in its own slot of one model, trained together, 2 processes x 1 "
            "thread (torchrun, data parallel)",
    "peft-seq-1t": "transformers + peft in one process, the adapters one after another, 1 thread",
    "peft-seq-2t": "transformers + peft in one process, the adapters one after another, 2 threads",
    "peft-par": "2 independent transformers + peft processes at once (1 thread each, 2 adapters "
                "each, one after another)",
}


# ----- the job spec both sides share ------------------------------------------------------

def job_spec(data_dir: Path, steps: int) -> dict:
    """The demo4 jobs, the run-wide settings that shape training and evaluation, and the HF
    module names of our LoRA targets (read from conf/, as the recipe composes them)."""
    import dataclasses

    from omegaconf import OmegaConf

    from megatron_multilora.checkpoint.peft_format import _hf_parts
    from megatron_multilora.training.config import AdapterJob

    conf = REPO / "conf"
    top = OmegaConf.load(conf / "config.yaml")
    jobs_cfg = OmegaConf.merge(OmegaConf.load(conf / "jobs" / "demo4.yaml"),
                               {"data_dir": str(data_dir)})
    jobs = [dataclasses.asdict(AdapterJob(**a)) for a in
            OmegaConf.to_container(jobs_cfg, resolve=True)["adapters"]]
    lora = OmegaConf.load(conf / "lora" / "default.yaml")
    trainer = OmegaConf.load(conf / "trainer" / "default.yaml")
    targets = []
    for target in lora.targets:
        rest = {"linear_qkv": "self_attention.", "linear_proj": "self_attention."}.get(
            target, "mlp.") + target
        targets += [part.rsplit(".", 1)[1] for part in _hf_parts(rest, "llama")]
    return {"hf_dir": str(data_dir / "tiny-llama"), "jobs": jobs, "targets": targets,
            "our_targets": list(lora.targets), "seed": int(top.seed), "steps": steps,
            "max_seq_len": int(trainer.max_seq_len), "eval_samples": int(trainer.eval_samples)}


# ----- the peft worker (run as a script) ---------------------------------------------------

def _batch(examples, pad_id: int):
    """Right-padded ids, attention mask and labels (-100 outside the loss tokens)."""
    import torch

    width = max(len(ex.tokens) for ex in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex.tokens)
        ids[row, :n] = torch.tensor(ex.tokens)
        attn[row, :n] = 1
        # loss_mask[i]: predicting tokens[i + 1] counts; HF shifts labels by one itself.
        keep = torch.tensor((False,) + ex.loss_mask)
        labels[row, :n] = torch.where(keep, ids[row, :n], -100)
    return ids, attn, labels


def _eval_loss(model, examples, pad_id: int) -> float:
    """Mean loss over the loss tokens of ``examples`` (one batch)."""
    import torch

    ids, attn, labels = _batch(examples, pad_id)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        target = labels[:, 1:]
        keep = target != -100
        loss = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
    model.train()
    return float(loss / keep.sum())


def peft_worker(spec: dict, job_indices: list[int], threads: int, result_file: str) -> None:
    """Train the given jobs one after another with transformers + peft; write timings,
    losses and this process's CPU seconds of the training loops."""
    import torch

    torch.set_num_threads(threads)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_multilora.data.datasets import load_dataset
    from megatron_multilora.data.tokenizer import HFTokenizer
    from megatron_multilora.training.config import AdapterJob
    from megatron_multilora.training.jobs import JobQueue
    from megatron_multilora.training.slot_optimizer import lr_factor

    torch.manual_seed(spec["seed"])
    tok = HFTokenizer(AutoTokenizer.from_pretrained(spec["hf_dir"]))
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
    jobs = [AdapterJob(**spec["jobs"][i]) for i in job_indices]
    train = [load_dataset(j.dataset, tok, spec["max_seq_len"]) for j in jobs]
    evals = [load_dataset(j.eval_dataset, tok, spec["max_seq_len"])[:spec["eval_samples"]]
             for j in jobs]
    peft_model = None
    for job in jobs:  # every adapter injected up front; only the one training is active
        cfg = LoraConfig(r=job.rank, lora_alpha=job.alpha, lora_dropout=job.dropout,
                         target_modules=spec["targets"], bias="none", task_type="CAUSAL_LM")
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=job.name)
        else:
            peft_model.add_adapter(job.name, cfg)
    peft_model.train()
    steps = spec["steps"]
    out = {"jobs": {}, "threads": threads, "torch_threads": torch.get_num_threads()}
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for job, data, held_out in zip(jobs, train, evals):
        peft_model.base_model.set_adapter(job.name)
        params = [p for n, p in peft_model.named_parameters() if f".{job.name}." in n]
        for n, p in peft_model.named_parameters():
            p.requires_grad_(f".{job.name}." in n)
        opt = torch.optim.AdamW(params, lr=job.lr, weight_decay=job.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda st, job=job: lr_factor(st, job, steps))
        queue = JobQueue([job], [len(data)], 1)
        state = queue.states[0]
        times, losses = [time.time()], []
        for _ in range(steps):
            picked = queue.next_samples(state, job.global_batch_size, len(data), spec["seed"])
            ids, attn, labels = _batch([data[i] for i in picked], tok.pad_id)
            loss = peft_model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if job.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, job.grad_clip)
            opt.step()
            sched.step()
            losses.append(loss.item())
            times.append(time.time())
        out["jobs"][job.name] = {"step_end_times": times[1:], "loop_start": times[0],
                                 "train_loss_last": losses[-1],
                                 "params": sum(p.numel() for p in params)}
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    out["loop_cpu_s"] = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    for job, held_out in zip(jobs, evals):  # after every loop: outside the timed span
        peft_model.base_model.set_adapter(job.name)
        out["jobs"][job.name]["eval_loss"] = _eval_loss(peft_model, held_out, tok.pad_id)
    Path(result_file).write_text(json.dumps(out))


# ----- launching each way from the benchmark ------------------------------------------------

def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def training_span(step_end_times: list[list[float]]) -> float:
    """Seconds from the start of the first training step to the end of the last, over one
    or more loops (processes or jobs); a loop's first step is counted at its median step
    time (ours cannot time it: its first metrics record comes after step 1), so one-time
    warm-up in step 1 is left out on every side alike."""
    starts, ends = [], []
    for times in step_end_times:
        dt = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0
        starts.append(times[0] - dt)
        ends.append(times[-1])
    return max(ends) - min(starts)


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_ours(spec: dict, data_dir: Path, run_dir: Path, log) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "0",
           str(REPO / "recipes" / "multi_lora_finetune.py"), f"data_dir={data_dir}",
           f"run_dir={run_dir}", f"trainer.steps_per_job={spec['steps']}",
           "trainer.log_interval=1", "trainer.eval_interval=0", "checkpoint.save_interval=0",
           "logging.wandb_mode=disabled", "logging.plots=false"]
    cpu, start = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(1), capture_output=True, text=True)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    (run_dir.parent / f"{run_dir.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"ours failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, spec["steps"] + 1)), "one record per step"
    final = [r for r in records if r["kind"] == "eval"][-1]["adapters"]
    names = [j["name"] for j in spec["jobs"]]
    return {"train_s": training_span([[r["time"] for r in train]]), "launch_s": wall, "cpu_s": cpu,
            "eval_loss": {n: final[n][f"loss_on_{n}"] for n in names},
            "base_eval_loss": {n: final["base"][f"loss_on_{n}"] for n in names}}


def run_peft(spec: dict, groups: list[list[int]], threads: int, tmp: Path, log) -> dict:
    """One worker process per group of jobs, all at once; each trains its jobs in turn."""
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(spec))
    procs, results = [], []
    cpu, start = _children_cpu(), time.perf_counter()
    for k, group in enumerate(groups):
        result = tmp / f"peft-{threads}t-{k}.json"
        results.append(result)
        cmd = [sys.executable, __file__, "--peft-worker", "--spec", str(spec_file), "--jobs",
               ",".join(map(str, group)), "--threads", str(threads), "--result-file", str(result)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(threads), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate()[0] for p in procs]
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    for p, text in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"peft worker failed (exit {p.returncode}): {text[-2000:]}")
    got = [json.loads(r.read_text()) for r in results]
    jobs = {n: j for g in got for n, j in g["jobs"].items()}
    return {"train_s": training_span([[t for j in g["jobs"].values() for t in j["step_end_times"]]
                                      for g in got]),
            "launch_s": wall, "cpu_s": cpu, "loop_cpu_s": sum(g["loop_cpu_s"] for g in got),
            "eval_loss": {n: j["eval_loss"] for n, j in jobs.items()},
            "lora_params": {n: j["params"] for n, j in jobs.items()}}


def run_way(way: str, spec: dict, data_dir: Path, tmp: Path, round_: int, log) -> dict:
    n = len(spec["jobs"])
    if way == "ours":
        return run_ours(spec, data_dir, tmp / f"ours-{round_}", log)
    if way == "peft-seq-1t":
        return run_peft(spec, [list(range(n))], 1, tmp, log)
    if way == "peft-seq-2t":
        return run_peft(spec, [list(range(n))], 2, tmp, log)
    half = (n + 1) // 2
    return run_peft(spec, [list(range(half)), list(range(half, n))], 1, tmp, log)


def run_peers(steps: int, rounds: int, say) -> dict:
    """Every way once per round, in turn; returns per-way lists of results and the spec."""
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "demo"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_demo_data.py"), "--out-dir",
                        str(data_dir)], cwd=REPO, env=_env(1), check=True, capture_output=True)
        spec = job_spec(data_dir, steps)
        say(f"peers: {len(spec['jobs'])} demo4 jobs x {steps} steps; LoRA on {spec['targets']}")
        results: dict[str, list[dict]] = {w: [] for w in WAYS}
        for r in range(rounds):
            for way in WAYS:
                got = run_way(way, spec, data_dir, tmp, r, say)
                results[way].append(got)
                say(f"peers round {r + 1}/{rounds}: {way}: training {got['train_s']:.1f} s, launch "
                    f"{got['launch_s']:.1f} s, CPU {got['cpu_s']:.1f} s; held-out loss "
                    + ", ".join(f"{k} {v:.3f}" for k, v in got["eval_loss"].items()))
        spec = {k: v for k, v in spec.items() if k != "hf_dir"}
        for job in spec["jobs"]:
            job["dataset"] = Path(job["dataset"]).name
            job["eval_dataset"] = Path(job["eval_dataset"]).name
        return {"spec": spec, "results": results}


def peers_rows(peers: dict, Row) -> list:
    """Rows 10a-10c (training wall) and 10d-10f (CPU seconds), ours (A) vs each other way."""
    res, spec = peers["results"], peers["spec"]
    med = {w: {k: statistics.median(r[k] for r in rs) for k in ("train_s", "launch_s", "cpu_s")}
           for w, rs in res.items()}
    names = [j["name"] for j in spec["jobs"]]
    loss = {w: {n: statistics.median(r["eval_loss"][n] for r in rs) for n in names}
            for w, rs in res.items()}
    jobs = "; ".join(f"{j['name']} r{j['rank']} alpha {j['alpha']:g}"
                     + (f" dropout {j['dropout']:g}" if j["dropout"] else "")
                     + f" {j['schedule']}" for j in spec["jobs"])
    j0 = spec["jobs"][0]
    setting = (f"{len(names)} LoRA jobs of conf/jobs/demo4.yaml ({jobs}; each lr {j0['lr']:g}, "
               f"warmup {j0['warmup_steps']}, global batch {j0['global_batch_size']}, grad clip "
               f"{j0['grad_clip']}, AdamW wd {j0['weight_decay']:g}), {spec['steps']} steps each, "
               f"fp32, on the tiny random HF Llama of scripts/make_demo_data.py (LoRA on "
               f"{'/'.join(spec['targets'])} = our {', '.join(spec['our_targets'])})")
    timing = ("training wall = from the start of the first training step to the end of the "
              "last (setup, model and data loading, final evaluation and export left out; "
              "ours from its metrics.jsonl record times, one record per step; a first step "
              "counted at the median step time on every side)")
    rows = []
    for i, way in enumerate(WAYS[1:]):
        what = (f"{setting}: {WAY_TEXT['ours']} vs {WAY_TEXT[way]}; {timing}" if i == 0 else
                f"as row 10a, vs {WAY_TEXT[way]}")
        row = Row(f"10{'abc'[i]}", f"{len(names)} adapter jobs: ours vs {way}: training wall",
                  what, "ours", way, "s")
        row.fill(med["ours"]["train_s"], med[way]["train_s"])
        row.note = (f"Whole launch (process start to exit): {med['ours']['launch_s']:.1f} s vs "
                    f"{med[way]['launch_s']:.1f} s. Held-out loss per job (ours / {way}): "
                    + ", ".join(f"{n} {loss['ours'][n]:.3f} / {loss[way][n]:.3f}" for n in names)
                    + f"; base model {', '.join(f'{n} {v:.3f}' for n, v in res['ours'][0]['base_eval_loss'].items())}.")
        rows.append(row)
    for i, way in enumerate(WAYS[1:]):
        row = Row(f"10{'def'[i]}", f"{len(names)} adapter jobs: ours vs {way}: CPU seconds", (
            f"the same runs as row 10{'abc'[i]}: CPU seconds (user + system, getrusage of the "
            "waited child processes) of the whole launch, setup and imports included"),
            "ours", way, "s")
        row.fill(med["ours"]["cpu_s"], med[way]["cpu_s"])
        loop = statistics.median(r["loop_cpu_s"] for r in res[way])
        row.note = (f"Of {way}'s, {loop:.1f} s are its training loops (the rest: imports, "
                    "model and data loading, evaluation).")
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="peft worker of scripts/bench.py's peers rows")
    parser.add_argument("--peft-worker", action="store_true", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--jobs", required=True, help="comma-separated job indices")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--result-file", required=True)
    args = parser.parse_args(argv)
    peft_worker(json.loads(Path(args.spec).read_text()),
                [int(i) for i in args.jobs.split(",")], args.threads, args.result_file)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
