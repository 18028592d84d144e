"""PEFT folders: export a slot, import it into another slot, export again — exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import megatron_multilora as mm
from megatron_multilora.checkpoint.peft_format import export_peft, import_peft
from megatron_multilora.layers.slot_tensors import get_slot_tensors
from megatron_multilora.ops.fused_rows import QKVRows
from tests.models import tiny_gpt

DENSE = tiny_gpt()
MOE = mm.GPTModelConfig(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=24,
    vocab_size=64,
    num_moe_experts=4,
    moe_shared_expert_intermediate_size=16,
)


def wrapped(cfg):
    torch.manual_seed(0)
    model = mm.apply_multi_lora(mm.build_gpt_model(cfg), 3, 8, 1.0, row_init_method="normal")
    mm.init_adapter_slot(model, 0, 4, 12.0)
    return model


@pytest.mark.parametrize(
    "cfg,model_type",
    [(DENSE, "llama"), (DENSE, "phi3"), (MOE, "qwen2_moe"), (MOE, "mixtral")],
)
def test_round_trip_is_exact(cfg, model_type, tmp_path):
    model = wrapped(cfg)
    export_peft(model, 0, tmp_path / "a", cfg, model_type, base_model_name_or_path="tiny")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        4,
        12.0,
        "tiny",
    )
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    if model_type == "llama":
        # hidden 32, 4 heads of 8, 2 KV groups, ffn 48, rank 4 (the notes' layout)
        assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].shape == (
            32,
            4,
        )
        assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (
            16,
            4,
        )
        assert tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"].shape == (48, 4)
        assert tensors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (
            4,
            48,
        )
        assert set(config["target_modules"]) == {
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        }
    elif model_type == "phi3":
        # Phi-3's fused modules: B's rows in Hugging Face's [q; k; v] and [gate; up] order
        qkv = tensors["base_model.model.model.layers.1.self_attn.qkv_proj.lora_B.weight"]
        fused = get_slot_tensors(model, 0)[
            "decoder.layers.1.self_attention.linear_qkv.adapter.linear_out.weight"
        ][:, :4]
        q, k, v = QKVRows.of(cfg).split(fused)
        assert torch.equal(qkv, torch.cat([q, k, v])) and not torch.equal(qkv, fused)
        assert set(config["target_modules"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    else:
        expert = (
            "block_sparse_moe.experts.3.w3" if model_type == "mixtral" else "mlp.experts.3.up_proj"
        )
        assert tensors[f"base_model.model.model.layers.0.{expert}.lora_B.weight"].shape == (24, 4)
    import_peft(model, 2, tmp_path / "a", cfg, model_type)
    first, second = get_slot_tensors(model, 0), get_slot_tensors(model, 2)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    export_peft(model, 2, tmp_path / "b", cfg, model_type, base_model_name_or_path="tiny")
    again = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert tensors.keys() == again.keys() and all(
        torch.equal(tensors[k], again[k]) for k in tensors
    )


def test_refusals_are_clear(tmp_path):
    model = wrapped(DENSE)
    with pytest.raises(ValueError, match=r"holds no adapter"):
        mm.clear_adapter_slot(model, 1)
        export_peft(model, 1, tmp_path / "empty", DENSE)
    export_peft(model, 0, tmp_path / "a", DENSE)
    with pytest.raises(FileExistsError, match=r"not empty"):
        export_peft(model, 0, tmp_path / "a", DENSE)

    def edited(change):
        folder = tmp_path / f"edit{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
        tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
        change(config, tensors)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        return folder

    too_big = edited(
        lambda c, t: (
            t.update(
                {
                    k: torch.zeros(16, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 16)
                    for k, v in t.items()
                }
            )
            or c.update(r=16)
        )
    )
    with pytest.raises(ValueError, match=r"rank=16 is outside 1..8"):
        import_peft(model, 1, too_big, DENSE)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    differing = edited(lambda c, t: t.update({q_a: t[q_a] + 1}))
    with pytest.raises(ValueError, match=r"cannot fuse"):
        import_peft(model, 1, differing, DENSE)
    extra = edited(
        lambda c, t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)})
    )
    with pytest.raises(ValueError, match=r"does not wrap"):
        import_peft(model, 1, extra, DENSE)
    dora = edited(lambda c, t: c.update(use_dora=True))
    with pytest.raises(ValueError, match=r"use_dora"):
        import_peft(model, 1, dora, DENSE)


@pytest.mark.parametrize("targets", ["all", "down_proj only"])
def test_gpt_oss_experts_round_trip_as_peft_parameter_adapters(targets, tmp_path):
    """gpt-oss has no per-expert modules: its experts export as PEFT's target_parameters
    (A expert-major, B rank-major, fc1's rows interleaved as gate_up_proj's columns; an
    expert linear not adapted is written as zeros) and import back exactly."""
    import dataclasses

    cfg = dataclasses.replace(MOE, moe_shared_expert_intermediate_size=None)
    torch.manual_seed(0)
    only = {} if targets == "all" else {"target_modules": ["linear_qkv", "linear_fc2"]}
    model = mm.apply_multi_lora(
        mm.build_gpt_model(cfg), 3, 8, 1.0, row_init_method="normal", **only
    )
    mm.init_adapter_slot(model, 0, 4, 12.0)
    export_peft(model, 0, tmp_path / "a", cfg, "gpt_oss")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert set(config["target_parameters"]) == {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    experts = "base_model.model.model.layers.0.mlp.experts"
    slot = get_slot_tensors(model, 0)
    down_a = slot["decoder.layers.0.mlp.experts.linear_fc2.adapter.linear_in.weight"]  # [E, r, I]
    down_b = slot["decoder.layers.0.mlp.experts.linear_fc2.adapter.linear_out.weight"]  # [E, H, r]
    assert torch.equal(tensors[f"{experts}.lora_A.weight"][4:8], down_a[1])  # expert 1's rows
    assert torch.equal(tensors[f"{experts}.lora_B.weight"][:, 2 * 4 + 1], down_b[1][:, 2])
    gate_up_b = tensors[f"{experts}.base_layer.lora_B.weight"]  # [2I, r * E]
    assert gate_up_b.shape == (48, 16)
    if targets == "all":
        fc1_b = slot["decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_out.weight"]
        assert torch.equal(gate_up_b[1::2, 0 * 4 + 3], fc1_b[3][24:, 0])  # up rows, expert 3
    else:
        assert not gate_up_b.any()
    import_peft(model, 2, tmp_path / "a", cfg, "gpt_oss")
    first, second = get_slot_tensors(model, 0), get_slot_tensors(model, 2)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
