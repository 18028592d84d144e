"""Greedy generations of a base model next to each PEFT adapter's, loaded with peft.

    .venv/bin/python scripts/compare_generations.py data/smollm2-135m-instruct \
        runs/smollm2/peft/* [--prompts "hello=" "12+7="] [--max-new-tokens 8]

Prompts are formatted as the trainer formats prompt/completion samples (bos + prompt).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_PROMPTS = ["hello=", "banana=", "12+7=", "storm=", "48+35="]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("adapters", type=Path, nargs="+")
    parser.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_multilora.data.tokenizer import HFTokenizer

    tok = HFTokenizer(AutoTokenizer.from_pretrained(args.base))
    base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32).eval()

    @torch.no_grad()
    def generate(model) -> list[str]:
        outs = []
        for prompt in args.prompts:
            ids = torch.tensor([[tok.bos_id] + tok.encode(prompt)])
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
            text = tok.decode(out[0, ids.size(1):].tolist()).strip()
            outs.append(text.replace("\n", "\\n")[:24])  # one table row per prompt
        return outs

    columns = {"base": generate(base)}
    for folder in args.adapters:
        model = peft.PeftModel.from_pretrained(base, str(folder)).eval()
        columns[folder.name] = generate(model)
        base = model.unload()  # back to the plain base for the next adapter
    width = max(len(p) for p in args.prompts) + 2
    cell = max(12, max(len(v) for col in columns.values() for v in col) + 2)
    print("prompt".ljust(width) + "".join(name.ljust(cell) for name in columns))
    for i, prompt in enumerate(args.prompts):
        print(prompt.ljust(width) + "".join(col[i].ljust(cell) for col in columns.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
