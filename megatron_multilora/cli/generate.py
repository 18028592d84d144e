"""``mmlora generate --adapter DIR "PROMPT" ...``: greedy generations of a PEFT export on its
base model (transformers + peft), each prompt in the format the adapter trained on
(``checkpoint/prompt_format.py``): the tokenizer's BOS before a prompt, or with ``--chat``
the chat template of one user message."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_multilora.cli.command import CommandError, Commands


def generate(args: argparse.Namespace) -> int:
    config_file = args.adapter / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as err:
        raise CommandError(
            f"--adapter {args.adapter}: not a PEFT folder ({config_file}: {err}); give a folder "
            "a run wrote under <run_dir>/peft/ or one `mmlora export` wrote"
        ) from None
    base = args.base or config.get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise CommandError(
            f"--adapter {args.adapter}: its base model {base!r} is not a local folder; give "
            "the base's Hugging Face folder with --base"
        )
    # Imported here: the other commands stay free of torch and transformers.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_multilora.data.record_forms import prompt_ids
    from megatron_multilora.data.tokenizer import HFTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(args.adapter))
    model.eval()
    ours = HFTokenizer(tok)
    for prompt in args.prompts:
        record = [{"role": "user", "content": prompt}] if args.chat else prompt
        ids = prompt_ids(record, ours)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=ours.eos_id,
                pad_token_id=ours.pad_id,
            )
        print(
            json.dumps(
                {
                    "prompt": prompt,
                    "completion": tok.decode(out[0, len(ids) :], skip_special_tokens=True),
                }
            )
        )
    return 0


def add_commands(commands: Commands) -> None:
    sub = commands.add(
        "generate", generate, "greedy generations of a PEFT export, prompts as it trained on them"
    )
    sub.add_argument("--adapter", type=Path, required=True, help="a PEFT folder")
    sub.add_argument("prompts", nargs="+", metavar="PROMPT", help="a record's prompt")
    sub.add_argument(
        "--base", default=None, help="the base model's folder (default: the adapter's recorded one)"
    )
    sub.add_argument(
        "--chat", action="store_true", help="each prompt as one user message of a chat record"
    )
    sub.add_argument("--max-new-tokens", type=int, default=32)
