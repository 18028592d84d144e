"""Greedy generations of a base model next to each PEFT adapter's, loaded with peft.

    .venv/bin/python scripts/compare_generations.py data/smollm2-135m-instruct \
        runs/smollm2/peft/* [--eval-files data/demo-words/*.eval.jsonl [--per-file 2]]
        [--prompts "apple river stone =" ...] [--max-new-tokens 8]

Prompts are formatted as the trainer formats prompt/completion samples (bos + prompt). With
``--eval-files`` the first ``--per-file`` records of each file are used, and each generation
equal to the record's completion (the recipe's exact match) is marked ``*``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_PROMPTS = ["apple river stone =", "moon king lamp =", "hello=", "12+7="]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("adapters", type=Path, nargs="+")
    parser.add_argument("--prompts", nargs="+", default=None)
    parser.add_argument(
        "--eval-files",
        type=Path,
        nargs="+",
        default=[],
        help="JSONL prompt/completion files to take prompts and answers from",
    )
    parser.add_argument("--per-file", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    # Everything is local: without this transformers and peft look up the hub first, and an
    # offline machine waits minutes for network timeouts.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_multilora.data.datasets import read_records
    from megatron_multilora.data.demo_tasks import exact_match
    from megatron_multilora.data.tokenizer import HFTokenizer

    rows: list[tuple[str, str | None]] = [(p, None) for p in args.prompts or []]
    for path in args.eval_files:
        rows += [(r["prompt"], r["completion"]) for r in read_records(path)[: args.per_file]]
    rows = rows or [(p, None) for p in DEFAULT_PROMPTS]
    tok = HFTokenizer(AutoTokenizer.from_pretrained(args.base))
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()

    prompt_ids = [[tok.bos_id] + tok.encode(prompt) for prompt, _ in rows]
    longest = max(len(ids) for ids in prompt_ids)
    # One left-padded batch (transformers derives positions from the attention mask).
    batch = torch.tensor([[tok.pad_id] * (longest - len(ids)) + ids for ids in prompt_ids])
    mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in prompt_ids])

    @torch.no_grad()
    def generate(model) -> list[str]:
        out = model.generate(
            input_ids=batch,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=tok.eos_id,
            pad_token_id=tok.pad_id,
        )
        outs = []
        for (_, answer), new in zip(rows, out[:, longest:].tolist()):
            text = tok.decode(new)
            mark = "*" if answer is not None and exact_match(text, answer) else ""
            outs.append(text.strip().replace("\n", "\\n") + mark)
        return outs

    columns = {"base": generate(base)}
    for folder in args.adapters:
        model = peft.PeftModel.from_pretrained(base, str(folder)).eval()
        columns[folder.name] = generate(model)
        base = model.unload()  # back to the plain base for the next adapter
    # One block per prompt, one line per model: the generations are too wide for columns.
    width = max(len(name) for name in columns)
    for i, (prompt, answer) in enumerate(rows):
        print(f"{prompt!r}" + ("" if answer is None else f"  expected: {answer.strip()!r}"))
        for name, outs in columns.items():
            print(f"  {name:<{width}}  {outs[i]}")
    if any(answer is not None for _, answer in rows):
        print("* = exact match with the expected answer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
