"""The rank and alpha an adapter folder declares, under this project's scale alpha / rank.

Reads only ``adapter_config.json`` (no tensors, no megatron), so config checks can use it.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional


def peft_alpha(config: dict[str, Any]) -> float:
    """The alpha of a PEFT LoRA config under the scale alpha / r: rsLoRA scales by
    lora_alpha / sqrt(r), which equals (lora_alpha * sqrt(r)) / r."""
    alpha = float(config["lora_alpha"])
    return alpha * math.sqrt(int(config["r"])) if config.get("use_rslora") else alpha


def declared_rank_alpha(folder: str | os.PathLike) -> Optional[tuple[int, float]]:
    """(rank, alpha) of an adapter folder in this project's format or PEFT's, or None when
    its config is missing or unreadable (loading the folder names the problem)."""
    try:
        with open(os.path.join(folder, "adapter_config.json")) as f:
            config = json.load(f)
        if "r" in config:  # PEFT
            return int(config["r"]), peft_alpha(config)
        return int(config["rank"]), float(config["alpha"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
