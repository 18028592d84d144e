"""One adapter slot <-> a Hugging Face PEFT LoRA folder (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` and vLLM load.

Megatron fuses some linears that HF keeps apart; a fused LoRA has one A and a B whose rows
follow the fused output, so export splits B and repeats A:

* ``linear_qkv`` (rows ``[groups, (q_per_group + 2) * head_dim]``: each group's q heads, then
  its k, then its v) -> ``q_proj``, ``k_proj``, ``v_proj`` (with Qwen3.5's output gate, q_proj
  holds each head's q and gate rows);
* a Gated DeltaNet's ``in_proj`` (rows by key head: :class:`DeltaNetRows`) -> ``in_proj_qkv``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; its ``out_proj`` -> ``out_proj``;
* ``linear_fc1`` (rows ``[gate; up]``) -> ``gate_proj``, ``up_proj`` (Mixtral experts:
  ``w1``, ``w3``); ``linear_fc2`` -> ``down_proj`` (``w2``); ``linear_proj`` -> ``o_proj``;
* expert factors ``[E, ...]`` -> one 2-D pair per expert ``experts.{e}.*``;
* DeepSeek-V3's MLA linears are HF's one to one (its family's ``own_modules``; ``linear_kv_down_proj``
  rows ``[kv_lora_rank; qk_rope_head_dim]`` as ``kv_a_proj_with_mqa``'s);
* Phi-3 keeps them fused too, in Hugging Face's row order: ``linear_qkv`` -> ``qkv_proj``
  (rows ``[q; k; v]``, so B's rows are regrouped), ``linear_fc1`` -> ``gate_up_proj``.

Tensors are cut to the slot's rank; r and lora_alpha are uniform (one rank/alpha per slot),
which is what vLLM needs. Import does the inverse (A of fused parts must be equal; parts an
adapter leaves out get B = 0; rank is padded to the slot's max rank).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megatron_multilora.atomic_files import write_dir_atomic
from megatron_multilora.checkpoint.adapter_folders import (
    CONFIG_FILE,
    PEFT_TENSORS,
    FolderFormat,
    expect_format,
    peft_alpha,
)
from megatron_multilora.checkpoint.files import refuse_existing
from megatron_multilora.checkpoint.prompt_format import CARD_FILE, model_card
from megatron_multilora.layers.factors import A, B
from megatron_multilora.layers.fused_parts import FUSED_PARTS
from megatron_multilora.layers.lifecycle import ModelOrChunks, named_multi_lora_modules
from megatron_multilora.layers.slot_tensors import (
    get_slot_tensors,
    set_slot_tensors,
    slot_rank_alpha,
)
from megatron_multilora.models.families import family_of
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.ops.fused_rows import (
    DELTA_NET_INPUTS,
    DeltaNetRows,
    QKVRows,
    fuse_gate_up,
    split_gate_up,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERTS = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.linear_(fc[12])$")


def hf_module_names(megatron_rest: str, model_type: str) -> list[str] | None:
    """HF module names (below ``model.layers.L.``) a Megatron linear splits into, as its
    family names them (``models/families/``); ``{e}`` stands for the expert index."""
    family = family_of(model_type)
    if megatron_rest in family.fused_modules:
        return [family.fused_modules[megatron_rest]]
    if megatron_rest in family.own_modules:
        return [family.own_modules[megatron_rest]]
    experts = f"{family.moe_block}.experts.{{e}}."
    gate, up, down = family.expert_linears
    shared = f"mlp.{family.shared_experts}."
    table = {
        "self_attention.linear_qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
        "self_attention.linear_proj": ["self_attn.o_proj"],
        "self_attention.in_proj": [f"linear_attn.{n}" for n in DELTA_NET_INPUTS],
        "self_attention.out_proj": ["linear_attn.out_proj"],
        "mlp.linear_fc1": ["mlp.gate_proj", "mlp.up_proj"],
        "mlp.linear_fc2": ["mlp.down_proj"],
        "mlp.experts.linear_fc1": [experts + gate, experts + up],
        "mlp.experts.linear_fc2": [experts + down],
        "mlp.shared_experts.linear_fc1": [shared + "gate_proj", shared + "up_proj"],
        "mlp.shared_experts.linear_fc2": [shared + "down_proj"],
    }
    return table.get(megatron_rest)


def _split_rows(
    name: str, b: torch.Tensor, cfg: GPTModelConfig, modules: int
) -> list[torch.Tensor]:
    """Split a fused B ``[out, r]`` into the B matrices of the ``modules`` HF modules: its
    parts (q, k, v or gate, up), or one matrix of the parts one after the other."""
    if name.endswith("linear_qkv"):
        parts = list(QKVRows.of(cfg).split(b))
    elif name.endswith("in_proj"):
        parts = list(DeltaNetRows.of(cfg).split(b))
    elif name.endswith("linear_fc1"):
        parts = list(split_gate_up(b))
    else:
        parts = [b]
    return [torch.cat(parts)] if modules == 1 else parts


def _fuse_rows(name: str, parts: list[torch.Tensor], cfg: GPTModelConfig) -> torch.Tensor:
    """Inverse of :func:`_split_rows`."""
    if name.endswith("linear_qkv"):
        return QKVRows.of(cfg).fuse(*parts)
    if name.endswith("in_proj"):
        return DeltaNetRows.of(cfg).fuse(*parts)
    if name.endswith("linear_fc1"):
        return fuse_gate_up(*parts)
    return parts[0]


def hf_modules(path: str, model_type: str) -> list[str] | None:
    """The PEFT module names (``{e}``: the expert index) a wrapped linear's path splits
    into: a decoder layer's linears, or the output layer (``lm_head``)."""
    if path == "output_layer":
        return ["base_model.model.lm_head"]
    m = _LAYER.match(path)
    parts = hf_module_names(m.group(2), model_type) if m else None
    if parts is None:
        return None
    layers = f"base_model.model.{family_of(model_type).language_model}.layers"
    return [f"{layers}.{m.group(1)}.{part}" for part in parts]


def to_peft_tensors(
    full: dict[str, torch.Tensor], cfg: GPTModelConfig, model_type: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Full slot tensors (``<layer path>.adapter.linear_in/out.weight``, as from
    ``get_slot_tensors`` or an adapter folder) -> PEFT keys, and the target module names.
    A linear whose factors are both zero (one the adapter does not train: see
    ``restrict_adapter_slot``) is left out, as is a part of a fused linear it does not
    adapt."""
    tensors, targets = {}, set()
    paths = sorted({k.split(".adapter.")[0] for k in full})
    family = family_of(model_type)
    peft_experts = family.peft_experts
    if peft_experts is not None:  # the family's experts go as parameters, per layer
        by_layer: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for path in [p for p in paths if _EXPERTS.match(p)]:
            m = _EXPERTS.match(path)
            pair = (
                full[f"{path}.adapter.linear_in.weight"],
                full[f"{path}.adapter.linear_out.weight"],
            )
            by_layer.setdefault(m.group(1), {})[m.group(2)] = pair
            paths.remove(path)
        for layer, pairs in sorted(by_layer.items()):
            if any(a.any() or b.any() for a, b in pairs.values()):
                more, names = peft_experts(
                    f"base_model.model.{family.language_model}.layers.{layer}.mlp.experts",
                    pairs,
                )
                tensors.update(more)
                targets.update(names)
    for path in paths:
        modules = hf_modules(path, model_type)
        if modules is None:
            raise ValueError(f"{path}: no Hugging Face counterpart for this linear")
        a = full[f"{path}.adapter.linear_in.weight"]
        b = full[f"{path}.adapter.linear_out.weight"]
        if not (a.any() or b.any()):
            continue
        for e in range(a.size(0)) if a.dim() == 3 else [None]:
            a_e, b_e = (a, b) if e is None else (a[e], b[e])
            b_parts = _split_rows(path, b_e, cfg, len(modules))
            for name, b_part in zip(modules, b_parts):
                if _left_out(b_part, b_parts, b_e):
                    continue
                module = name.format(e=e)
                tensors[f"{module}.lora_A.weight"] = a_e.clone()  # one copy per HF module
                tensors[f"{module}.lora_B.weight"] = b_part.clone()
                targets.add(name.rsplit(".", 1)[-1])
    return tensors, sorted(targets)


def _left_out(b_part: torch.Tensor, b_parts: list[torch.Tensor], b: torch.Tensor) -> bool:
    """A part of a fused linear the adapter does not adapt (PEFT targets naming some of its
    parts: :mod:`~megatron_multilora.layers.fused_parts`): its B is zero while the rest of
    the linear's (the expert's) B is not."""
    return len(b_parts) > 1 and not b_part.any() and bool(b.any())


def peft_config(
    rank: int, alpha: float, dropout: float, targets: list[str], base_model_name_or_path: str
) -> dict[str, Any]:
    """A PEFT LoRA config that peft and vLLM load (uniform r and alpha, no extras).
    ``targets``: module names, and ``module.parameter`` paths for ``target_parameters``."""
    parameters = [t for t in targets if "." in t]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": [t for t in targets if "." not in t],
        **({"target_parameters": parameters} if parameters else {}),
        "lora_dropout": dropout,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "base_model_name_or_path": base_model_name_or_path,
    }


def write_peft(
    out_dir: str | Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    overwrite: bool = False,
    name: str | None = None,
) -> Path:
    """Write a PEFT folder atomically (call on one process), with a model card saying the
    prompt format the adapter trained on (``prompt_format.py``; ``name``: its title, default
    the folder's name)."""

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / PEFT_TENSORS))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        card = model_card(
            name or Path(out_dir).name,
            config["base_model_name_or_path"],
            config["target_modules"],
            config["r"],
            config["lora_alpha"],
        )
        (tmp / CARD_FILE).write_text(card)

    return write_dir_atomic(out_dir, fill, overwrite=overwrite)


def export_peft(
    model: ModelOrChunks,
    idx: int,
    out_dir: str | Path,
    cfg: GPTModelConfig,
    model_type: str = "llama",
    base_model_name_or_path: str = "",
    overwrite: bool = False,
    dropout: float | None = None,
) -> Path:
    """Write slot ``idx`` as a PEFT LoRA folder (collective: every rank calls it).
    ``dropout``: the rate to record (the job's exact value; default: the slot's float32 one)."""
    out_dir = Path(out_dir)
    rank, alpha = slot_rank_alpha(model, idx)
    if alpha == 0.0:
        raise ValueError(f"slot {idx} holds no adapter (alpha 0): nothing to export")
    refuse_existing(out_dir, overwrite)
    tensors, targets = to_peft_tensors(get_slot_tensors(model, idx), cfg, model_type)
    if dropout is None:
        dropout = float(
            next(layer for _, layer in named_multi_lora_modules(model)).adapters[idx].dropout
        )
    if dist.get_rank() == 0:
        write_peft(
            out_dir,
            tensors,
            peft_config(rank, alpha, dropout, targets, base_model_name_or_path),
            overwrite,
        )
    dist.barrier()
    return out_dir


def read_peft(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    expect_format(folder, FolderFormat.PEFT)
    folder = Path(folder)
    return json.loads((folder / CONFIG_FILE).read_text()), load_file(str(folder / PEFT_TENSORS))


def import_peft(
    model: ModelOrChunks,
    idx: int,
    folder: str | Path,
    cfg: GPTModelConfig,
    model_type: str = "llama",
) -> dict[str, Any]:
    """Load a PEFT LoRA folder into slot ``idx`` (any layout); returns its config.

    Refused with a clear error: DoRA, rank/alpha patterns, a rank above the slot's max rank,
    modules the model does not wrap, fused parts with different A, shape mismatches.
    """
    config, peft = read_peft(folder)
    where = f"{folder}"
    if config.get("peft_type") != "LORA" or config.get("use_dora"):
        raise ValueError(
            f"{where}: only plain LoRA adapters load (peft_type="
            f"{config.get('peft_type')}, use_dora={config.get('use_dora')})"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(
            f"{where}: rank_pattern/alpha_pattern are not supported: a slot has one rank and alpha"
        )
    r, alpha = int(config["r"]), peft_alpha(config)
    remaining = dict(peft)
    full = {}
    for path, layer_module in named_multi_lora_modules(model):
        parts = hf_modules(path, model_type)
        if parts is None:
            raise ValueError(f"{where}: {path} has no Hugging Face counterpart")
        n_experts = (
            layer_module.num_local_experts * _ep_size()
            if hasattr(layer_module, "num_local_experts")
            else None
        )
        expert_layer = _EXPERTS.match(path)
        family = family_of(model_type)
        if family.peft_experts_in is not None and expert_layer:  # experts as parameters
            layer = expert_layer.group(1)
            module = f"base_model.model.{family.language_model}.layers.{layer}.mlp.experts"
            back = family.peft_experts_in
            pair = back(remaining, module, expert_layer.group(2), n_experts) or (
                torch.zeros(n_experts, r, layer_module.full_shape(A)[-1]),  # not adapted
                torch.zeros(n_experts, layer_module.full_shape(B)[-2], r),
            )
            full[f"{path}.adapter.linear_in.weight"] = pair[0]
            full[f"{path}.adapter.linear_out.weight"] = pair[1]
            continue
        a_list, b_list = [], []
        for e in range(n_experts) if n_experts else [None]:
            a_e, b_e = _one_linear(where, path, parts, e, remaining, r, cfg, layer_module)
            a_list.append(a_e)
            b_list.append(b_e)
        stacked = n_experts is not None
        full[f"{path}.adapter.linear_in.weight"] = torch.stack(a_list) if stacked else a_list[0]
        full[f"{path}.adapter.linear_out.weight"] = torch.stack(b_list) if stacked else b_list[0]
    for key in [k for k, v in remaining.items() if k.endswith(".lora_B.weight") and not v.any()]:
        remaining.pop(key)  # adapts nothing (gpt-oss's experts write both linears)
        remaining.pop(key.replace(".lora_B.", ".lora_A."), None)
    if remaining:
        raise ValueError(
            f"{where}: the adapter has modules this model does not wrap: "
            f"{sorted(remaining)[:4]}{' ...' if len(remaining) > 4 else ''}"
        )
    try:
        set_slot_tensors(model, idx, full, r, alpha)
    except (KeyError, ValueError) as err:
        raise ValueError(f"{where}: cannot load into slot {idx}: {err}") from None
    return config


def _one_linear(
    where: str,
    path: str,
    parts: list[str],
    e: int | None,
    remaining: dict[str, torch.Tensor],
    r: int,
    cfg: GPTModelConfig,
    layer: torch.nn.Module,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The full fp32 A and fused B of one wrapped linear (of expert ``e``) from its HF
    modules' tensors, taken out of ``remaining``; the parts the adapter lacks are zero."""
    a_e, b_parts = None, []
    for part in parts:
        module = part.format(e=e)
        a_p = remaining.pop(f"{module}.lora_A.weight", None)
        b_p = remaining.pop(f"{module}.lora_B.weight", None)
        if (a_p is None) != (b_p is None):
            raise ValueError(f"{where}: {module} has only one of lora_A/lora_B")
        if a_p is not None and a_e is not None and not torch.equal(a_p, a_e):
            raise ValueError(
                f"{where}: {module}.lora_A differs from the other parts of "
                f"fused {path} ({', '.join(parts)}): cannot fuse"
            )
        a_e = a_p if a_p is not None else a_e
        b_parts.append(b_p)
    _check_adapted(where, path, parts, b_parts, layer)
    if a_e is None:  # the adapter leaves this linear alone
        a_e = torch.zeros(r, _in_features(layer, path))
    out_rows = _out_rows(path, cfg, layer)
    if len(parts) == 1 and len(out_rows) > 1:  # one HF module holds every part
        whole = b_parts[0]
        b_parts = [None] * len(out_rows) if whole is None else list(whole.split(out_rows))
    b_parts = [b if b is not None else torch.zeros(rows, r) for b, rows in zip(b_parts, out_rows)]
    return a_e.float(), _fuse_rows(path, [b.float() for b in b_parts], cfg)


def _check_adapted(
    where: str, path: str, modules: list[str], b_parts: list, layer: torch.nn.Module
) -> None:
    """Refuse an adapter that changes a part of a fused linear this model does not adapt
    (lora.targets naming only some of its parts): it would be dropped, not loaded."""
    adapted = getattr(layer, "adapted_parts", None)
    linear = path.rsplit(".", 1)[-1]
    if adapted is None or len(modules) != len(FUSED_PARTS[linear]):
        return
    for module, part, b in zip(modules, FUSED_PARTS[linear], b_parts):
        if part not in adapted and b is not None and b.any():
            raise ValueError(
                f"{where}: the adapter changes {module.rsplit('.', 1)[-1]}, which this "
                f"model's lora.targets leave out of {path}; add it to lora.targets"
            )


def _ep_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def _in_features(layer, path: str) -> int:
    """The full input width of a wrapped linear (the base's, unsharded)."""
    return layer.full_shape(A)[-1]


def _out_rows(rest: str, cfg: GPTModelConfig, layer) -> list[int]:
    """Row counts of the HF parts of a wrapped linear's full output."""
    full_out = layer.full_shape(B)[-2]
    if rest.endswith("linear_qkv"):
        return list(QKVRows.of(cfg).part_rows())
    if rest.endswith("linear_fc1"):
        return [full_out // 2, full_out // 2]
    return [full_out]
