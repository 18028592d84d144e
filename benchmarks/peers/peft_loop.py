"""The peft side of rows 10: transformers + peft training the jobs one after another, as a user
writes the loop."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path


def batch(examples, pad_id: int):
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


def bf16_autocast(enabled: bool):
    """``torch.autocast("cpu", torch.bfloat16)`` around one forward, as a user turns on bf16 on
    CPU. Per forward, not around the loop: autocast caches its casts of trainable weights until
    its outermost context exits, so a loop-wide context would train nothing."""
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def eval_loss(model, examples, pad_id: int, autocast: bool = False) -> float:
    """Mean loss over the loss tokens of ``examples`` (one batch)."""
    import torch

    ids, attn, labels = batch(examples, pad_id)
    model.eval()
    with torch.no_grad(), bf16_autocast(autocast):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        target = labels[:, 1:]
        keep = target != -100
        loss = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
    model.train()
    return float(loss / keep.sum())


def peft_name(job) -> str:
    """The job's adapter name inside peft: prefixed, as a bare job name may be a torch module
    attribute (peft cannot add an adapter called ``double``)."""
    return f"job_{job.name}"


def with_peft_adapters(model, jobs: list, targets: list[str]):
    """``model`` wrapped by peft with one LoRA adapter per job (every one injected up front;
    only the active one trains), in train mode."""
    from peft import LoraConfig, get_peft_model

    peft_model = None
    for job in jobs:
        cfg = LoraConfig(
            r=job.rank,
            lora_alpha=job.alpha,
            lora_dropout=job.dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=peft_name(job))
        else:
            peft_model.add_adapter(peft_name(job), cfg)
    return peft_model.train()


class PeftLoop:
    """One job's training loop with peft as a user writes it: AdamW on its adapter's
    parameters, its LR schedule, its gradient clipping (the job's adapter must be active);
    ``autocast``: each forward under bf16 autocast."""

    def __init__(self, peft_model, job, steps: int, autocast: bool = False) -> None:
        import torch

        from megatron_multilora.training.step.slot_optimizer import lr_factor

        self.model, self.job, self.autocast = peft_model, job, autocast
        self.params = [p for n, p in peft_model.named_parameters() if f".{peft_name(job)}." in n]
        self.opt = torch.optim.AdamW(self.params, lr=job.lr, weight_decay=job.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda step: lr_factor(step, job, steps)
        )

    def step(self, examples, pad_id: int) -> float:
        """One optimizer step on ``examples``; returns the loss."""
        import torch

        ids, attn, labels = batch(examples, pad_id)
        with bf16_autocast(self.autocast):
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
    losses and this process's CPU seconds of the training loops. With ``spec["autocast"]``
    "bf16", every forward (training and held-out) runs under bf16 autocast."""
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_multilora.data.datasets import load_dataset
    from megatron_multilora.data.tokenizer import HFTokenizer
    from megatron_multilora.training.config import AdapterJob
    from megatron_multilora.training.jobs.job import Job
    from megatron_multilora.training.objectives.sft import SFT

    torch.manual_seed(spec["seed"])
    tok = HFTokenizer(AutoTokenizer.from_pretrained(spec["hf_dir"]))
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32)
    jobs = [AdapterJob(**spec["jobs"][i]) for i in job_indices]
    train = [load_dataset(j.dataset, tok, spec["max_seq_len"]) for j in jobs]
    evals = [
        load_dataset(j.eval_dataset, tok, spec["max_seq_len"])[: spec["eval_samples"]] for j in jobs
    ]
    peft_model = with_peft_adapters(model, jobs, spec["targets"])
    autocast = spec.get("autocast") == "bf16"
    out = {"jobs": {}, "threads": threads, "torch_threads": torch.get_num_threads()}
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    for job, data in zip(jobs, train):
        peft_model.base_model.set_adapter(peft_name(job))
        for n, p in peft_model.named_parameters():
            p.requires_grad_(f".{peft_name(job)}." in n)
        loop = PeftLoop(peft_model, job, job.max_steps, autocast)
        order = Job(job, SFT(), data, [], [], job.max_steps)  # the recipe's sample order
        times, losses, positions = [time.time()], [], 0
        for _ in range(job.max_steps):
            picked = [data[i] for i in order.next_samples(job.global_batch_size, spec["seed"])]
            losses.append(loop.step(picked, tok.pad_id))
            positions += sum(len(ex.tokens) for ex in picked)
            times.append(time.time())
        out["jobs"][job.name] = {
            "step_end_times": times[1:],
            "loop_start": times[0],
            "train_loss_last": losses[-1],
            "positions": positions,
            "params": sum(p.numel() for p in loop.params),
        }
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    out["loop_cpu_s"] = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    for job, held_out in zip(jobs, evals):  # after every loop: outside the timed span
        peft_model.base_model.set_adapter(peft_name(job))
        out["jobs"][job.name]["eval_loss"] = eval_loss(peft_model, held_out, tok.pad_id, autocast)
    Path(result_file).write_text(json.dumps(out))
