"""What a folder holds: this project's adapter, a Hugging Face PEFT LoRA adapter, or a
training checkpoint. Every reader asks :func:`folder_format` (or :func:`expect_format`)
rather than probing for files itself, so a wrong folder gets one clear error.
"""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"  # both adapter formats
ADAPTER_TENSORS = "adapter.safetensors"
PEFT_TENSORS = "adapter_model.safetensors"
ADAPTER_FORMAT = "megatron-multilora-adapter"  # the "format" field of this project's config
CHECKPOINT_STATE = "state.pt"  # a training checkpoint folder's state (training.checkpoints)


class FolderFormat(enum.Enum):
    ADAPTER = (
        f"an adapter folder ({CONFIG_FILE} with format {ADAPTER_FORMAT!r} + {ADAPTER_TENSORS})"
    )
    PEFT = f"a PEFT LoRA folder ({CONFIG_FILE} with peft_type + {PEFT_TENSORS})"
    TRAINING_CHECKPOINT = f"a training checkpoint ({CHECKPOINT_STATE})"


_ANY = "; ".join(f.value for f in FolderFormat)


def folder_format(folder: str | Path) -> FolderFormat:
    """Which format ``folder`` holds. Raises ``FileNotFoundError`` (no such folder, or a file
    the format needs is missing) or ``ValueError`` (an unreadable or foreign
    ``adapter_config.json``), naming the folder or file and what each format needs."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (expected one of: {_ANY})")
    if (folder / CHECKPOINT_STATE).is_file():
        return FolderFormat.TRAINING_CHECKPOINT
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{folder} holds no {CONFIG_FILE} or {CHECKPOINT_STATE}: not any of: {_ANY}"
        )
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path}: not valid JSON ({err})") from None
    if isinstance(config, dict) and "format" in config:
        if config["format"] != ADAPTER_FORMAT:
            raise ValueError(
                f"{config_path}: format {config['format']!r} is not {ADAPTER_FORMAT!r}"
            )
        found, tensors = FolderFormat.ADAPTER, ADAPTER_TENSORS
    elif isinstance(config, dict) and "peft_type" in config:
        found, tensors = FolderFormat.PEFT, PEFT_TENSORS
    else:
        raise ValueError(
            f"{config_path}: neither a 'format' nor a 'peft_type' field: not any of: {_ANY}"
        )
    if not (folder / tensors).is_file():
        raise FileNotFoundError(
            f"{folder}: {tensors} is missing ({CONFIG_FILE} says it is {found.value})"
        )
    return found


def expect_format(folder: str | Path, expected: FolderFormat) -> None:
    """Raise unless ``folder`` holds ``expected``, naming what it holds instead."""
    found = folder_format(folder)
    if found is not expected:
        raise ValueError(f"{folder} is {found.value}, not {expected.value}")


def peft_alpha(config: dict[str, Any]) -> float:
    """The alpha of a PEFT LoRA config under this project's scale alpha / r: rsLoRA scales by
    lora_alpha / sqrt(r), which equals (lora_alpha * sqrt(r)) / r."""
    alpha = float(config["lora_alpha"])
    return alpha * math.sqrt(int(config["r"])) if config.get("use_rslora") else alpha


def declared_rank_alpha(folder: str | Path) -> tuple[int, float] | None:
    """(rank, alpha) an adapter folder of either format declares (reading only its config, for
    config checks), or None when the folder is not a readable adapter folder declaring them
    (the caller names the problem)."""
    try:
        found = folder_format(folder)
        if found is FolderFormat.TRAINING_CHECKPOINT:
            return None
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
        if found is FolderFormat.PEFT:
            return int(config["r"]), peft_alpha(config)
        return int(config["rank"]), float(config["alpha"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
