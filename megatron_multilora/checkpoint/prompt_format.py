"""The prompt format an adapter was trained on, said wherever an adapter leaves a run.

Training puts the tokenizer's BOS token (its EOS where it has none) before a
prompt/completion record's prompt and ends the completion with EOS
(``data/record_forms.answer_ids``); a chat record is the tokenizer's chat template of the
conversation, the assistant's turns (headers included) trained. So a prompt is generated from
``bos + prompt``, or from the chat template of the conversation before the answer without a
generation prompt: the adapter writes the assistant's header itself. A plain ``tok(prompt)``
misses the BOS on tokenizers that add none (SmolLM2's), and the adapter then sees a context
it never trained on.
"""

from __future__ import annotations

CARD_FILE = "README.md"


def python_snippet(base: str, adapter: str) -> str:
    """Loading ``adapter`` on ``base`` with transformers + peft and generating in the format
    it trained on."""
    return f"""import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained({base!r})
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {adapter!r})
bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
ids = [bos] + tok.encode("apple river stone =", add_special_tokens=False)  # a record's prompt
# chat records: ids = tok.apply_chat_template(messages_before_the_answer)
out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
print(tok.decode(out[0, len(ids):], skip_special_tokens=True))
"""


def load_hint(base: str, adapter: str) -> str:
    """What a run or ``mmlora export`` prints after writing a PEFT folder."""
    return (
        f"load it with: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("
        f"'{base}'), '{adapter}'); prompts as trained: [bos] + tok.encode(prompt, "
        "add_special_tokens=False) (chat: tok.apply_chat_template(messages)); or "
        f'mmlora generate --adapter {adapter} "PROMPT"; the format: {adapter}/{CARD_FILE}'
    )


def model_card(name: str, base: str, targets: list[str], rank: int, alpha: float) -> str:
    """The ``README.md`` written beside a PEFT export's ``adapter_config.json``."""
    base_or_placeholder = base or "BASE"
    return f"""---
library_name: peft
base_model: {base_or_placeholder}
tags: [lora, megatron-multilora]
---
# {name}

A LoRA adapter (rank {rank}, alpha {alpha:g}, on {", ".join(targets)}) trained with
megatron-multilora on `{base_or_placeholder}`.

## Prompt format

- prompt/completion records were trained as `[bos] + prompt + completion + [eos]`: generate
  from the tokenizer's BOS token (its EOS where it has none) followed by the prompt's tokens,
  without other special tokens.
- chat (`messages`) records were trained on the tokenizer's chat template, the assistant's
  turns (their headers too) learned: generate from the template of the conversation before
  the answer, without a generation prompt.

```python
{python_snippet(base_or_placeholder, ".").rstrip()}
```

Or: `mmlora generate --adapter <this folder> "PROMPT"`.
"""
