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
  order (``Job.next_samples`` with the run's seed), labels -100 outside the completion, so
  the loss is the mean over the job's loss tokens in its global batch, like ours.

Held-out loss: the mean over the loss tokens of the first ``trainer.eval_samples`` records of
each job's eval file (ours: its end-of-run adapter x task table; peft: the same examples
through the PEFT model).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
WAYS = ("ours", "peft-seq-1t", "peft-seq-2t", "peft-par", "ours-1p")
WAY_TEXT = {
    "ours": "ours: every job in its own slot of one model, trained together, 2 processes x 1 "
            "thread (torchrun, data parallel)",
    "peft-seq-1t": "transformers + peft in one process, the adapters one after another, 1 thread",
    "peft-seq-2t": "transformers + peft in one process, the adapters one after another, 2 threads",
    "peft-par": "2 independent transformers + peft processes at once (1 thread each, 2 adapters "
                "each, one after another)",
    "ours-1p": "ours on one core: every job in its own slot of one model, 1 process x 1 thread",
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
            "our_targets": list(lora.targets), "max_rank": int(lora.max_rank),
            "seed": int(top.seed), "steps": steps, "max_seq_len": int(trainer.max_seq_len),
            "micro_batch_tokens": int(trainer.micro_batch_tokens),
            "eval_samples": int(trainer.eval_samples)}


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


def _with_peft_adapters(model, jobs: list, targets: list[str]):
    """``model`` wrapped by peft with one LoRA adapter per job (every one injected up front;
    only the active one trains), in train mode."""
    from peft import LoraConfig, get_peft_model

    peft_model = None
    for job in jobs:
        cfg = LoraConfig(r=job.rank, lora_alpha=job.alpha, lora_dropout=job.dropout,
                         target_modules=targets, bias="none", task_type="CAUSAL_LM")
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=job.name)
        else:
            peft_model.add_adapter(job.name, cfg)
    return peft_model.train()


class _PeftLoop:
    """One job's training loop with peft as a user writes it: AdamW on its adapter's
    parameters, its LR schedule, its gradient clipping (the job's adapter must be active)."""

    def __init__(self, peft_model, job, steps: int) -> None:
        import torch

        from megatron_multilora.training.step.slot_optimizer import lr_factor

        self.model, self.job = peft_model, job
        self.params = [p for n, p in peft_model.named_parameters() if f".{job.name}." in n]
        self.opt = torch.optim.AdamW(self.params, lr=job.lr, weight_decay=job.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda step: lr_factor(step, job, steps))

    def step(self, examples, pad_id: int) -> float:
        """One optimizer step on ``examples``; returns the loss."""
        import torch

        ids, attn, labels = _batch(examples, pad_id)
        loss = self.model(input_ids=ids, attention_mask=attn, labels=labels).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.job.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.job.grad_clip)
        self.opt.step()
        self.sched.step()
        return loss.item()


def peft_worker(spec: dict, job_indices: list[int], threads: int, result_file: str) -> None:
    """Train the given jobs one after another with transformers + peft; write timings,
    losses and this process's CPU seconds of the training loops."""
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_multilora.data.datasets import load_dataset
    from megatron_multilora.data.tokenizer import HFTokenizer
    from megatron_multilora.training.config import AdapterJob
    from megatron_multilora.training.jobs.job import Job

    torch.manual_seed(spec["seed"])
    tok = HFTokenizer(AutoTokenizer.from_pretrained(spec["hf_dir"]))
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
    jobs = [AdapterJob(**spec["jobs"][i]) for i in job_indices]
    train = [load_dataset(j.dataset, tok, spec["max_seq_len"]) for j in jobs]
    evals = [load_dataset(j.eval_dataset, tok, spec["max_seq_len"])[:spec["eval_samples"]]
             for j in jobs]
    peft_model = _with_peft_adapters(model, jobs, spec["targets"])
    steps = spec["steps"]
    out = {"jobs": {}, "threads": threads, "torch_threads": torch.get_num_threads()}
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for job, data in zip(jobs, train):
        peft_model.base_model.set_adapter(job.name)
        for n, p in peft_model.named_parameters():
            p.requires_grad_(f".{job.name}." in n)
        loop = _PeftLoop(peft_model, job, steps)
        order = Job(job, data, [], [], steps)  # the recipe's sample order for this job
        times, losses = [time.time()], []
        for _ in range(steps):
            picked = order.next_samples(job.global_batch_size, spec["seed"])
            losses.append(loop.step([data[i] for i in picked], tok.pad_id))
            times.append(time.time())
        out["jobs"][job.name] = {"step_end_times": times[1:], "loop_start": times[0],
                                 "train_loss_last": losses[-1],
                                 "params": sum(p.numel() for p in loop.params)}
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    out["loop_cpu_s"] = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    for job, held_out in zip(jobs, evals):  # after every loop: outside the timed span
        peft_model.base_model.set_adapter(job.name)
        out["jobs"][job.name]["eval_loss"] = _eval_loss(peft_model, held_out, tok.pad_id)
    Path(result_file).write_text(json.dumps(out))


# ----- one global step on one core: where the time goes (rows 10i-10k) -------------------

STEP_PARTS = ("frozen", "lora", "step")
"""Timed per global step: the frozen base's forward+backward, the same with every job's
LoRA, the whole training step."""


def _step_batches(data: list, jobs: list, seed: int, rep: int) -> list:
    """Each job's global batch of repetition ``rep``: both sides draw the same examples."""
    import random

    rng = random.Random(seed * 100_003 + rep)
    return [[d[rng.randrange(len(d))] for _ in range(job.global_batch_size)]
            for d, job in zip(data, jobs)]


def _median_ms(run, reps: int, warmup: int) -> float:
    times = []
    for rep in range(warmup + reps):
        start = time.perf_counter()
        run(rep)
        if rep >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def step_cost_worker(spec: dict, side: str, result_file: str, reps: int = 20,
                     warmup: int = 3) -> None:
    """Median ms (1 thread) of one global step of every job, per :data:`STEP_PARTS`; the
    frozen base's backward gives the gradient w.r.t. the token embeddings only. ``peft``:
    HF Llama, the jobs one after another (each a step of its loop); ``ours``: every job's
    examples packed into one step of one megatron model (the recipe's step, one process)."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    from transformers import AutoTokenizer

    from megatron_multilora.data.datasets import load_dataset
    from megatron_multilora.data.tokenizer import HFTokenizer
    from megatron_multilora.training.config import AdapterJob

    tok = HFTokenizer(AutoTokenizer.from_pretrained(spec["hf_dir"]))
    jobs = [AdapterJob(**j) for j in spec["jobs"]]
    data = [load_dataset(j.dataset, tok, spec["max_seq_len"]) for j in jobs]

    def batches(rep: int) -> list:
        return _step_batches(data, jobs, spec["seed"], rep)

    timed = _peft_step_costs if side == "peft" else _our_step_costs
    out = timed(spec, jobs, batches, tok.pad_id, lambda run: _median_ms(run, reps, warmup))
    out["positions"] = statistics.mean(sum(len(e.tokens) - 1 for b in batches(rep) for e in b)
                                       for rep in range(warmup, warmup + reps))
    Path(result_file).write_text(json.dumps(out))


def _peft_step_costs(spec: dict, jobs: list, batches, pad_id: int, median) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).train()
    model.requires_grad_(False)
    embed = model.get_input_embeddings()

    def frozen(rep: int) -> None:
        for examples in batches(rep):
            ids, attn, labels = _batch(examples, pad_id)
            x = embed(ids).detach().requires_grad_(True)
            model(inputs_embeds=x, attention_mask=attn, labels=labels).loss.backward()

    out = {"frozen": median(frozen)}  # before peft injects its layers into ``model``
    peft_model = _with_peft_adapters(model, jobs, spec["targets"])
    loops = [_PeftLoop(peft_model, job, spec["steps"]) for job in jobs]
    for loop in loops:
        for p in loop.params:
            p.requires_grad_(True)

    def lora(rep: int) -> None:
        for loop, examples in zip(loops, batches(rep)):
            peft_model.base_model.set_adapter(loop.job.name)
            ids, attn, labels = _batch(examples, pad_id)
            peft_model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()

    def step(rep: int) -> None:  # one step of each job's loop (as peft_worker's)
        for loop, examples in zip(loops, batches(rep)):
            peft_model.base_model.set_adapter(loop.job.name)
            loop.step(examples, pad_id)

    out["lora"], out["step"] = median(lora), median(step)
    return out


def _our_step_costs(spec: dict, jobs: list, batches, pad_id: int, median) -> dict:
    import torch

    import megatron_multilora as mm
    from megatron_multilora.data.packing import pack_micro_batches
    from megatron_multilora.models.hf_config import hf_to_model_config, read_hf_config
    from megatron_multilora.models.hf_import import load_hf_checkpoint
    from megatron_multilora.training.step.schedule import per_slot_losses
    from megatron_multilora.training.step.slot_optimizer import SlotOptimizer
    from megatron_multilora.training.step.train_step import SlotTrainStep

    mm.support_megatron_here()
    mm.init_parallel(seed=spec["seed"])
    cfg = hf_to_model_config(read_hf_config(spec["hf_dir"]))
    model = mm.build_gpt_model(cfg, calculate_per_token_loss=True)
    load_hf_checkpoint(model, spec["hf_dir"], cfg)
    n = len(jobs)
    order = sorted(range(n), key=lambda slot: jobs[slot].rank)  # as the trainer packs them

    def forward_backward(rep: int) -> None:
        examples = batches(rep)
        loss_tokens = torch.tensor([sum(sum(e.loss_mask) for e in b) for b in examples])
        per_slot_losses([model], pack_micro_batches(examples, spec["micro_batch_tokens"],
                                                    pad_id=pad_id, slot_order=order), loss_tokens)

    embeddings = model.embedding.word_embeddings.weight
    embeddings.requires_grad_(True)  # the frozen base's only gradient, as peft's side
    out = {"frozen": median(forward_backward)}
    embeddings.requires_grad_(False)
    embeddings.grad = None
    model = mm.apply_multi_lora(model, n, spec["max_rank"], alpha=1.0,
                                target_modules=spec["our_targets"], seed=spec["seed"])
    optimizers = {}
    for slot, job in enumerate(jobs):
        mm.init_adapter_slot(model, slot, job.rank, job.alpha, job.dropout)
        optimizers[slot] = SlotOptimizer(mm.slot_parameters(model, slot), job, spec["steps"])
    out["lora"] = median(forward_backward)
    train_step = SlotTrainStep([model], n, spec["micro_batch_tokens"], 1, pad_id)
    out["step"] = median(lambda rep: train_step(batches(rep), optimizers, slot_order=order))
    return out


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
    from bench import child_env  # the launchers run under scripts/bench.py

    return {**child_env(), "OMP_NUM_THREADS": str(threads)}


def run_ours(spec: dict, data_dir: Path, run_dir: Path, processes: int) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(processes), "--local-ranks-filter", "0",
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


def run_peft(spec: dict, groups: list[list[int]], threads: int, tmp: Path) -> dict:
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


def run_way(way: str, spec: dict, data_dir: Path, tmp: Path, round_: int) -> dict:
    n = len(spec["jobs"])
    if way in ("ours", "ours-1p"):
        return run_ours(spec, data_dir, tmp / f"{way}-{round_}", 1 if way == "ours-1p" else 2)
    if way == "peft-seq-1t":
        return run_peft(spec, [list(range(n))], 1, tmp)
    if way == "peft-seq-2t":
        return run_peft(spec, [list(range(n))], 2, tmp)
    half = (n + 1) // 2
    return run_peft(spec, [list(range(half)), list(range(half, n))], 1, tmp)


def run_step_costs(spec: dict, side: str, tmp: Path) -> dict:
    """:func:`step_cost_worker` of ``side`` in its own process (1 thread)."""
    spec_file, result = tmp / "spec.json", tmp / f"step-{side}.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, __file__, "--step-worker", side, "--spec", str(spec_file),
           "--result-file", str(result)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(1), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} step worker failed (exit {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return json.loads(result.read_text())


def run_peers(steps: int, rounds: int, say) -> dict:
    """Every way, then the step-cost workers, once per round, in turn; returns per-way lists
    of results, per-side lists of step costs, and the spec."""
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp_name:
        tmp = Path(tmp_name)
        data_dir = tmp / "demo"
        subprocess.run([sys.executable, str(REPO / "scripts" / "make_demo_data.py"), "--out-dir",
                        str(data_dir)], cwd=REPO, env=_env(1), check=True, capture_output=True)
        spec = job_spec(data_dir, steps)
        say(f"peers: {len(spec['jobs'])} demo4 jobs x {steps} steps; LoRA on {spec['targets']}")
        results: dict[str, list[dict]] = {w: [] for w in WAYS}
        costs: dict[str, list[dict]] = {"ours": [], "peft": []}
        for r in range(rounds):
            for way in WAYS:
                got = run_way(way, spec, data_dir, tmp, r)
                results[way].append(got)
                say(f"peers round {r + 1}/{rounds}: {way}: training {got['train_s']:.1f} s, launch "
                    f"{got['launch_s']:.1f} s, CPU {got['cpu_s']:.1f} s; held-out loss "
                    + ", ".join(f"{k} {v:.3f}" for k, v in got["eval_loss"].items()))
            for side in costs:
                got = run_step_costs(spec, side, tmp)
                costs[side].append(got)
                say(f"peers round {r + 1}/{rounds}: one global step on one core, {side}: "
                    + ", ".join(f"{k} {got[k]:.1f} ms" for k in STEP_PARTS))
        spec = {k: v for k, v in spec.items() if k != "hf_dir"}
        for job in spec["jobs"]:
            job["dataset"] = Path(job["dataset"]).name
            job["eval_dataset"] = Path(job["eval_dataset"]).name
        return {"spec": spec, "results": results, "step_costs": costs}


PEFT_WAYS = ("peft-seq-1t", "peft-seq-2t", "peft-par")


def peers_rows(peers: dict, Row) -> list:
    """Rows 10a-10c (training wall) and 10d-10f (CPU seconds), ours (A) vs each peft way;
    10g-10h ours on one core vs peft one job after another on one core; 10i-10k one global
    step on one core, part by part (:func:`step_cost_rows`)."""
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
    for i, way in enumerate(PEFT_WAYS):
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
    for i, way in enumerate(PEFT_WAYS):
        row = Row(f"10{'def'[i]}", f"{len(names)} adapter jobs: ours vs {way}: CPU seconds", (
            f"the same runs as row 10{'abc'[i]}: CPU seconds (user + system, getrusage of the "
            "waited child processes) of the whole launch, setup and imports included"),
            "ours", way, "s")
        row.fill(med["ours"]["cpu_s"], med[way]["cpu_s"])
        loop = statistics.median(r["loop_cpu_s"] for r in res[way])
        row.note = (f"Of {way}'s, {loop:.1f} s are its training loops (the rest: imports, "
                    "model and data loading, evaluation).")
        rows.append(row)
    one_core = Row("10g", f"{len(names)} adapter jobs on one core: ours vs peft-seq-1t: training "
                   "wall", f"as row 10a, {WAY_TEXT['ours-1p']} vs {WAY_TEXT['peft-seq-1t']}",
                   "ours-1p", "peft-seq-1t", "s")
    one_core.fill(med["ours-1p"]["train_s"], med["peft-seq-1t"]["train_s"])
    one_core.note = (f"Whole launch: {med['ours-1p']['launch_s']:.1f} s vs "
                     f"{med['peft-seq-1t']['launch_s']:.1f} s. Held-out loss per job (ours-1p / "
                     "peft-seq-1t): " + ", ".join(f"{n} {loss['ours-1p'][n]:.3f} / "
                                                  f"{loss['peft-seq-1t'][n]:.3f}" for n in names)
                     + ".")
    cpu = Row("10h", f"{len(names)} adapter jobs on one core: ours vs peft-seq-1t: CPU seconds",
              "the same runs as row 10g: CPU seconds of the whole launch (as row 10d)",
              "ours-1p", "peft-seq-1t", "s")
    cpu.fill(med["ours-1p"]["cpu_s"], med["peft-seq-1t"]["cpu_s"])
    return rows + [one_core, cpu] + step_cost_rows(peers, med, Row)


def step_cost_rows(peers: dict, med: dict, Row) -> list:
    """Rows 10i-10k: one global step of every job on one core, ours vs peft, part by part;
    the note of 10k sets it against what two cores give each side (rows 10a, 10c)."""
    costs, spec = peers["step_costs"], peers["spec"]
    part = {side: {k: statistics.median(c[k] for c in cs) for k in (*STEP_PARTS, "positions")}
            for side, cs in costs.items()}
    n = len(spec["jobs"])
    setting = (f"one global step of the {n} jobs of row 10a on one core (1 thread, each job's "
               f"global batch of {spec['jobs'][0]['global_batch_size']} examples, "
               f"{part['ours']['positions']:.0f} positions in all; the same examples on both "
               "sides, medians of 20 repetitions per round, each side in its own process): "
               f"ours packs every job's examples into one step of one model, peft runs its "
               f"{n} loops' steps one after another")
    frozen = Row("10i", "one global step on one core: frozen base forward+backward",
                 f"{setting}; the base alone (gradient w.r.t. the token embeddings only): "
                 "megatron-core GPT (ours) vs HF LlamaForCausalLM", "ours", "peft", "ms")
    frozen.fill(part["ours"]["frozen"], part["peft"]["frozen"])
    lora = Row("10j", "one global step on one core: what LoRA adds to forward+backward",
               "as row 10i: forward+backward with every job's LoRA minus the frozen base's",
               "ours", "peft", "ms")
    lora.fill(part["ours"]["lora"] - part["ours"]["frozen"],
              part["peft"]["lora"] - part["peft"]["frozen"])
    step = Row("10k", "one global step on one core: the whole training step",
               "as row 10i: forward+backward with LoRA, gradient norms and clipping, AdamW and "
               "the LR schedule of every job", "ours", "peft", "ms")
    step.fill(part["ours"]["step"], part["peft"]["step"])
    steps = spec["steps"]
    dp2 = 1e3 * med["ours"]["train_s"] / steps
    par = 1e3 * med["peft-par"]["train_s"] / steps
    step.note = (f"On two cores (rows 10a, 10c) a global step takes ours {dp2:.1f} ms (2 data-"
                 f"parallel processes: {part['ours']['step'] / dp2:.2f}x the one-core step) and "
                 f"independent peft processes {par:.1f} ms ({part['peft']['step'] / par:.2f}x).")
    return [frozen, lora, step]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="workers of scripts/bench.py's peers rows")
    worker = parser.add_mutually_exclusive_group(required=True)
    worker.add_argument("--peft-worker", action="store_true", help="train jobs with peft")
    worker.add_argument("--step-worker", choices=("peft", "ours"),
                        help="time one global step's parts on one core")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--jobs", help="comma-separated job indices (--peft-worker)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--result-file", required=True)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    if args.step_worker:
        step_cost_worker(spec, args.step_worker, args.result_file)
    else:
        peft_worker(spec, [int(i) for i in args.jobs.split(",")], args.threads, args.result_file)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
