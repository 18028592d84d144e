"""Import Hugging Face causal-LM checkpoints into the Megatron GPT of :func:`build_gpt_model`.

Works on any supported TP/EP/PP layout: each rank reads only the slices it holds, and under
pipelining only its stage's layers (``i`` below is the global layer number, megatron's
``TransformerLayer.layer_number - 1``), the embeddings on the first stage and the final norm
and output layer on the last (with tied embeddings, the last stage's copy of the word
embeddings is read from ``model.embed_tokens.weight``). Name and layout mapping
(``L`` = ``model.layers.{i}``; ``M`` = the layer's MoE block, ``L.mlp`` or, for Mixtral,
``L.block_sparse_moe``):

=================================================  ============================================
Megatron parameter (per rank)                      Hugging Face tensor(s)
=================================================  ============================================
embedding.word_embeddings.weight [V/tp, H]         model.embed_tokens.weight, vocab rows
output_layer.weight [V/tp, H] (tied: only at PP>1) lm_head.weight (tied: model.embed_tokens.
                                                   weight), vocab rows
decoder.final_layernorm.weight [H]                 model.norm.weight
layers.i.input_layernorm.weight [H]                L.input_layernorm.weight
layers.i.pre_mlp_layernorm.weight [H]              L.post_attention_layernorm.weight
self_attention.linear_qkv.weight/.bias             L.self_attn.{q,k,v}_proj.weight/.bias (Phi-3:
  [g/tp * (q_per_group + 2) * d, H]                row blocks of qkv_proj), fused per query
                                                   group: its q heads, k_g, v_g; TP ranks
                                                   hold whole groups
self_attention.linear_proj.weight [H, heads*d/tp]  L.self_attn.o_proj.weight, columns
self_attention.q_layernorm/k_layernorm.weight      L.self_attn.q_norm/k_norm.weight: [d] per
                                                   head (Qwen3), or [heads*d] across heads
                                                   (OLMoE; TP-split by heads)
mlp.linear_fc1.weight [2F/tp, H]                   [gate_proj shard; up_proj shard] (Phi-3:
                                                   halves of gate_up_proj)
mlp.linear_fc2.weight [H, F/tp]                    L.mlp.down_proj.weight, columns
mlp.router.weight [E, H]                           M.gate.weight
mlp.router.expert_bias [E] (a buffer)              M.gate.e_score_correction_bias
mlp.experts.linear_fc1.weight{j} [2I, H]           expert e = ep_rank * E/ep + j:
                                                   [M.experts.e.gate_proj; .up_proj]
                                                   (Mixtral: [w1; w3]), or the fused
                                                   M.experts.gate_up_proj[e] [2I, H]
mlp.experts.linear_fc2.weight{j} [H, I]            M.experts.e.down_proj (Mixtral: w2), or
                                                   M.experts.down_proj[e] [H, I]
mlp.shared_experts.linear_fc1/.linear_fc2.weight   M.shared_expert(s).gate_proj/up_proj/down_proj
mlp.shared_experts.gate_weight [1, H]              M.shared_expert_gate.weight
=================================================  ============================================

What a family names otherwise is in its module (``models/families/``): its layer tensors
(DeepSeek-V3's multi-latent attention, :data:`~.families.deepseek_v3.MLA_TENSORS`, each split
like its parameter; Gemma 3's norms, below), its MoE block and expert names (Mixtral), its
shared experts' module and the linears it keeps fused (Phi-3).
TE layer specs name the norms ``linear_qkv.layer_norm_weight`` and
``mlp.linear_fc1.layer_norm_weight``; both are mapped too. Megatron's SequentialMLP names
(``mlp.experts.local_experts.{j}.linear_fc1.weight``) are accepted as well.

Gemma 3 (:mod:`~megatron_multilora.models.families.gemma3_text`) differs in its norms:

=================================================  ============================================
layers.i.pre_mlp_layernorm.weight [H]              L.pre_feedforward_layernorm.weight
layers.i.self_attn_bda.norm.weight [H] (post norm) L.post_attention_layernorm.weight
layers.i.mlp_bda.norm.weight [H] (post norm)       L.post_feedforward_layernorm.weight
every norm weight (q/k and final norms too)        1 + the tensor: Gemma's RMSNorms scale by
                                                   (1 + w); folded here, in fp32, then cast
=================================================  ============================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Sequence

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_multilora.errors import RunError
from megatron_multilora.layers.lifecycle import hide_adapters, named_multi_lora_modules
from megatron_multilora.models.families import Family, family_of
from megatron_multilora.models.gpt import build_gpt_model
from megatron_multilora.models.gpt_config import GPTModelConfig
from megatron_multilora.models.hf_config import hf_to_model_config, read_hf_config
from megatron_multilora.models.hf_safetensors import SafetensorsFolder
from megatron_multilora.ops.fused_rows import (
    DELTA_NET_INPUTS,
    DeltaNetRows,
    QKVRows,
    fuse_gate_up,
)

__all__ = ["hf_to_model_config", "load_hf_checkpoint", "load_hf_model", "load_hf_tokenizer"]

# Per-layer parameters that are one HF tensor, sliced like the Megatron parameter.
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    # a Gated DeltaNet layer's (Qwen3.5's linear_attn)
    "self_attention.A_log": "linear_attn.A_log",
    "self_attention.dt_bias": "linear_attn.dt_bias",
    "self_attention.out_norm.weight": "linear_attn.norm.weight",
    "self_attention.out_proj.weight": "linear_attn.out_proj.weight",
}

_EXPERT = re.compile(
    r"mlp\.experts\.(?:linear_(fc[12])\.(weight|bias)(\d+)|local_experts\.(\d+)\."
    r"linear_(fc[12])\.(weight|bias))"
)
# HF tensors that carry no weights of the model (old checkpoints stored RoPE tables).
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")


class MissingTensorError(ValueError):
    """The checkpoint lacks a tensor a Megatron parameter needs."""


@dataclasses.dataclass(frozen=True)
class _Shard:
    """This rank's part of a full tensor: chunk ``rank`` of ``size`` along ``dim``."""

    dim: int | None = None
    rank: int = 0
    size: int = 1


_WHOLE = _Shard()


class _Loader:
    """Builds each Megatron parameter's local tensor from the checkpoint."""

    def __init__(self, ckpt: SafetensorsFolder, cfg: GPTModelConfig, family: Family) -> None:
        self.ckpt, self.cfg, self.family = ckpt, cfg, family
        self.layer_names = {**_LAYER_DIRECT, **family.layer_tensors}
        # Megatron keys whose checkpoint tensor w stands for a (1 + w) norm weight (Gemma).
        self.unit_offset_norms = family.unit_offset_norms
        self.global_layer: list[int] = []  # the current chunk's local -> global layer index
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        self.etp_size = parallel_state.get_expert_tensor_parallel_world_size()
        if cfg.num_moe_experts:
            ep = parallel_state.get_expert_model_parallel_world_size()
            self.first_expert = parallel_state.get_expert_model_parallel_rank() * (
                cfg.num_moe_experts // ep
            )

    def shard(self, param: torch.Tensor, expert: bool = False) -> _Shard:
        """From megatron's attributes: TP-split params are chunked along ``partition_dim``
        (experts over the expert-TP group, which is 1 here)."""
        if not getattr(param, "tensor_model_parallel", False):
            return _WHOLE
        if expert:
            return _Shard(param.partition_dim, self.etp_rank, self.etp_size)
        return _Shard(param.partition_dim, self.tp_rank, self.tp_size)

    # --- reads -------------------------------------------------------------------------
    def read(self, name: str, shard: _Shard = _WHOLE) -> torch.Tensor:
        """``name``, only this rank's chunk of it."""
        self.require(name)
        if shard.dim is None or shard.size == 1:
            return self.ckpt.read(name)
        full = self.ckpt.shape(name)[shard.dim]
        if full % shard.size:
            raise ValueError(
                f"{name}: dim {shard.dim} of size {full} does not split into "
                f"{shard.size} tensor-parallel parts"
            )
        n = full // shard.size
        index = [slice(None)] * shard.dim + [slice(shard.rank * n, (shard.rank + 1) * n)]
        return self.ckpt.read(name, tuple(index))

    def require(self, name: str) -> str:
        if name not in self.ckpt:
            raise MissingTensorError(f"{self.ckpt.folder}: the checkpoint has no tensor {name!r}")
        return name

    def gated(self, gate: str, up: str, shard: _Shard) -> torch.Tensor:
        """fc1 of a gated MLP: [gate; up], each split over TP on its own, so a rank holds
        [gate_shard; up_shard] (megatron's layout)."""
        return fuse_gate_up(self.read(gate, shard), self.read(up, shard))

    def qkv(self, prefix: str, suffix: str, shard: _Shard) -> torch.Tensor:
        """Fused q/k/v rows (weight or bias) in megatron's per-group layout; this rank's
        groups only, from q_proj/k_proj/v_proj or the one module a family keeps them in
        (Phi-3's ``qkv_proj``, rows [q; k; v])."""
        layout = QKVRows.of(self.cfg)
        local = layout.groups // shard.size  # TP holds whole groups (an unsplit param: size 1)
        first = shard.rank * local
        module = self.family.fused_modules.get("self_attention.linear_qkv")
        fused = f"{prefix.rsplit('.', 1)[0]}.{module}.{suffix}" if module else None
        q_rows, kv_rows, _ = layout.part_rows()
        offset = {"q_proj": 0, "k_proj": q_rows, "v_proj": q_rows + kv_rows}

        def rows(name: str, per_group: int) -> torch.Tensor:
            start, end = first * per_group, (first + local) * per_group
            if fused is not None:
                span = slice(offset[name] + start, offset[name] + end)
                return self.ckpt.read(self.require(fused), (span,))
            return self.ckpt.read(self.require(f"{prefix}.{name}.{suffix}"), (slice(start, end),))

        d = layout.head_dim
        return layout.fuse(
            rows("q_proj", layout.q_rows_per_group), rows("k_proj", d), rows("v_proj", d)
        )

    def delta_net_in(self, prefix: str, shard: _Shard) -> torch.Tensor:
        """A Gated DeltaNet's fused in_proj rows (:class:`DeltaNetRows`) of this rank's key
        heads, from ``in_proj_qkv`` / ``_z`` / ``_b`` / ``_a``."""
        layout = DeltaNetRows.of(self.cfg)
        v = layout.value_heads // shard.size  # this rank's value heads, from shard.rank * v
        qkv_name, *rest = (self.require(f"{prefix}.{n}.weight") for n in DELTA_NET_INPUTS)
        z, b, a = (
            self.ckpt.read(name, (slice(shard.rank * v * n, (shard.rank + 1) * v * n),))
            for name, n in zip(rest, (layout.value_dim, 1, 1))
        )
        return layout.fuse(self.channels(qkv_name, shard), z, b, a)

    def channels(self, name: str, shard: _Shard) -> torch.Tensor:
        """This rank's rows of a tensor over a Gated DeltaNet's q, k, v channels."""
        spans = DeltaNetRows.of(self.cfg).channel_spans(shard.rank, shard.size)
        return torch.cat([self.ckpt.read(name, (span,)) for span in spans])

    def gate_up(self, mlp: str, shard: _Shard) -> torch.Tensor:
        """A dense MLP's fc1 from gate_proj and up_proj, or from the one module a family
        keeps them in (Phi-3's ``gate_up_proj``, rows [gate; up]): this rank's
        ``[gate_r; up_r]``."""
        module = self.family.fused_modules.get("mlp.linear_fc1")
        if module is None:
            return self.gated(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight", shard)
        fused = f"{mlp.rsplit('.', 1)[0]}.{module}.weight"
        self.require(fused)
        half = self.ckpt.shape(fused)[0] // 2
        n = half // shard.size
        start = shard.rank * n
        return fuse_gate_up(
            self.ckpt.read(fused, (slice(start, start + n),)),
            self.ckpt.read(fused, (slice(half + start, half + start + n),)),
        )

    # --- mapping -----------------------------------------------------------------------
    def tensor_for(self, key: str, param: torch.Tensor) -> torch.Tensor:
        """The local tensor for Megatron state-dict ``key`` (whose parameter is ``param``)."""
        if key == "embedding.word_embeddings.weight":
            return self.read("model.embed_tokens.weight", self.shard(param))
        if key == "output_layer.weight":  # tied: the last stage's copy of the embeddings
            name = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            return self.read(name, self.shard(param))
        if key == "decoder.final_layernorm.weight":
            return self.read("model.norm.weight")
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", key)
        if m:
            return self.layer_tensor(f"model.layers.{self.global_layer[int(m[1])]}", m[2], param)
        raise ValueError(f"no Hugging Face counterpart is known for Megatron parameter {key!r}")

    def layer_tensor(self, hf: str, rest: str, param: torch.Tensor) -> torch.Tensor:
        shard = self.shard(param)
        if rest in self.layer_names:
            return self.read(f"{hf}.{self.layer_names[rest]}", shard)
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            return self.qkv(f"{hf}.self_attn", rest.rsplit(".", 1)[1], shard)
        if rest == "mlp.linear_fc1.weight":
            return self.gate_up(f"{hf}.mlp", shard)
        if rest == "self_attention.in_proj.weight":
            return self.delta_net_in(f"{hf}.linear_attn", shard)
        if rest == "self_attention.conv1d.weight":
            return self.channels(self.require(f"{hf}.linear_attn.conv1d.weight"), shard)
        moe = f"{hf}.{self.family.moe_block}"
        if rest in ("mlp.router.weight", "mlp.router.bias"):
            return self.read(f"{moe}.{self.family.router}.{rest.rsplit('.', 1)[1]}")
        if rest == "mlp.router.expert_bias":  # a buffer (DeepSeek-V3)
            return self.read(f"{moe}.{self.family.router}.e_score_correction_bias")
        m = _EXPERT.fullmatch(rest)
        if m:
            fc, part, local = (m[1], m[2], m[3]) if m[1] else (m[5], m[6], m[4])
            e = self.first_expert + int(local)
            if self.family.expert_tensor is not None:
                return self.family.expert_tensor(self.ckpt, f"{moe}.experts", e, fc, part)
            if part == "bias":
                raise ValueError(f"{self.family.model_type}: no expert biases are known")
            return self.expert(moe, e, fc, self.shard(param, True))
        if rest.startswith("mlp.shared_experts."):
            return self.shared_expert(moe, rest.removeprefix("mlp.shared_experts."), shard)
        raise ValueError(
            f"no Hugging Face counterpart is known for Megatron parameter "
            f"'decoder.layers.<i>.{rest}'"
        )

    def expert(self, moe: str, e: int, fc: str, shard: _Shard) -> torch.Tensor:
        """Global expert ``e``'s fc1 ([gate; up]) or fc2 (down), from per-expert tensors or
        from transformers' fused ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``."""
        fused = f"{moe}.experts.gate_up_proj" if fc == "fc1" else f"{moe}.experts.down_proj"
        if fused in self.ckpt:
            if shard.size > 1:
                raise ValueError("expert tensor parallelism is not supported with fused experts")
            return self.ckpt.read(fused, (slice(e, e + 1),))[0]  # only expert e's rows
        gate, up, down = self.family.expert_linears
        names = [f"{moe}.experts.{e}.{n}.weight" for n in ((gate, up) if fc == "fc1" else (down,))]
        return self.gated(*names, shard) if fc == "fc1" else self.read(names[0], shard)

    def shared_expert(self, moe: str, rest: str, shard: _Shard) -> torch.Tensor:
        """The family's shared expert(s) (Qwen2-MoE: ``shared_expert``, DeepSeek-V3:
        ``shared_experts``); its sigmoid gate is ``shared_expert_gate``."""
        if rest == "gate_weight":
            return self.read(f"{moe}.shared_expert_gate.weight")
        name = self.family.shared_experts
        if rest == "linear_fc1.weight":
            return self.gated(
                f"{moe}.{name}.gate_proj.weight", f"{moe}.{name}.up_proj.weight", shard
            )
        if rest == "linear_fc2.weight":
            return self.read(f"{moe}.{name}.down_proj.weight", shard)
        raise ValueError(
            f"no Hugging Face counterpart is known for shared-expert parameter {rest!r}"
        )


def base_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The base model's parameters by state-dict key (a wrapped linear's base under its
    unwrapped key, thanks to the wrapper's state-dict hook); adapter slots excluded. Routers'
    expert-bias buffers count too: checkpoints hold them like weights."""
    wrapped = next(named_multi_lora_modules(model), None) is not None
    with hide_adapters(model) if wrapped else contextlib.nullcontext():
        state = model.state_dict(keep_vars=True)
    out: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for key, value in state.items():
        weight = isinstance(value, torch.nn.Parameter) or key.endswith(".router.expert_bias")
        if weight and id(value) not in seen:
            seen.add(id(value))  # a shared parameter is filled once, under its first key
            out[key] = value
    return out


def load_hf_checkpoint(
    model: torch.nn.Module | Sequence[torch.nn.Module], folder: str, model_config: GPTModelConfig
) -> None:
    """Copy the Hugging Face checkpoint in ``folder`` into ``model`` on the current layout.

    ``model`` is a GPTModel from :func:`build_gpt_model` for ``model_config``, or this rank's
    list of pipeline chunks from :func:`build_model_chunks` (each possibly wrapped by
    ``apply_multi_lora``, or inside megatron's DDP). The mapping is in this module's
    docstring. Each rank reads only its stage's tensors and its slices of them, cast to the
    parameter's dtype. Raises :class:`MissingTensorError` when the checkpoint lacks a needed
    tensor, ``ValueError`` when a Megatron parameter has no known counterpart, a shape
    disagrees, or the checkpoint holds tensors no stage has a place for (they would be
    silently lost).
    """
    chunks = [_unwrap(m) for m in (model if isinstance(model, Sequence) else [model])]
    family = family_of(read_hf_config(folder).get("model_type"))
    renamed = ((f"{family.language_model}.", "model."),) if family.language_model != "model" else ()
    with SafetensorsFolder(folder, renamed) as ckpt, torch.no_grad():
        loader = _Loader(ckpt, model_config, family)
        for chunk in chunks:
            loader.global_layer = [layer.layer_number - 1 for layer in chunk.decoder.layers]
            for key, param in base_parameters(chunk).items():
                try:
                    tensor = loader.tensor_for(key, param)
                except MissingTensorError as e:
                    raise MissingTensorError(
                        f"{e}, needed for Megatron parameter "
                        f"{_global_key(key, loader.global_layer)!r}"
                    ) from None
                if tensor.shape != param.shape:
                    raise ValueError(
                        f"{_global_key(key, loader.global_layer)}: the checkpoint "
                        f"gives shape {tuple(tensor.shape)} for this rank, the model "
                        f"holds {tuple(param.shape)} (config.json and weights "
                        "disagree?)"
                    )
                if key.endswith(loader.unit_offset_norms):
                    tensor = 1 + tensor.float()  # folded in fp32, as transformers adds it
                param.copy_(tensor.to(param.dtype))
        _check_all_used(ckpt, model_config, _Stage.of(chunks), family)


def _unwrap(model: torch.nn.Module) -> GPTModel:
    while not isinstance(model, GPTModel) and isinstance(
        getattr(model, "module", None), torch.nn.Module
    ):
        model = model.module  # DDP / Float16Module wrappers
    return model


def _global_key(key: str, global_layer: list[int]) -> str:
    """``key`` with its chunk-local layer index replaced by the global one (for messages)."""
    return re.sub(
        r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{global_layer[int(m[1])]}.", key
    )


@dataclasses.dataclass(frozen=True)
class _Stage:
    """What of the checkpoint this rank's pipeline chunks hold."""

    layers: frozenset[int]  # global layer numbers
    first: bool  # the embeddings
    last: bool  # the final norm and the output layer

    @classmethod
    def of(cls, chunks: list[GPTModel]) -> _Stage:
        return cls(
            frozenset(layer.layer_number - 1 for c in chunks for layer in c.decoder.layers),
            any(c.pre_process for c in chunks),
            any(c.post_process for c in chunks),
        )

    def elsewhere(self, name: str, cfg: GPTModelConfig) -> bool:
        """``name`` belongs on another pipeline stage (so this one does not read it)."""
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            return int(m[1]) < cfg.num_layers and int(m[1]) not in self.layers
        if name == "model.embed_tokens.weight":
            return not (self.first or (self.last and cfg.tie_word_embeddings))
        return name in ("model.norm.weight", "lm_head.weight") and not self.last


def _check_all_used(
    ckpt: SafetensorsFolder, cfg: GPTModelConfig, stage: _Stage, family: Family
) -> None:
    """Every checkpoint tensor this stage is responsible for must have gone somewhere (so
    across all stages every tensor has). Under EP a rank reads only its experts, so expert
    indices are compared as wildcards."""

    def generic(name: str) -> str:
        return re.sub(r"\.experts\.\d+\.", ".experts.*.", name)

    used = {generic(n) for n in ckpt.used}
    unused = [
        n
        for n in ckpt.names()
        if generic(n) not in used
        and not _IGNORED.fullmatch(n)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
        and not stage.elsewhere(n, cfg)
        and not family.skipped(n, cfg.num_layers)
    ]
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise ValueError(
            f"{ckpt.folder}: checkpoint tensors with no place in the Megatron model "
            f"(config.json and weights disagree?): {unused[:5]}{more}"
        )


def _drawn_from_the_checkpoint(weight: torch.Tensor) -> None:
    """An init method that leaves ``weight`` as allocated: the checkpoint's tensor is copied
    over it next (:func:`load_hf_checkpoint` raises when one is missing)."""


# TransformerConfig fields for a base whose weights come from a checkpoint: megatron (0.16.1)
# tags parameters as tensor-parallel (tensor_model_parallel / partition_dim) only inside its
# init functions, so they must run (perform_initialization=False would leave TP-split
# parameters looking replicated), but drawing a model's random values first, only to
# overwrite them, is a second of SmolLM2's start-up.
INIT_FOR_CHECKPOINT = {
    "init_method": _drawn_from_the_checkpoint,
    "output_layer_init_method": _drawn_from_the_checkpoint,
    "embedding_init_method": _drawn_from_the_checkpoint,
}


def load_hf_model(
    folder: str,
    sequence_parallel: bool = False,
    params_dtype: torch.dtype = torch.float32,
) -> tuple[GPTModel, GPTModelConfig]:
    """Build the Megatron GPT for ``folder``'s config.json on the current parallel layout
    (call ``init_parallel`` first; under pipelining, this rank's stage, without virtual
    stages) and load its weights; returned in eval mode, like ``from_pretrained``."""
    cfg = hf_to_model_config(read_hf_config(folder))
    model = build_gpt_model(cfg, sequence_parallel, params_dtype, **INIT_FOR_CHECKPOINT)
    load_hf_checkpoint(model, folder, cfg)
    return model.eval(), cfg


def load_hf_tokenizer(folder: str):
    """``transformers.AutoTokenizer.from_pretrained(folder)`` (transformers imported lazily:
    it is only a test/extra dependency)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:  # transformers' message names no file to add
        raise RunError(
            f"{folder}: its tokenizer does not load ({type(err).__name__}: {err}); "
            "save it into the folder (tokenizer.save_pretrained)"
        ) from None
