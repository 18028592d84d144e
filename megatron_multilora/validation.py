"""What a run's settings must satisfy, each rule written once. Torch-free: everything here is
checked before anything is built or written.

* **Ranges of single settings**: a :class:`Rule` rides on each schema field (``ranged``),
  and :func:`schema_problems` checks a whole config against them, naming the full key, the
  value and what is allowed (the config check, ``mmlora submit``, the model builder).
* **The parallel layout against the world size** (:func:`layout_problems`): the config check
  and :func:`~megatron_multilora.parallel.init_parallel`.
* **A model's shape against the layout** (:func:`model_layout_problems`): the config check
  and the model builder.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

# Names settings take, shared by the config schema and the layers that use them.
INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
"""How a LoRA factor is initialised."""
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linears multi-LoRA wraps by name by default (wildcard patterns over module paths also
work). ``linear_qkv`` and ``linear_proj`` stand for every attention's input and output
projections: multi-latent attention's and a Gated DeltaNet's (``in_proj``, ``out_proj``) too."""
PEFT_TARGETS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "q_proj": (("linear_qkv", "q"), ("linear_q_proj", None)),
    "k_proj": (("linear_qkv", "k"),),
    "v_proj": (("linear_qkv", "v"),),
    "qkv_proj": (("linear_qkv", None),),
    "o_proj": (("linear_proj", None),),
    "gate_proj": (("linear_fc1", "gate"),),
    "up_proj": (("linear_fc1", "up"),),
    "gate_up_proj": (("linear_fc1", None),),
    "down_proj": (("linear_fc2", None),),
    "w1": (("linear_fc1", "gate"),),
    "w3": (("linear_fc1", "up"),),
    "w2": (("linear_fc2", None),),
    "q_a_proj": (("linear_q_down_proj", None),),
    "q_b_proj": (("linear_q_up_proj", None),),
    "kv_a_proj_with_mqa": (("linear_kv_down_proj", None),),
    "kv_b_proj": (("linear_kv_up_proj", None),),
    "lm_head": (("output_layer", None),),
    "in_proj_qkv": (("in_proj", "qkv"),),
    "in_proj_z": (("in_proj", "z"),),
    "in_proj_b": (("in_proj", "b"),),
    "in_proj_a": (("in_proj", "a"),),
    "out_proj": (("out_proj", None),),
}
"""The module names PEFT users write, as the megatron linears they are (or are part of:
q/k/v of the fused ``linear_qkv``, gate/up of a gated ``linear_fc1``, the parts of a Gated
DeltaNet's ``in_proj``; None: all of it). An
MLA model's ``q_proj`` (no q down-projection) is its ``linear_q_proj``."""
MLA_INPUT_PROJECTIONS = (
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
"""Multi-latent attention's (DeepSeek-V3) counterparts of ``linear_qkv``: what that target
adapts in an MLA model, so the default targets fit every family."""
DELTA_NET_LINEARS = ("in_proj", "out_proj")
"""A Gated DeltaNet's (Qwen3.5's linear attention) counterparts of ``linear_qkv`` and
``linear_proj``."""
TARGET_NAMES = (
    *TARGETS,
    "output_layer",
    *PEFT_TARGETS,
    *MLA_INPUT_PROJECTIONS,
    *DELTA_NET_LINEARS,
)
"""What lora.targets may name: those, the output layer (the unembedding), and PEFT's names."""
SCHEDULES = ("constant", "linear", "cosine")
"""Learning-rate schedules after warmup."""


@dataclasses.dataclass(frozen=True)
class Rule:
    """``ok(value)`` must hold; ``allowed`` says what is, in words; ``optional``: null too."""

    allowed: str
    ok: Callable[[Any], bool]
    optional: bool = False

    def problem(self, key: str, value: Any) -> str | None:
        try:
            fine = self.optional if value is None else self.ok(value)
        except TypeError:
            fine = False
        if fine:
            return None
        return f"{key}={value!r}: must be {self.allowed}{' (or null)' if self.optional else ''}"


def at_least(low: float, optional: bool = False) -> Rule:
    return Rule(f">= {low}", lambda v: v >= low, optional)


def positive(optional: bool = False) -> Rule:
    return Rule("> 0", lambda v: v > 0 and math.isfinite(v), optional)


def within(low: float, high: float, optional: bool = False) -> Rule:
    """``low <= value < high``."""
    return Rule(f"in [{low}, {high})", lambda v: low <= v < high, optional)


def one_of(*values: Any) -> Rule:
    named = [v for v in values if v is not None]
    return Rule(f"one of {', '.join(repr(v) for v in named)}", lambda v: v in named, None in values)


def ranged(default: Any, rule: Rule) -> Any:
    """A dataclass field with ``default`` whose values ``rule`` checks."""
    return dataclasses.field(default=default, metadata={"rule": rule})


def schema_problems(config: Any, prefix: str = "", skip: tuple[str, ...] = ()) -> list[str]:
    """Every value of ``config`` (a dataclass, nested dataclasses and lists of them; not the
    fields in ``skip``) that breaks its field's rule, by full key (e.g.
    ``adapters.0.grad_clip=-1.0: must be > 0``)."""
    problems = []
    for field in dataclasses.fields(config):
        if field.name in skip:
            continue
        key, value = f"{prefix}{field.name}", getattr(config, field.name)
        rule = field.metadata.get("rule")
        if rule is not None and (problem := rule.problem(key, value)):
            problems.append(problem)
        if dataclasses.is_dataclass(value):
            problems += schema_problems(value, key + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    problems += schema_problems(item, f"{key}.{i}.")
    return problems


# The layout's sizes as the config names them and as init_parallel's arguments do.
CONFIG_NAMES = {
    "tp": "parallel.tp",
    "ep": "parallel.ep",
    "pp": "parallel.pp",
    "vpp": "parallel.vpp",
    "sp": "parallel.sp",
}
INIT_NAMES = {
    "tp": "tensor_model_parallel_size",
    "ep": "expert_model_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "vpp": "virtual_pipeline_model_parallel_size",
    "sp": "sequence_parallel",
}


def layout_problems(
    world: int, tp: int, ep: int, pp: int, sp: bool, vpp: int | None, names: dict[str, str]
) -> list[str]:
    """What keeps the layout from running on ``world`` processes (``names``: how to call the
    sizes, :data:`CONFIG_NAMES` or :data:`INIT_NAMES`)."""
    n = names
    low = [
        f"{n[k]}={v}" for k, v in (("tp", tp), ("ep", ep), ("pp", pp), ("vpp", vpp or 1)) if v < 1
    ]
    if low:
        return [f"{', '.join(low)}: must be at least 1"]
    problems = []
    if world % (tp * pp):
        problems.append(f"{n['tp']}={tp} x {n['pp']}={pp} must divide the world size {world}")
    elif (world // pp) % ep:  # megatron's expert grid lies within each pipeline stage
        problems.append(
            f"{n['ep']}={ep} must divide the {world // pp} processes of each "
            f"pipeline stage (world size {world} / {n['pp']}={pp})"
        )
    if sp and tp == 1:
        problems.append(f"{n['sp']}=true needs {n['tp']} > 1")
    if vpp is not None and pp == 1:
        problems.append(f"{n['vpp']}={vpp} needs {n['pp']} > 1; without pipelining leave it null")
    return problems


def model_layout_problems(model: Any, tp: int, pp: int, vpp: int | None, ep: int) -> list[str]:
    """What keeps ``model`` (a ``GPTModelConfig``) from splitting over the layout."""
    problems = model.check(max(tp, 1), max(pp, 1), vpp if (vpp or 0) >= 1 else None)
    if model.num_moe_experts is not None and ep >= 1 and model.num_moe_experts % ep:
        problems.append(
            f"num_moe_experts={model.num_moe_experts} is not divisible by expert parallel size {ep}"
        )
    return problems
