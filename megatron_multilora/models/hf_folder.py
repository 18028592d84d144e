"""What a Hugging Face model folder must hold to be trained on, checked before anything is
built (torch-free, seconds): a readable ``config.json``, complete safetensors files, and
tokenizer files."""

from __future__ import annotations

import json
import os
import struct

from megatron_multilora.models.hf_config import read_hf_config

# Any of these lets transformers' AutoTokenizer load the folder's tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def safetensors_problem(path: str) -> str | None:
    """Why the safetensors file at ``path`` cannot be read whole (None: it can): its header
    must parse and every tensor must lie within the file (a cut-off download does not)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                return f"{path}: its header claims {header_len} bytes but the file has {size}"
            header = json.loads(f.read(header_len))
    except (OSError, struct.error, ValueError) as err:
        return f"{path}: not a readable safetensors file ({type(err).__name__}: {err})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end > size:
        return (
            f"{path}: truncated: its tensors need {8 + header_len + end} bytes, the file has "
            f"{size} (an interrupted download or copy?)"
        )
    return None


def folder_problems(folder: str) -> list[str]:
    """Everything that keeps ``folder`` from loading as a base model (and its tokenizer)."""
    try:
        read_hf_config(folder)
    except (OSError, ValueError) as err:
        return [str(err)]
    problems = []
    weights = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not weights:
        problems.append(f"{folder}: no *.safetensors weights")
    problems += [p for p in (safetensors_problem(os.path.join(folder, f)) for f in weights) if p]
    if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        problems.append(
            f"{folder}: no tokenizer files (any of {', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer with the model (tokenizer.save_pretrained(folder))"
        )
    return problems
