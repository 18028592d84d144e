"""Benchmark multi-LoRA training: layers, whole models, jobs together, memory, TP and PP layouts.

    .venv/bin/python scripts/bench.py [--device cpu|cuda] [--out-dir benchmarks] [--quick]
        [--skip-tp] [--skip-pp] [--only SECTION ...] [--rounds 11] [--slots 8] [--rank 16] ...

Writes ``<out-dir>/{cpu,gpu}.md`` and ``.json``: hardware, versions, dtype, every setting and
one row per comparison. Every time is a median over rounds measured side by side in this one
process: each round runs every variant of a group once, in turn, so machine noise hits all of
them alike; a row shows both medians and the ratio of the medians (A / B).

Rows (A vs B):
  1a-1d  N slots vs 1 slot holding the same tokens: dense layer, MoE layer, dense model,
         MoE model (a model "step" is forward+backward over one packed micro-batch)
  2a-2d  the multi-LoRA step vs the frozen base step alone, same four cases
  3a-3b  the multi-LoRA layer vs a naive per-slot (per (slot, expert)) loop of two matmuls
  4      N adapter jobs trained together on one N-slot model vs one after another on a
         1-slot model: total wall time for the same tokens and optimizer steps per job
  5      peak memory of fwd+bwd+optimizer with N slots vs 1 slot, above the frozen base alone
  6a-6b  fully sharded (S-LoRA) vs default adapter layout under TP=2, without and with
         sequence parallelism (two processes under torchrun)
  7a-7b  one trainer step (SlotTrainStep: pack, forward/backward through megatron's schedule,
         grad sync, norms, optimizer) of the dense GPT on two pipeline stages (PP=2, two
         processes) vs the same two processes as data-parallel ranks (DP=2), and vs one process
         holding the whole model (PP=1); same jobs, data and micro-batch budget
  8a-8c  one trainer step of the dense GPT with 8, 32, 64 slots vs 1 slot, the same 64
         examples spread over the slots (scripts/bench_scale.py)
  9      the multi-LoRA step vs the frozen base step at a real model's width (SmolLM2-135M's
         geometry, random weights; ``--width-layers`` of its 30 layers)
  10a-10k (section ``peers``, only with ``--only peers``) what a user would run instead: the
         recipe training conf/jobs/demo4.yaml's 4 jobs at once (torchrun, 2 processes x 1
         thread) vs transformers + peft training them one after another in one process (1 and
         2 threads) and vs 2 independent peft processes at once; training wall, CPU seconds and
         each job's held-out loss; the recipe on one core vs peft's loop (10g-10h); one global
         step on one core part by part, ours vs peft (10i-10k) (scripts/bench_peers.py;
         ``--peer-steps``, ``--peer-rounds``)

``--only SECTION ...`` runs some sections (layers, models, jobs, memory, tp, pp, scaling, width,
peers; all but peers run by default) and writes
``<out-dir>/cpu-only-<sections>.md`` (``gpu-...``) and ``.json``, leaving the full report alone.

On CUDA the model is bf16 and built by ``mm.build_gpt_model``, which uses Transformer Engine
when it is installed; layer rows use megatron's ColumnParallelLinear and the pure-torch
grouped expert linear on both devices.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

import megatron_multilora as mm  # first: it quiets megatron's CPU import notices
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_multilora.data.datasets import Example
from megatron_multilora.data.packing import MicroBatch, pack_micro_batches, shard_for_data_parallel
from megatron_multilora.ops.slot_layout import SlotLayout
from megatron_multilora.models.specs import transformer_engine_usable
from megatron_multilora.models.torch_modules import TorchGroupedLinear
from megatron_multilora.layers.slot_routing import build_expert_slot_routing
from megatron_multilora.training.config import AdapterJob
from megatron_multilora.training.step.schedule import per_slot_losses
from megatron_multilora.training.step.train_step import SlotTrainStep, StepResult
from megatron_multilora.training.jobs.board import start_job

REPO = Path(__file__).resolve().parent.parent
MiB = 2.0 ** 20

# Sizes of the full run (a few minutes on a 2-core CPU) and of --quick (a smoke run).
FULL = dict(rounds=11, warmup=2, slots=8, rank=16, layer_hidden=1024, layer_tokens=2048,
            experts=8, model_hidden=256, model_layers=4, examples_per_slot=2, example_tokens=64,
            job_steps=4, job_rounds=5, memory_probes=1, pp_micro_batches=4,
            width_layers=30, width_tokens=512, width_rounds=5, peer_steps=500, peer_rounds=3)
QUICK = dict(rounds=2, warmup=1, slots=8, rank=8, layer_hidden=128, layer_tokens=256,
             experts=4, model_hidden=64, model_layers=1, examples_per_slot=1, example_tokens=16,
             job_steps=2, job_rounds=2, memory_probes=1, pp_micro_batches=2,
             width_layers=1, width_tokens=64, width_rounds=2, peer_steps=5, peer_rounds=1)
SECTIONS = ("layers", "models", "jobs", "memory", "tp", "pp", "scaling", "width")
"""What a run without ``--only`` runs."""
EXTRA_SECTIONS = ("peers",)
"""Run only when named in ``--only`` (minutes of whole training launches)."""
ALL_SECTIONS = SECTIONS + EXTRA_SECTIONS


@dataclasses.dataclass
class Settings:
    """Everything a run depends on; children (memory probes, TP workers) get a copy."""

    device: str
    dtype: str
    rounds: int
    warmup: int
    slots: int
    rank: int
    layer_hidden: int
    layer_tokens: int
    experts: int
    model_hidden: int
    model_layers: int
    examples_per_slot: int
    example_tokens: int
    job_steps: int
    job_rounds: int
    memory_probes: int
    pp_micro_batches: int
    """micro-batches per trainer step of the global batch of rows 7 (PP=2 needs several)."""
    width_layers: int
    """layers of the SmolLM2-135M-shaped model of row 9 (30: all of them)."""
    width_tokens: int
    width_rounds: int
    peer_steps: int
    """steps per job of rows 10 (conf/jobs/demo4.yaml has 500)."""
    peer_rounds: int
    threads: int
    """torch CPU threads of this process and the memory probes (TP/PP workers run 1 each)."""
    quick: bool
    skip_tp: bool
    skip_pp: bool = False

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[self.dtype]

    @property
    def alpha(self) -> float:
        return 2.0 * self.rank


@dataclasses.dataclass
class Row:
    """One comparison: A vs B with both medians and their ratio, or why it was skipped."""

    id: str
    title: str
    what: str
    a: str
    b: str
    unit: str  # "ms", "s" or "MiB"
    a_value: Optional[float] = None
    b_value: Optional[float] = None
    ratio: Optional[float] = None
    skipped: Optional[str] = None
    note: str = ""

    def fill(self, a_value: float, b_value: float) -> "Row":
        self.a_value, self.b_value = a_value, b_value
        self.ratio = a_value / b_value if b_value > 0 else None
        return self


class Clock:
    """Wall-clock timing that waits for the device; progress lines with elapsed time."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> float:
        self.sync()
        return time.perf_counter()

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {text}", flush=True)


def time_side_by_side(clock: Clock, label: str, variants: dict[str, Callable[[], None]],
                      rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each variant; every round calls each variant once, in turn."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(warmup + rounds):
        for name, fn in variants.items():
            start = clock.now()
            fn()
            elapsed = clock.now() - start
            if r >= warmup:
                samples[name].append(elapsed)
        if r >= warmup:
            clock.say(f"{label} round {r - warmup + 1}/{rounds}: " + ", ".join(
                f"{n} {samples[n][-1] * 1e3:.1f} ms" for n in variants))
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in samples.items()}


# ----- layers -----------------------------------------------------------------------------

def layer_config(s: Settings) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=s.layer_hidden, num_attention_heads=1,
                             params_dtype=s.torch_dtype, use_cpu_initialization=True,
                             gradient_accumulation_fusion=False, bf16=s.dtype == "bf16")


def fwd_bwd(fn: Callable[[], object], leaves: list[torch.Tensor], grad: torch.Tensor,
            params: list[torch.nn.Parameter]) -> Callable[[], None]:
    """One layer step: clear gradients, forward, backward with a fixed output gradient."""
    def step() -> None:
        for t in leaves + params:
            t.grad = None
        out = fn()
        (out[0] if isinstance(out, tuple) else out).backward(grad)
    return step


def dense_layer_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """base, N slots, 1 slot and the naive loop over one frozen column-parallel linear."""
    h, n, tokens = s.layer_hidden, s.slots, s.layer_tokens
    base = ColumnParallelLinear(h, h, config=layer_config(s),
                                init_method=torch.nn.init.xavier_normal_, bias=False,
                                gather_output=False, skip_bias_add=True).to(device)
    base.weight.requires_grad_(False)

    def multi(slots: int) -> mm.MultiLoRALinear:
        layer = mm.MultiLoRALinear(base, slots, s.rank, s.alpha, f"bench.dense.{slots}",
                                   row_init_method="normal")
        layer.slot_layout = SlotLayout([tokens // slots + (i < tokens % slots)
                                        for i in range(slots)])
        return layer

    multi_n, multi_1 = multi(n), multi(1)
    counts = list(multi_n.slot_layout.counts)

    def naive(x: torch.Tensor) -> torch.Tensor:
        y, _ = base(x)
        parts = []
        for slot, seg in zip(multi_n.adapters, torch.split(x.view(-1, h), counts)):
            scale = float(slot.alpha / slot.rank)
            parts.append((seg @ slot.linear_in.weight.t()) @ slot.linear_out.weight.t() * scale)
        return y + torch.cat(parts).view_as(y)

    x = torch.randn(tokens, 1, h, dtype=s.torch_dtype, device=device, requires_grad=True)
    grad = torch.randn(tokens, 1, h, dtype=s.torch_dtype, device=device)
    params_n, params_1 = list(multi_n.adapters.parameters()), list(multi_1.adapters.parameters())
    return {"base": fwd_bwd(lambda: base(x), [x], grad, []),
            f"lora-{n}": fwd_bwd(lambda: multi_n(x), [x], grad, params_n),
            "lora-1": fwd_bwd(lambda: multi_1(x), [x], grad, params_1),
            f"naive-{n}": fwd_bwd(lambda: naive(x), [x], grad, params_n)}


def moe_layer_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """The same four variants over a grouped expert linear; rows in the dispatcher's
    expert-major order, each row's slot drawn at random."""
    h, n, e, tokens = s.layer_hidden, s.slots, s.experts, s.layer_tokens
    base = TorchGroupedLinear(e, h, h, config=layer_config(s),
                              init_method=torch.nn.init.xavier_normal_, bias=False,
                              skip_bias_add=False, is_expert=True).to(device)
    base.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    m_splits = torch.bincount(torch.randint(0, e, (tokens,), generator=gen), minlength=e).tolist()

    def multi(slots: int) -> mm.MultiLoRAGroupedExpertLinear:
        layer = mm.MultiLoRAGroupedExpertLinear(base, slots, s.rank, s.alpha, f"bench.moe.{slots}",
                                                e, row_init_method="normal")
        slot = torch.randint(0, slots, (tokens,), generator=torch.Generator().manual_seed(1))
        layer.routing = build_expert_slot_routing(slot.to(device), m_splits, tuple(range(slots)),
                                                  slots, e)
        return layer

    multi_n, multi_1 = multi(n), multi(1)
    routing = multi_n.routing
    # One (slot, expert, rows) per group of the N-slot routing: what a per-pair loop visits.
    pairs = [(routing.slots[g // e], g % e, rows) for g, rows in enumerate(
        torch.split(routing.sort_idx, list(routing.segments.host_counts())))]

    def naive(x: torch.Tensor) -> torch.Tensor:
        y, _ = base(x, m_splits)
        delta = torch.zeros_like(y)
        for slot_idx, expert, rows in pairs:
            slot = multi_n.adapters[slot_idx]
            scale = float(slot.alpha / slot.rank)
            mid = x.index_select(0, rows) @ slot.linear_in.weight[expert].t()
            delta = delta.index_add(0, rows, (mid @ slot.linear_out.weight[expert].t()) * scale)
        return y + delta

    x = torch.randn(tokens, h, dtype=s.torch_dtype, device=device, requires_grad=True)
    grad = torch.randn(tokens, h, dtype=s.torch_dtype, device=device)
    params_n, params_1 = list(multi_n.adapters.parameters()), list(multi_1.adapters.parameters())
    return {"base": fwd_bwd(lambda: base(x, m_splits), [x], grad, []),
            f"lora-{n}": fwd_bwd(lambda: multi_n(x, m_splits), [x], grad, params_n),
            "lora-1": fwd_bwd(lambda: multi_1(x, m_splits), [x], grad, params_1),
            f"naive-{n}": fwd_bwd(lambda: naive(x), [x], grad, params_n)}


# ----- whole models -----------------------------------------------------------------------

def model_config(kind: str, s: Settings) -> mm.GPTModelConfig:
    """conf/model/tiny_{kind}.yaml with hidden size and depth from the settings (FFN widths
    scaled with the hidden size)."""
    from omegaconf import OmegaConf

    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"tiny_{kind}.yaml"))
    scale = s.model_hidden / fields["hidden_size"]
    for key in ("ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if fields.get(key):
            fields[key] = int(fields[key] * scale)
    fields.update(hidden_size=s.model_hidden, num_layers=s.model_layers)
    return mm.GPTModelConfig(**fields)


def build_model(cfg: mm.GPTModelConfig, s: Settings, slots: Optional[int],
                sequence_parallel: bool = False, fully_sharded: bool = False) -> torch.nn.Module:
    """The GPT with ``slots`` adapter slots (recipe defaults: A xavier, B zero), or the frozen
    base alone when ``slots`` is None. Same base weights on every call."""
    torch.manual_seed(0)
    model = mm.build_gpt_model(cfg, sequence_parallel=sequence_parallel, params_dtype=s.torch_dtype,
                               calculate_per_token_loss=True)  # as the recipe's
    if slots is not None:
        kwargs = {"fully_sharded": True} if fully_sharded else {}
        return mm.apply_multi_lora(model, slots, s.rank, s.alpha, seed=0, **kwargs)
    model.requires_grad_(False)
    # Backward must still run through the frozen layers (as it does to reach the adapters):
    # the embedding output requires grad, so every layer's input gradient is computed.
    model.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_())
    return model


def random_examples(count: int, length: int, vocab: int, gen: torch.Generator) -> list[Example]:
    """Examples of ``length`` random tokens, the second half counting in the loss
    (a prompt and its completion)."""
    out = []
    for _ in range(count):
        tokens = tuple(torch.randint(0, vocab, (length,), generator=gen).tolist())
        out.append(Example(tokens, tuple(i >= length // 2 for i in range(length - 1))))
    return out


def pack_one(slot_examples: list[list[Example]], device: torch.device,
             pad_multiple: int = 1) -> MicroBatch:
    """All examples in one adapter-major micro-batch, on the device."""
    (mb,) = pack_micro_batches(slot_examples, one_batch_budget(slot_examples, pad_multiple),
                               pad_multiple)
    return mb.to(device)


def one_batch_budget(slot_examples: list[list[Example]], pad_multiple: int = 1) -> int:
    """A token budget that packs all of ``slot_examples`` into one micro-batch."""
    return sum(len(ex.tokens) - 1 for exs in slot_examples for ex in exs) + pad_multiple


def slot_and_single_examples(s: Settings, vocab: int) -> tuple[list[list[Example]],
                                                               list[list[Example]]]:
    """The same examples for N slots (``examples_per_slot`` each) and all in one slot."""
    gen = torch.Generator().manual_seed(0)
    per_slot = [random_examples(s.examples_per_slot, s.example_tokens, vocab, gen)
                for _ in range(s.slots)]
    return per_slot, [[ex for exs in per_slot for ex in exs]]


def slot_and_single_batches(s: Settings, vocab: int, device: torch.device,
                            pad_multiple: int = 1) -> tuple[MicroBatch, MicroBatch]:
    """The same tokens packed for N slots (``examples_per_slot`` each) and for one slot."""
    per_slot, single = slot_and_single_examples(s, vocab)
    return pack_one(per_slot, device, pad_multiple), pack_one(single, device, pad_multiple)


def model_step(model: torch.nn.Module, mb: MicroBatch) -> None:
    """Forward+backward of one packed micro-batch through the recipe's schedule, each
    adapter's loss normalised by its own loss tokens."""
    per_slot_losses([model], [mb], mb.loss_tokens_per_slot())


def timed_model_step(model: torch.nn.Module, mb: MicroBatch) -> Callable[[], None]:
    """What a model row times: gradients reset, then :func:`model_step` on ``mb``."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        model_step(model, mb)
    return step


def model_variants(kind: str, s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """base, N slots and 1 slot over the same packed tokens of a whole GPT."""
    cfg = model_config(kind, s)
    many, one = slot_and_single_batches(s, cfg.vocab_size, device)
    base, multi_n, multi_1 = (build_model(cfg, s, None), build_model(cfg, s, s.slots),
                              build_model(cfg, s, 1))
    return {"base": timed_model_step(base, many),
            f"lora-{s.slots}": timed_model_step(multi_n, many),
            "lora-1": timed_model_step(multi_1, one)}


# ----- adapter jobs together vs one after another -----------------------------------------

def make_job(j: int, s: Settings) -> AdapterJob:
    return AdapterJob(name=f"job{j}", dataset="(random tokens)", rank=s.rank, alpha=s.alpha,
                      lr=1e-4, schedule="constant", max_steps=s.job_steps)


Packed = tuple[list[list[Example]], list[MicroBatch]]  # one step's examples, micro-batches


def training_step(model: torch.nn.Module, slots: int, batches: list[list[list[Example]]],
                  device: torch.device) -> tuple[SlotTrainStep, list[Packed]]:
    """The recipe's step for ``model`` and each step's (examples, micro-batches), packed
    beforehand (as a data loader would: only training is timed)."""
    budget = max(one_batch_budget(examples) for examples in batches)
    train = SlotTrainStep([model], slots, budget, pad_multiple=1, pad_id=0)
    return train, [(examples, [mb.to(device) for mb in train.batcher.ready(examples)])
                   for examples in batches]


def jobs_variants(s: Settings, device: torch.device) -> dict[str, Callable[[], None]]:
    """``slots`` jobs, each ``job_steps`` steps of ``examples_per_slot`` examples."""
    cfg = model_config("dense", s)
    gen = torch.Generator().manual_seed(1)
    data = [[random_examples(s.examples_per_slot, s.example_tokens, cfg.vocab_size, gen)
             for _ in range(s.job_steps)] for _ in range(s.slots)]
    jobs = [make_job(j, s) for j in range(s.slots)]
    multi_n, multi_1 = build_model(cfg, s, s.slots), build_model(cfg, s, 1)
    step_n, together_batches = training_step(
        multi_n, s.slots, [[data[j][t] for j in range(s.slots)] for t in range(s.job_steps)], device)
    step_1, alone_batches = training_step(
        multi_1, 1, [[data[j][t]] for j in range(s.slots) for t in range(s.job_steps)], device)

    def together() -> None:
        opts = {j: start_job(multi_n, j, job, s.job_steps, cfg) for j, job in enumerate(jobs)}
        for examples, mbs in together_batches:
            step_n(examples, opts, micro_batches=mbs)

    def one_after_another() -> None:
        for j, job in enumerate(jobs):
            opts = {0: start_job(multi_1, 0, job, s.job_steps, cfg)}
            for examples, mbs in alone_batches[j * s.job_steps:(j + 1) * s.job_steps]:
                step_1(examples, opts, micro_batches=mbs)

    return {"together": together, "one-after-another": one_after_another}


# ----- memory -----------------------------------------------------------------------------

def memory_probe(s: Settings, variant: str) -> dict:
    """Peak memory of two training steps of the dense model (``variant``: "base", or a slot
    count); runs in a fresh process so the peak is this variant's alone."""
    device = torch.device(s.device)
    mm.init_parallel(seed=0)
    cfg = model_config("dense", s)
    many = pack_one(slot_and_single_examples(s, cfg.vocab_size)[0], device)
    result: dict = {"variant": variant}
    with tensor_memory_peak(device) as peak:
        if variant == "base":
            model = build_model(cfg, s, None)
            for _ in range(2):
                model_step(model, many)
        else:
            slots = int(variant)
            model = build_model(cfg, s, slots)
            per_slot, single = slot_and_single_examples(s, cfg.vocab_size)
            train, ((examples, mbs),) = training_step(model, slots,
                                                      [per_slot if slots > 1 else single], device)
            opts = {j: start_job(model, j, make_job(j, s), 2, cfg) for j in range(slots)}
            for _ in range(2):
                train(examples, opts, micro_batches=mbs)
            params = mm.slot_parameters(model, 0)
            result.update(params_per_slot=sum(p.numel() for p in params),
                          param_bytes=params[0].element_size())
    result["peak_bytes"] = peak["bytes"]
    mm.destroy_parallel(destroy_process_group=True)
    return result


@contextlib.contextmanager
def tensor_memory_peak(device: torch.device) -> Iterator[dict]:
    """The peak bytes held by tensors while the block runs (model weights included).

    CUDA: the caching allocator's own peak. CPU has no such counter and a process's peak RSS
    moves by +-10 MiB with allocator and thread noise, so every tensor allocation and free is
    recorded with torch's profiler and replayed in order (the timeline behind
    ``torch.profiler.profile.export_memory_timeline``): exact and repeatable.
    """
    out: dict = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        yield out
        out["bytes"] = torch.cuda.max_memory_allocated()
        return
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        yield out
    held = peak = 0
    for _, action, _, size in MemoryProfile(prof.profiler.kineto_results).timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            held += size
        elif action == Action.DESTROY:
            held -= size
        peak = max(peak, held)
    out["bytes"] = peak


def run_memory_probes(s: Settings, clock: Clock) -> dict[str, list[dict]]:
    """``memory_probes`` rounds of fresh-process probes, one of each variant per round. A
    round's probes run concurrently: each process's peak is its own, so only time is shared."""
    probes: dict[str, list[dict]] = {v: [] for v in ("base", "1", str(s.slots))}
    for k in range(s.memory_probes):
        with tempfile.TemporaryDirectory() as tmp:
            outs = {v: Path(tmp) / f"probe-{v}.json" for v in probes}
            procs = [subprocess.Popen([sys.executable, __file__, "--memory-probe", v,
                                       "--settings-json", json.dumps(dataclasses.asdict(s)),
                                       "--result-file", str(out)], env=child_env())
                     for v, out in outs.items()]
            if any(proc.wait() for proc in procs):
                raise RuntimeError("a memory probe failed (its output is above)")
            for v, out in outs.items():
                probes[v].append(json.loads(out.read_text()))
        clock.say(f"memory probes {k + 1}/{s.memory_probes}: " + ", ".join(
            f"{v} {ps[-1]['peak_bytes'] / MiB:.1f} MiB" for v, ps in probes.items()))
    return probes


def adapter_state_bytes(probe: dict, slots: int) -> int:
    """Adapter weights + fp32 gradient buffer + AdamW's two fp32 moments (+ fp32 masters
    for non-fp32 weights), for ``slots`` slots."""
    elt = probe["param_bytes"]
    per_param = elt + 4 + 8 + (0 if elt == 4 else 4)
    return probe["params_per_slot"] * slots * per_param


# ----- tensor parallelism -----------------------------------------------------------------

def tp_worker(s: Settings, result_file: str) -> None:
    """Run under torchrun with 2 processes: time the dense model's step with the default vs
    the fully sharded adapter layout, without and with sequence parallelism."""
    device = torch.device(s.device)
    mm.init_parallel(tensor_model_parallel_size=2, sequence_parallel=False, seed=0)
    clock = Clock(device)
    cfg = model_config("dense", s)
    batch, _ = slot_and_single_batches(s, cfg.vocab_size, device, pad_multiple=2)
    groups = {}
    for sp in (False, True):
        models = {layout: build_model(cfg, s, s.slots, sequence_parallel=sp,
                                      fully_sharded=layout == "fully-sharded")
                  for layout in ("fully-sharded", "default")}
        groups[f"sp={sp}"] = time_side_by_side(clock, f"TP=2{' +SP' if sp else ''}",
                                               {k: timed_model_step(m, batch)
                                                for k, m in models.items()},
                                               s.rounds, s.warmup)
    if torch.distributed.get_rank() == 0:  # ranks time the same lockstep steps
        Path(result_file).write_text(json.dumps(groups))
    mm.destroy_parallel(destroy_process_group=True)


def run_tp(s: Settings, clock: Clock) -> tuple[Optional[dict], Optional[str]]:
    """The TP groups from a 2-process torchrun of this script, or why they were skipped."""
    if s.skip_tp:
        return None, "skipped: --skip-tp"
    if s.device == "cuda" and torch.cuda.device_count() < 2:
        return None, f"skipped: TP=2 needs 2 GPUs, found {torch.cuda.device_count()}"
    if s.device == "cuda" and transformer_engine_usable():
        return None, ("skipped: fully_sharded needs megatron's own parallel linears, and "
                      "build_gpt_model uses Transformer Engine's here")
    return torchrun_two(s, clock, "--tp-worker", "TP=2")


def torchrun_two(s: Settings, clock: Clock, worker_flag: str, what: str,
                 worker_args: Optional[list[str]] = None) -> tuple[Optional[dict], Optional[str]]:
    """Run this script's ``worker_flag`` worker in 2 processes under torchrun (1 torch thread
    each: they share the cores); returns what rank 0 wrote, or why there is nothing."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        return None, f"skipped: {torchrun} not found"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "0",
               __file__, worker_flag, "--settings-json", json.dumps(dataclasses.asdict(s)),
               "--result-file", str(out), *(worker_args or [])]
        clock.say(f"launching 2 processes for {what}: " + " ".join(cmd[:5]) + f" ... {worker_flag}")
        env = {**child_env(), "OMP_NUM_THREADS": "1"}  # 2 processes share the cores
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        tail: list[str] = []
        for line in proc.stdout:
            print("    " + line.rstrip(), flush=True)
            tail = (tail + [line.strip()])[-20:]
        if proc.wait() != 0 or not out.exists():
            reason = next((t for t in reversed(tail) if "Error" in t), tail[-1] if tail else "")
            return None, f"skipped: the {what} run failed (exit {proc.returncode}): {reason[:200]}"
        return json.loads(out.read_text()), None


# ----- pipeline parallelism ---------------------------------------------------------------

PP_LAYOUTS = {"PP=2": 2, "DP=2": 1}  # the 2-process layouts: name -> pipeline size
PP_ROUNDS_PER_BLOCK = 3


def pp_model_config(s: Settings) -> mm.GPTModelConfig:
    """The dense model of rows 1c-2c, one layer more if needed to split into 2 stages."""
    cfg = model_config("dense", s)
    return dataclasses.replace(cfg, num_layers=cfg.num_layers + cfg.num_layers % 2)


def pp_examples_per_slot(s: Settings) -> int:
    """``examples_per_slot`` rounded up to even: each DP=2 rank gets half of every slot's."""
    return s.examples_per_slot + s.examples_per_slot % 2


def pp_data(s: Settings, vocab: int) -> tuple[list[list[Example]], int]:
    """One step's global batch (every slot's examples, all of one length) and the token
    budget that packs it into ``pp_micro_batches`` micro-batches."""
    gen = torch.Generator().manual_seed(2)
    data = [random_examples(pp_examples_per_slot(s), s.example_tokens, vocab, gen)
            for _ in range(s.slots)]
    per_batch = -(-s.slots * pp_examples_per_slot(s) // s.pp_micro_batches)
    return data, per_batch * (s.example_tokens - 1)


def pp_trainer_step(s: Settings) -> Callable[[], StepResult]:
    """The package's trainer step of every slot on this rank's share of the global batch,
    under the layout ``init_parallel`` set up (pipeline stages; the rest of the world is
    data-parallel). Packing is part of the step."""
    cfg = pp_model_config(s)
    data, budget = pp_data(s, cfg.vocab_size)
    model = [build_model(cfg, s, s.slots)]  # this rank's stage (the whole model at PP=1)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    examples = [shard_for_data_parallel(exs, dp_rank, dp_size) for exs in data]  # as the trainer
    train = SlotTrainStep(model, s.slots, budget, pad_multiple=1, pad_id=0)
    steps = 10 ** 6  # constant schedule: the count only bounds the lr schedule
    opts = {j: start_job(model, j, make_job(j, s), steps, cfg) for j in range(s.slots)}
    return lambda: train(examples, opts)


def pp_timed(clock: Clock, step: Callable[[], StepResult]) -> tuple[float, list[float]]:
    """Seconds of one lockstep step (both ranks start together after a barrier, the slower
    one counts) and its per-job losses."""
    torch.distributed.barrier()
    start = clock.now()
    result = step()
    elapsed = torch.tensor([clock.now() - start], dtype=torch.float64)
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return float(elapsed), result.losses.tolist()


def pp_blocks(s: Settings) -> list[int]:
    """The rounds of each block: ``rounds`` in blocks of ``PP_ROUNDS_PER_BLOCK``."""
    return [min(PP_ROUNDS_PER_BLOCK, s.rounds - done)
            for done in range(0, s.rounds, PP_ROUNDS_PER_BLOCK)]


def pp_block(s: Settings, clock: Clock, layouts: dict[str, int], block: int
             ) -> dict[str, dict[str, list[float]]]:
    """One block of rounds of each layout (name -> pipeline size), one after another: build
    it, run ``max(2, warmup)`` untimed steps, time the block's rounds, tear it down. Returns
    the times and each layout's second-step losses (after one update: do the layouts train
    alike?)."""
    rounds = pp_blocks(s)[block]
    out: dict[str, dict[str, list[float]]] = {"samples": {}, "check_losses": {}}
    for name, pipeline in layouts.items():
        mm.init_parallel(pipeline_model_parallel_size=pipeline, seed=0)
        step = pp_trainer_step(s)
        timed = [pp_timed(clock, step) for _ in range(max(2, s.warmup) + rounds)]
        mm.destroy_parallel()
        out["check_losses"][name] = timed[1][1]
        out["samples"][name] = [elapsed for elapsed, _ in timed[max(2, s.warmup):]]
        clock.say(f"PP block {block + 1}/{len(pp_blocks(s))} {name}: "
                  + ", ".join(f"{x * 1e3:.1f}" for x in out["samples"][name]) + " ms")
    return out


def pp_worker(s: Settings, result_file: str, block: int) -> None:
    """Run under torchrun with 2 processes: one block of PP=2 and DP=2 rounds (in alternating
    order from block to block)."""
    names = list(PP_LAYOUTS) if block % 2 == 0 else list(reversed(PP_LAYOUTS))
    out = pp_block(s, Clock(torch.device(s.device)), {n: PP_LAYOUTS[n] for n in names}, block)
    if torch.distributed.get_rank() == 0:  # both ranks hold the same (MAX-reduced) times
        Path(result_file).write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def run_pp(s: Settings, clock: Clock) -> tuple[Optional[dict], Optional[str]]:
    """PP=1 on this one process (its ``threads``) and PP=2 vs DP=2 in 2 processes (a fresh
    torchrun of this script per block), block by block in alternating order; or why they
    were skipped."""
    if s.skip_pp:
        return None, "skipped: --skip-pp"
    if s.device == "cuda" and torch.cuda.device_count() < 2:
        return None, f"skipped: PP=2 needs 2 GPUs, found {torch.cuda.device_count()}"
    result: dict[str, dict[str, list[float]]] = {"samples": {}, "check_losses": {}}
    blocks = pp_blocks(s)
    for b in range(len(blocks)):
        for part in ("here", "there") if b % 2 == 0 else ("there", "here"):
            if part == "here":
                clock.say(f"PP block {b + 1}/{len(blocks)}: PP=1 on this process")
                got = pp_block(s, clock, {"PP=1 one process": 1}, b)
            else:
                got, skipped = torchrun_two(s, clock, "--pp-worker",
                                            f"PP=2 vs DP=2 (block {b + 1}/{len(blocks)})",
                                            ["--pp-block", str(b)])
                if got is None:
                    return None, skipped
            for name, times in got["samples"].items():
                result["samples"].setdefault(name, []).extend(times)
            for name, losses in got["check_losses"].items():
                result["check_losses"].setdefault(name, losses)  # the first block's
    mm.init_parallel(seed=0)  # this process's layout again, as before the section
    return result, None


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


# ----- rows, report -----------------------------------------------------------------------

def timing_rows(group: str, kind: str, s: Settings, med: dict[str, float],
                naive: bool) -> list[Row]:
    """Rows 1, 2 (and 3 for layers) of one group of timed variants, in ms."""
    n = s.slots
    index = {"layer dense": "a", "layer MoE": "b", "model dense": "c", "model MoE": "d"}[group]
    lora, rows = f"lora-{n}", []
    rows.append(Row(f"1{index}", f"{group}: {n} slots vs 1 slot", (
        f"{kind} step with the same tokens spread over {n} adapter slots vs all in 1 slot "
        "(what training many adapters at once costs over one)"), f"{n} slots", "1 slot", "ms"))
    leaf = "the embedding output" if group.startswith("model") else "the layer input"
    rows.append(Row(f"2{index}", f"{group}: multi-LoRA vs frozen base", (
        f"{kind} step with {n} slots vs the same step without adapters: all weights frozen "
        f"and {leaf} requiring grad, so backward computes input gradients through every "
        "frozen layer but no weight gradients"), f"{n} slots", "base", "ms"))
    rows[0].fill(med[lora] * 1e3, med["lora-1"] * 1e3)
    rows[1].fill(med[lora] * 1e3, med["base"] * 1e3)
    if naive:
        unit = "(slot, expert) pair" if "MoE" in group else "slot"
        rows.append(Row(f"3{index}", f"{group}: grouped GEMMs vs naive loop", (
            f"{kind} step with {n} slots: the grouped LoRA GEMMs vs the base plus a Python loop "
            f"of two matmuls per {unit} (PEFT-style)"), "grouped", "naive loop", "ms").fill(
            med[lora] * 1e3, med[f"naive-{n}"] * 1e3))
    return rows


def memory_row(s: Settings, probes: dict[str, list[dict]]) -> Row:
    peak = {v: statistics.median(p["peak_bytes"] for p in ps) / MiB for v, ps in probes.items()}
    n = str(s.slots)
    row = Row("5", f"peak memory: {n} slots vs 1 slot", (
        "peak memory of 2 training steps (fwd+bwd+AdamW state) of the dense model, above the "
        "frozen base's own fwd+bwd peak (a fresh process per variant"
        + (f", median of {s.memory_probes}" if s.memory_probes > 1 else "") + "; "
        + ("torch.cuda.max_memory_allocated" if s.device == "cuda" else
           "peak bytes held by tensors, from torch's profiler memory timeline") + ")"),
        f"{n} slots", "1 slot", "MiB").fill(peak[n] - peak["base"], peak["1"] - peak["base"])
    ref = probes["1"][0]
    state = {k: adapter_state_bytes(ref, int(k)) / MiB for k in ("1", n)}
    row.note = (
        f"The base alone peaks at {peak['base']:.1f} MiB. Adapter state (weights + fp32 grads + "
        f"AdamW moments), analytic: {state['1']:.2f} MiB for 1 slot, {state[n]:.2f} MiB for {n}. "
        f"Of the measured {row.b_value:.2f} MiB for 1 slot, {row.b_value - state['1']:.2f} MiB "
        f"is beyond the adapter state: the LoRA path's activations and temporaries. Going "
        f"from 1 to {n} slots adds "
        f"{row.a_value - row.b_value:.2f} MiB measured vs {state[n] - state['1']:.2f} MiB of "
        "adapter state: there is no per-slot copy of the base.")
    return row


def tp_rows(s: Settings, groups: Optional[dict], skipped: Optional[str]) -> list[Row]:
    rows = []
    for suffix, sp in (("a", False), ("b", True)):
        row = Row(f"6{suffix}", f"TP=2{' + SP' if sp else ''}: fully sharded vs default", (
            f"dense model step with {s.slots} slots on 2 tensor-parallel processes"
            f"{' (1 thread each)' if s.device == 'cpu' else ''}"
            f"{' with sequence parallelism' if sp else ''}: fully sharded (S-LoRA) adapter layout "
            "vs the default one (replicated A or B)"), "fully sharded", "default", "ms")
        if groups is None:
            row.skipped = skipped
        else:
            med = medians(groups[f"sp={sp}"])
            row.fill(med["fully-sharded"] * 1e3, med["default"] * 1e3)
        rows.append(row)
    return rows


def pp_rows(s: Settings, result: Optional[dict], skipped: Optional[str]) -> list[Row]:
    cfg = pp_model_config(s)
    layers, e = cfg.num_layers, pp_examples_per_slot(s)
    cpu = s.device == "cpu"
    step = (f"one trainer step of {s.slots} adapter jobs (SlotTrainStep: pack, forward/backward "
            f"of the micro-batches through megatron's schedule, per-slot grad sync, norms, "
            f"AdamW) on the dense GPT with {layers} layers; a global batch of {e} examples of "
            f"{s.example_tokens} tokens per job, packed into micro-batches of at most "
            f"{pp_data(s, cfg.vocab_size)[1]} positions ({s.pp_micro_batches} in all)")
    pp2 = (f"PP=2 runs it on 2 processes ({'1 thread' if cpu else '1 GPU'} each) holding "
           f"{layers // 2} layer{'s' if layers > 2 else ''} each, every micro-batch through "
           "both stages (1F1B schedule)")
    method = (f"The layouts are built in turn, in blocks of {PP_ROUNDS_PER_BLOCK} rounds "
              f"(each after {max(2, s.warmup)} untimed steps) in alternating order: PP=1 in "
              "this process, PP=2 and DP=2 in a fresh 2-process torchrun per block; each "
              "2-process round starts both ranks together and counts the slower")
    one = f"{s.threads} thread{'s' if s.threads > 1 else ''}" if cpu else "1 GPU"
    rows = [
        Row("7a", "PP=2 vs DP=2: trainer step", (
            f"{step}. {pp2}; DP=2 runs it on the same 2 processes, each holding the whole model "
            "and half of every job's examples (gradients summed across them): the same "
            f"{'cores' if cpu else 'GPUs'} used as pipeline stages or as data-parallel ranks. "
            f"{method}"), "PP=2", "DP=2", "ms"),
        Row("7b", "PP=2 vs PP=1 (one process): trainer step", (
            f"the same step: {pp2}, vs 1 process ({one}) holding the whole model and every "
            "example. " + method), "PP=2", "PP=1, 1 process", "ms"),
    ]
    for row, b in zip(rows, ("DP=2", "PP=1 one process")):
        if result is None:
            row.skipped = skipped
            continue
        med = medians(result["samples"])
        row.fill(med["PP=2"] * 1e3, med[b] * 1e3)
        check = result["check_losses"]
        diff = max(abs(x - y) for x, y in zip(check["PP=2"], check[b]))
        row.note = (f"Same training: the {s.slots} per-job losses of the second step (after "
                    f"one optimizer update) differ by at most {diff:.1e} between {row.a} and "
                    f"{row.b}.")
    return rows


def hardware(device: torch.device) -> dict:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), gpu_count=torch.cuda.device_count())
    return info


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "megatron-core": metadata.version("megatron-core")}
    try:
        out["transformer-engine"] = metadata.version("transformer-engine")
    except metadata.PackageNotFoundError:
        pass
    try:  # a machine without git (or a copy without .git) reports no commit
        git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True)
        status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                 "--untracked-files=no"], capture_output=True, text=True)
    except OSError:
        return out
    if git.returncode == 0:
        dirty = " + uncommitted changes" if status.stdout.strip() else ""
        out["git"] = git.stdout.strip() + dirty
    return out


def fmt(value: Optional[float], unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f} s" if unit == "s" else f"{value:.2f} {unit}"


def markdown(meta: dict, rows: list[Row]) -> str:
    hw, ver, s = meta["hardware"], meta["versions"], meta["settings"]
    defaults = dataclasses.asdict(mm.GPTModelConfig())
    device = hw.get("gpu", hw["cpu"])
    lines = [
        f"# multi-LoRA benchmark ({meta['device']})", "",
        f"- hardware: {device}" + (f" (host CPU {hw['cpu']})" if "gpu" in hw else "")
        + f"; {hw['cpu_cores']} CPU cores; torch threads: {hw['torch_threads']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in ver.items()),
        f"- dtype {s['dtype']}; load average (1, 5, 15 min) at start {meta['load_start']}, at end "
        f"{meta['load_end']}; total run time {meta['runtime_s']:.0f} s",
        "- sections: " + ", ".join(
            f"{name} ({'FAILED' if name in meta['failed'] else 'done'})"
            for name in meta["sections_done"]) + "".join(
            f", {name} (not run yet)" for name in meta["sections"][len(meta["sections_done"]):]),
        "- settings: " + ", ".join(f"{k}={v}" for k, v in s.items()),
        *(f"- whole model {kind}: GPTModelConfig("
          + ", ".join(f"{k}={v}" for k, v in cfg.items() if defaults.get(k) != v)
          + "), other fields at their defaults (full configs in the JSON)"
          for kind, cfg in meta["models"].items()),
        "- method: every time is the median over the rounds; each round runs every variant of "
        "its group once, in turn, in one process, so machine noise hits all alike. A / B is the "
        "ratio of the medians.", "",
        "| row | comparison | A | B | median A | median B | A / B |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else (r.skipped or "-")
        lines.append(f"| {r.id} | {r.title} | {r.a} | {r.b} | {fmt(r.a_value, r.unit)} | "
                     f"{fmt(r.b_value, r.unit)} | {ratio} |")
    lines += ["", "What each row measures:", ""]
    lines += [f"- **{r.id}**: {r.what}." + (f" {r.note}" if r.note else "") for r in rows]
    return "\n".join(lines) + "\n"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


@dataclasses.dataclass
class Results:
    """What the sections measured so far (the report is rewritten from it after each one)."""

    rows: list[Row] = dataclasses.field(default_factory=list)
    samples: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)
    probes: dict[str, list[dict]] = dataclasses.field(default_factory=dict)
    peers: Optional[dict] = None
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # section -> error


def section_layers_models(section: str, s: Settings, device: torch.device, clock: Clock,
                          out: Results) -> None:
    for group, kind, make, naive in (
            ("layer dense", "one column-parallel linear's", dense_layer_variants, True),
            ("layer MoE", "one grouped expert linear's", moe_layer_variants, True),
            ("model dense", "dense GPT", lambda s_, d: model_variants("dense", s_, d), False),
            ("model MoE", "MoE GPT", lambda s_, d: model_variants("moe", s_, d), False)):
        if ("layers" if group.startswith("layer") else "models") != section:
            continue
        clock.say(f"{group}: building")
        out.samples[group] = time_side_by_side(clock, group, make(s, device), s.rounds, s.warmup)
        out.rows += timing_rows(group, kind, s, medians(out.samples[group]), naive)


def section_jobs(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    clock.say(f"jobs: {s.slots} jobs together vs one after another")
    out.samples["jobs"] = time_side_by_side(clock, "jobs", jobs_variants(s, device), s.job_rounds, 1)
    med = medians(out.samples["jobs"])
    job_row = Row("4", f"{s.slots} jobs together vs one after another", (
        f"total wall time to train {s.slots} adapter jobs for {s.job_steps} steps each "
        f"({s.examples_per_slot} examples of {s.example_tokens} tokens per job per step): "
        f"together on one {s.slots}-slot model (one packed micro-batch per step, then every "
        "slot's optimizer step; attention runs per packed example) vs one after another on "
        "a 1-slot model (same base); packing done beforehand, not timed"), "together",
        "one after another", "s").fill(med["together"], med["one-after-another"])
    job_row.note = f"Speedup of training together: {1 / job_row.ratio:.2f}x."
    out.rows.append(job_row)


def section_memory(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    clock.say("memory probes (fresh processes)")
    out.probes = run_memory_probes(s, clock)
    out.rows.append(memory_row(s, out.probes))


def section_tp(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    tp_groups, tp_skipped = run_tp(s, clock)
    if tp_groups:
        out.samples.update({f"TP=2 {k}": v for k, v in tp_groups.items()})
    out.rows += tp_rows(s, tp_groups, tp_skipped)


def section_pp(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    pp_result, pp_skipped = run_pp(s, clock)
    if pp_result:
        out.samples["trainer step PP"] = pp_result["samples"]
    out.rows += pp_rows(s, pp_result, pp_skipped)


def section_scaling(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    import bench_scale

    clock.say(f"scaling: trainer step with {bench_scale.SCALE_SLOTS} slots: building")
    out.samples["scaling"] = time_side_by_side(clock, "scaling", bench_scale.scaling_variants(
        s, device), s.rounds, s.warmup)
    out.rows += bench_scale.scaling_rows(s, medians(out.samples["scaling"]))


def section_width(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    import bench_scale

    clock.say(f"width: SmolLM2-135M shape, {s.width_layers} layers: building")
    out.samples["width"] = time_side_by_side(clock, "width", bench_scale.width_variants(
        s, device), s.width_rounds, max(1, s.warmup))
    out.rows += [bench_scale.width_row(s, medians(out.samples["width"]))]


def section_peers(s: Settings, device: torch.device, clock: Clock, out: Results) -> None:
    import bench_peers

    out.peers = bench_peers.run_peers(s.peer_steps, s.peer_rounds, clock.say)
    out.rows += bench_peers.peers_rows(out.peers, Row)


RUN_SECTION = {
    "layers": lambda s, d, c, o: section_layers_models("layers", s, d, c, o),
    "models": lambda s, d, c, o: section_layers_models("models", s, d, c, o),
    "jobs": section_jobs, "memory": section_memory, "tp": section_tp, "pp": section_pp,
    "scaling": section_scaling, "width": section_width, "peers": section_peers,
}


def model_configs(s: Settings, sections: tuple[str, ...]) -> dict[str, dict]:
    """The whole-model configs the report lists (those of the sections run)."""
    models = {k: dataclasses.asdict(model_config(k, s)) for k in ("dense", "moe")}
    if "pp" in sections:
        models["dense (rows 7)"] = dataclasses.asdict(pp_model_config(s))
    if "width" in sections:
        import bench_scale

        models["SmolLM2-135M shape (row 9)"] = dataclasses.asdict(bench_scale.width_config(s))
    return models


def run_benchmark(s: Settings, out_dir: Path, sections: tuple[str, ...] = SECTIONS) -> list[str]:
    """Run ``sections`` (all by default); a partial run writes ``<name>-only-<sections>.md`` /
    ``.json``. The report is rewritten after every section, so a section that fails (its
    error becomes a row, the next section runs) or a run cut short keeps every figure
    measured before. Returns the sections that failed."""
    device = torch.device(s.device)
    clock = Clock(device)
    mm.init_parallel(seed=0)
    hw, ver = hardware(device), versions()
    clock.say(f"{hw.get('gpu', hw['cpu'])}, {hw['cpu_cores']} cores, {hw['torch_threads']} "
              f"threads; " + ", ".join(f"{k} {v}" for k, v in ver.items()))
    clock.say(f"settings: {dataclasses.asdict(s)}; sections: {', '.join(sections)}")
    meta = {"device": device.type, "hardware": hw, "versions": ver,
            "settings": dataclasses.asdict(s), "sections": list(sections),
            "models": model_configs(s, sections), "load_start": load_average()}
    name = ("gpu" if device.type == "cuda" else "cpu") + (
        "" if tuple(sections) == SECTIONS else "-only-" + "-".join(sections))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = Results()
    for k, section in enumerate(sections):
        try:
            RUN_SECTION[section](s, device, clock, out)
        except Exception as e:  # the next sections still run; the report says what failed
            traceback.print_exc()
            out.failed[section] = f"{type(e).__name__}: {e}"[:300]
            out.rows.append(Row(section, f"section {section}", f"the {section} section", "-", "-",
                                "ms", skipped=f"FAILED ({out.failed[section]})"))
        meta.update(sections_done=list(sections[:k + 1]), failed=out.failed,
                    load_end=load_average(), runtime_s=time.perf_counter() - clock.start)
        text = markdown(meta, out.rows)
        (out_dir / f"{name}.md").write_text(text)
        (out_dir / f"{name}.json").write_text(json.dumps(
            {"meta": meta, "rows": [dataclasses.asdict(r) for r in out.rows],
             "samples_s": out.samples, "memory_probes": out.probes,
             **({"peers": out.peers} if out.peers else {})}, indent=1))
        clock.say(f"section {section} {'FAILED' if section in out.failed else 'done'}: "
                  f"wrote {out_dir / name}.md and .json")
    mm.destroy_parallel(destroy_process_group=True)
    print(text, flush=True)
    return list(out.failed)


def parse_settings(argv: Optional[list[str]] = None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"],
                        help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds (smoke run)")
    parser.add_argument("--skip-tp", action="store_true", help="skip the 2-process TP rows")
    parser.add_argument("--skip-pp", action="store_true", help="skip the 2-process PP rows")
    parser.add_argument("--only", nargs="+", choices=ALL_SECTIONS, metavar="SECTION",
                        help="run only these sections (" + ", ".join(ALL_SECTIONS) + "; peers "
                             "runs only when named here); writes "
                             "<out-dir>/cpu-only-<sections>.md and .json instead of cpu.md")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch CPU threads (default: torch's, %(default)s); 1 is steadier "
                             "on a machine other jobs load")
    for key, value in FULL.items():
        parser.add_argument("--" + key.replace("_", "-"), type=int,
                            help=f"default {value} ({QUICK[key]} with --quick)")
    # Internal: how this script runs its own child processes.
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    parser.add_argument("--tp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pp-block", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--settings-json", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.settings_json:
        return Settings(**json.loads(args.settings_json)), args
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    sizes = QUICK if args.quick else FULL
    values = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in sizes.items()}
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return Settings(device=args.device, dtype=dtype, threads=args.threads, quick=args.quick,
                    skip_tp=args.skip_tp, skip_pp=args.skip_pp, **values), args


def main() -> None:
    mm.support_megatron_here()
    settings, args = parse_settings()
    if not (args.tp_worker or args.pp_worker):  # workers take OMP_NUM_THREADS=1 from torchrun
        torch.set_num_threads(settings.threads)
    if args.memory_probe:
        Path(args.result_file).write_text(json.dumps(memory_probe(settings, args.memory_probe)))
    elif args.tp_worker:
        tp_worker(settings, args.result_file)
    elif args.pp_worker:
        pp_worker(settings, args.result_file, args.pp_block)
    else:
        sections = tuple(s for s in ALL_SECTIONS if s in args.only) if args.only else SECTIONS
        if run_benchmark(settings, args.out_dir, sections):
            sys.exit(1)


if __name__ == "__main__":
    # scripts/bench_scale.py imports this module as `bench`: let it find this one.
    sys.modules.setdefault("bench", sys.modules[__name__])
    main()
