"""Benchmarks of multi-LoRA training: layers, whole models, jobs together, memory, TP and PP
layouts, and what a user would run instead.

    .venv/bin/python -m benchmarks [--device cpu|cuda] [--out-dir benchmarks] [--quick]
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
  7a-7b  one trainer step (SlotStep.train: pack, forward/backward through megatron's schedule,
         grad sync, norms, optimizer) of the dense GPT on two pipeline stages (PP=2, two
         processes) vs the same two processes as data-parallel ranks (DP=2), and vs one process
         holding the whole model (PP=1); same jobs, data and micro-batch budget
  8a-8c  one trainer step of the dense GPT with 8, 32, 64 slots vs 1 slot, the same 64
         examples spread over the slots (scaling.py)
  9      the multi-LoRA step vs the frozen base step at a real model's width (SmolLM2-135M's
         geometry, random weights; ``--width-layers`` of its 30 layers)
  10a-10k (section ``peers``, only with ``--only peers``) what a user would run instead: the
         recipe training conf/jobs/demo4.yaml's 4 jobs at once (torchrun, 2 processes x 1
         thread) vs transformers + peft training them one after another in one process (1 and
         2 threads) and vs 2 independent peft processes at once; training wall, CPU seconds and
         each job's held-out loss; the recipe on one core vs peft's loop (10g-10h); one global
         step on one core part by part, ours vs peft (10i-10k) (peers/;
         ``--peer-steps``, ``--peer-rounds``)

``--only SECTION ...`` runs some sections (layers, models, jobs, memory, tp, pp, scaling, width,
peers; all but peers run by default) and writes
``<out-dir>/cpu-only-<sections>.md`` (``gpu-...``) and ``.json``, leaving the full report alone.

On CUDA the model is bf16 and built by ``mm.build_gpt_model``, which uses Transformer Engine
when it is installed; layer rows use megatron's ColumnParallelLinear and the pure-torch
grouped expert linear on both devices.

One module a section (``layers_and_models``, ``jobs``, ``memory``, ``tensor_parallel``,
``pipeline_parallel``, ``scaling``, ``peers/``), each with its rows and a ``section``
function; ``workloads`` builds what they time with the package's own builders
(``build_gpt_model``, ``apply_multi_lora``, ``start_job``, ``SlotStep``); ``run`` runs
the sections and rewrites the report (``report``) after each. ``recipe_step`` times the
recipe's step for A/B runs across commits.
"""
