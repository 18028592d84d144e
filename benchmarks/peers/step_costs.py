"""Rows 10i-10k: one global step of every job on one core, part by part, ours vs peft."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.peers.peft_loop import PeftLoop, batch, peft_name, with_peft_adapters

STEP_PARTS = ("frozen", "lora", "step")
"""Timed per global step: the frozen base's forward+backward, the same with every job's
LoRA, the whole training step."""


def _step_batches(data: list, jobs: list, seed: int, rep: int) -> list:
    """Each job's global batch of repetition ``rep``: both sides draw the same examples."""
    import random

    rng = random.Random(seed * 100_003 + rep)
    return [
        [d[rng.randrange(len(d))] for _ in range(job.global_batch_size)]
        for d, job in zip(data, jobs)
    ]


def _median_ms(run, reps: int, warmup: int) -> float:
    times = []
    for rep in range(warmup + reps):
        start = time.perf_counter()
        run(rep)
        if rep >= warmup:
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def step_cost_worker(
    spec: dict, side: str, result_file: str, reps: int = 20, warmup: int = 3
) -> None:
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
    out["positions"] = statistics.mean(
        sum(len(e.tokens) - 1 for b in batches(rep) for e in b)
        for rep in range(warmup, warmup + reps)
    )
    Path(result_file).write_text(json.dumps(out))


def _peft_step_costs(spec: dict, jobs: list, batches, pad_id: int, median) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).train()
    model.requires_grad_(False)
    embed = model.get_input_embeddings()

    def frozen(rep: int) -> None:
        for examples in batches(rep):
            ids, attn, labels = batch(examples, pad_id)
            x = embed(ids).detach().requires_grad_(True)
            model(inputs_embeds=x, attention_mask=attn, labels=labels).loss.backward()

    out = {"frozen": median(frozen)}  # before peft injects its layers into ``model``
    peft_model = with_peft_adapters(model, jobs, spec["targets"])
    loops = [PeftLoop(peft_model, job, spec["steps"]) for job in jobs]
    for loop in loops:
        for p in loop.params:
            p.requires_grad_(True)

    def lora(rep: int) -> None:
        for loop, examples in zip(loops, batches(rep)):
            peft_model.base_model.set_adapter(peft_name(loop.job))
            ids, attn, labels = batch(examples, pad_id)
            peft_model(input_ids=ids, attention_mask=attn, labels=labels).loss.backward()

    def step(rep: int) -> None:  # one step of each job's loop (as peft_worker's)
        for loop, examples in zip(loops, batches(rep)):
            peft_model.base_model.set_adapter(peft_name(loop.job))
            loop.step(examples, pad_id)

    out["lora"], out["step"] = median(lora), median(step)
    return out


def _our_step_costs(spec: dict, jobs: list, batches, pad_id: int, median) -> dict:
    """The recipe's own pieces, as its trainer puts them together: the run composed from
    conf/, the base built and loaded (frozen), then the run's model with every job started in
    its slot by ``start_job`` and the trainer's step (``SlotStep.train``)."""
    import torch

    import megatron_multilora as mm
    from benchmarks.workloads import recipe_run
    from megatron_multilora.models.gpt import build_model_chunks
    from megatron_multilora.models.hf_import import load_hf_checkpoint
    from megatron_multilora.training.config import base_model_config
    from megatron_multilora.training.model_setup import build_run_model
    from megatron_multilora.training.runtime import start_job
    from megatron_multilora.training.step.micro_batches import pack_micro_batches
    from megatron_multilora.training.step.schedule import per_slot_losses
    from megatron_multilora.training.step.slot_step import SlotStep, slot_work

    mm.support_megatron_here()
    run = recipe_run(spec["overrides"], config_name=spec["config_name"])
    mm.init_parallel(seed=run.seed)
    cfg = base_model_config(run)
    order = sorted(range(len(jobs)), key=lambda slot: jobs[slot].rank)  # as the trainer packs

    def forward_backward(chunks: list) -> Callable[[int], None]:
        def run_it(rep: int) -> None:
            examples = batches(rep)
            loss_tokens = torch.tensor([sum(sum(e.loss_mask) for e in b) for b in examples])
            per_slot_losses(
                chunks,
                pack_micro_batches(
                    examples, run.trainer.micro_batch_tokens, pad_id=pad_id, slot_order=order
                ),
                loss_tokens,
            )

        return run_it

    base = build_model_chunks(cfg, calculate_per_token_loss=True)
    load_hf_checkpoint(base, run.hf_dir, cfg)
    # Frozen, with the gradient w.r.t. the token embeddings only, as peft's frozen side.
    base[0].requires_grad_(False)
    base[0].embedding.register_forward_hook(lambda module, args, out: out.requires_grad_())
    out = {"frozen": median(forward_backward(base))}
    model = build_run_model(run, cfg)
    optimizers = {
        slot: start_job(model, slot, job, spec["steps"], cfg) for slot, job in enumerate(jobs)
    }
    out["lora"] = median(forward_backward(model))
    step = SlotStep(model, run.lora.slots, run.trainer.micro_batch_tokens, 1, pad_id)
    out["step"] = median(
        lambda rep: step.train(slot_work(batches(rep), optimizers), slot_order=order)
    )
    return out
