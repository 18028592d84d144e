"""A slot exported in PEFT format, loaded with ``peft.PeftModel.from_pretrained`` on the
transformers model, gives the Megatron model's logits with only that slot active (fp32).

qwen2_moe: PEFT skips its expert LoRA conversion (known gap, see docs/reference.md), so there the
reference is transformers with the exported deltas merged by hand.
"""

import pytest
import torch
from safetensors.torch import load_file

import megatron_multilora as mm
from megatron_multilora.checkpoint.peft_format import export_peft
from megatron_multilora.models.hf_import import load_hf_model
from megatron_multilora.ops.fused_rows import QKVRows
from tests.hf_models import (
    DENSE,
    MOE,
    add_skipped_mlp_deltas,
    hf_logits,
    make_hf_model,
    megatron_logits,
    packed,
    token_batch,
)

TOL = 1e-4  # max |logit difference|, logits of size ~6


def trained_like_slot(model, slot: int) -> None:
    """Give slot ``slot`` non-trivial factors of rank 4 (others stay fresh)."""
    gen = torch.Generator().manual_seed(slot)
    mm.init_adapter_slot(model, slot, 4, 6.0)
    with torch.no_grad():
        for layer in mm.multi_lora_modules(model):
            for factor in (layer.adapters[slot].linear_in, layer.adapters[slot].linear_out):
                factor.weight.copy_(0.2 * torch.randn(factor.weight.shape, generator=gen))
            layer.adapters.mask_rank(slot)


def merge_by_hand(hf_model, folder, model_type: str) -> None:
    """Add every exported LoRA delta ``(alpha / r) * B @ A`` into the transformers weights."""
    import json

    config = json.loads((folder / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for key in [k for k in tensors if k.endswith("lora_A.weight")]:
            module = key[len("base_model.model.") : -len(".lora_A.weight")]
            delta = scale * tensors[key.replace("lora_A", "lora_B")] @ tensors[key]
            if f"{module}.weight" in params:
                params[f"{module}.weight"].add_(delta)
                continue
            # fused experts in memory: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
            prefix, expert, name = module.rsplit(".", 2)
            expert = int(expert)
            if name == "down_proj":
                params[f"{prefix}.down_proj"][expert].add_(delta)
            else:
                half = params[f"{prefix}.gate_up_proj"].shape[1] // 2
                rows = slice(0, half) if name == "gate_proj" else slice(half, 2 * half)
                params[f"{prefix}.gate_up_proj"][expert, rows].add_(delta)


@pytest.mark.parametrize("model_type", DENSE + MOE)
def test_peft_loads_the_exported_slot_with_the_same_logits(model_type, tmp_path):
    import peft

    hf = make_hf_model(model_type)
    hf.save_pretrained(tmp_path / "base")
    model, cfg = load_hf_model(str(tmp_path / "base"))
    mm.apply_multi_lora(model, 3, 8, 1.0)
    trained_like_slot(model, 1)
    ids = token_batch()
    mm.set_tokens_per_adapter_slot(model, [0, ids.numel(), 0])
    want = megatron_logits(model, ids)
    export_peft(model, 1, tmp_path / "peft", cfg, hf.config.model_type, str(tmp_path / "base"))

    if model_type in ("qwen2_moe", "qwen3_5_moe_text"):  # peft misloads (skips) their experts
        merge_by_hand(hf, tmp_path / "peft", model_type)
        got = hf_logits(hf, ids)
    else:
        wrapped = peft.PeftModel.from_pretrained(make_hf_model(model_type), str(tmp_path / "peft"))
        # peft's limit, as DeepSeek-V3's (test_deepseek_v3.py): shared experts unadapted
        if model_type == "glm4_moe":
            add_skipped_mlp_deltas(wrapped, tmp_path / "peft")
        got = hf_logits(wrapped.eval(), ids)
    base = hf_logits(make_hf_model(model_type), ids)
    assert (want - base).abs().max() > 1e-2  # the adapter matters
    assert (got - want).abs().max() <= TOL, f"{model_type}: {(got - want).abs().max():.2e}"


def test_a_slot_of_some_parts_exports_only_those_and_an_adapted_output_layer(tmp_path):
    """Output-layer LoRA (a LoraConfig's train_unembed) exports as ``lm_head``; linears a slot
    does not train (restrict_adapter_slot: both factors zero) are left out of the export,
    and peft gives the Megatron model's logits."""
    import json

    import peft

    from megatron_multilora.layers.lifecycle import restrict_adapter_slot

    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path / "base")
    model, cfg = load_hf_model(str(tmp_path / "base"))
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"]
    mm.apply_multi_lora(model, 3, 8, 1.0, target_modules=targets)
    trained_like_slot(model, 1)
    restrict_adapter_slot(model, 1, ["attn", "unembed"])
    ids = token_batch()
    mm.set_tokens_per_adapter_slot(model, [0, ids.numel(), 0])
    want = megatron_logits(model, ids)
    export_peft(model, 1, tmp_path / "peft", cfg, "llama", str(tmp_path / "base"))
    config = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]
    wrapped = peft.PeftModel.from_pretrained(make_hf_model("llama"), str(tmp_path / "peft"))
    got = hf_logits(wrapped.eval(), ids)
    assert (got - want).abs().max() <= TOL, f"{(got - want).abs().max():.2e}"


@pytest.mark.parametrize("model_type", ["llama", "phi3", "qwen3_moe"])
def test_peft_target_names_adapt_only_those_parts_of_fused_linears(model_type, tmp_path):
    """``target_modules`` as PEFT users write them: q_proj and v_proj adapt only those rows
    of megatron's fused linear_qkv, gate_proj only the gate half of fc1 (experts' too).
    The other rows get no gradient and stay zero, the export names exactly those modules
    (Phi-3: its fused qkv_proj / gate_up_proj with zero rows), and peft gives the logits.
    Without down_proj, linear_fc2 is not wrapped."""
    import json

    import peft

    hf = make_hf_model(model_type)
    hf.save_pretrained(tmp_path / "base")
    model, cfg = load_hf_model(str(tmp_path / "base"))
    # peft 0.21 loads transformers 5's fused experts only with all of gate, up and down
    moe = ["up_proj", "down_proj"] if model_type in MOE else []
    targets = ["q_proj", "v_proj", "gate_proj", *moe]
    mm.apply_multi_lora(model, 3, 8, 1.0, target_modules=targets, row_init_method="normal")
    trained_like_slot(model, 1)
    ids = token_batch()
    mm.set_tokens_per_adapter_slot(model, [0, ids.numel(), 0])
    positions = torch.arange(ids.size(1))[None].expand_as(ids)
    want = model(ids, positions, None)
    want.square().mean().backward()
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    b, grad = qkv.adapters[1].linear_out.weight, qkv.adapters[1].linear_out.weight.grad
    q, k, v = QKVRows.of(cfg).split(torch.stack([b.detach(), grad]).transpose(0, 1))
    assert not k.any() and q[:, 1].any() and v[:, 1].any()  # k: no weights, no gradient
    fc2 = [m for n, m in model.named_modules() if n.endswith("linear_fc2")]
    assert all(isinstance(m, mm.MultiLoRALinear) == bool(moe) for m in fc2)
    export_peft(model, 1, tmp_path / "peft", cfg, model_type, str(tmp_path / "base"))
    config = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    expected = {"phi3": ["gate_up_proj", "qkv_proj"]}.get(model_type, sorted(targets))
    assert config["target_modules"] == expected
    wrapped = peft.PeftModel.from_pretrained(make_hf_model(model_type), str(tmp_path / "peft"))
    got = hf_logits(wrapped.eval(), ids)
    want = want.detach()
    assert (got - want).abs().max() <= TOL, f"{(got - want).abs().max():.2e}"


@pytest.mark.parametrize(
    "model_type",
    ["llama3", "mistral", "phi3", "qwen3_yarn", "gemma3_text", "smollm3", "deepseek_v3"],
)
def test_two_slots_in_one_packed_micro_batch_each_give_their_peft_logits(model_type, tmp_path):
    """A packed (thd) micro-batch of two sequences, one per slot: each sequence's logits
    equal transformers + peft with that slot's exported adapter (and differ between the
    two slots' adapters)."""
    import peft

    from megatron_multilora.layers.slot_layout_route import with_slot_layout

    hf = make_hf_model(model_type)
    hf.save_pretrained(tmp_path / "base")
    model, cfg = load_hf_model(str(tmp_path / "base"))
    mm.apply_multi_lora(
        model, 3, 8, 1.0, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    )
    lengths = [9, 7]
    params, positions = packed(lengths)
    ids = token_batch(5, batch=1)
    for slot in (1, 2):
        trained_like_slot(model, slot)
    with torch.no_grad():
        got = model(ids, positions, None, packed_seq_params=with_slot_layout(params, [0, *lengths]))
    for slot, (a, b) in zip((1, 2), ((0, 9), (9, 16))):
        folder = tmp_path / f"peft{slot}"
        export_peft(model, slot, folder, cfg, hf.config.model_type, str(tmp_path / "base"))
        wrapped = peft.PeftModel.from_pretrained(make_hf_model(model_type), str(folder)).eval()
        if model_type == "deepseek_v3":  # peft leaves dense MLP and shared-expert LoRA out
            add_skipped_mlp_deltas(wrapped, folder)
        want = hf_logits(wrapped, ids[:, a:b])[0]
        assert (got[0, a:b] - want).abs().max() <= TOL, (
            f"slot {slot}: {(got[0, a:b] - want).abs().max():.2e}"
        )
    assert (got[0, :9] - hf_logits(make_hf_model(model_type), ids[:, :9])[0]).abs().max() > 1e-2
