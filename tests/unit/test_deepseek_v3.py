"""DeepSeek-V3 (world of one): import gives transformers' logits (MLA, YaRN, no q
down-projection, dense then MoE layers, sigmoid router with expert bias and groups, packed
sequences, skipped multi-token-prediction layers), the expert bias stays frozen, fields
megatron would compute otherwise are refused, and a slot exported in PEFT format loads into
transformers with the same logits and back exactly."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import megatron_multilora as mm
from megatron_multilora.checkpoint.peft_format import export_peft, import_peft
from megatron_multilora.layers.lifecycle import named_multi_lora_modules
from megatron_multilora.layers.slot_tensors import get_slot_tensors
from megatron_multilora.models.hf_config import hf_to_model_config
from megatron_multilora.models.hf_import import load_hf_model
from tests.hf_models import (
    add_skipped_mlp_deltas,
    hf_logits,
    make_hf_model,
    megatron_logits,
    packed,
    token_batch,
)
from tests.unit.test_peft_interop import trained_like_slot

pytest.importorskip("transformers")

TOL = 1e-4  # fp32 both sides; observed <= 6e-6 on logits of size ~7-9
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=32,  # shorter than the 64-token test sequences
    mscale=0.9,
    mscale_all_dim=0.8,
)
# Every wrapped linear of the model but the q projections (q_lora_rank decides which).
LINEARS = ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2"]


def max_logit_diff(hf_model, model, seq: int = 16) -> float:
    return max(
        (megatron_logits(model, ids) - hf_logits(hf_model, ids)).abs().max().item()
        for ids in (token_batch(s, seq=seq) for s in range(3))
    )


@pytest.mark.parametrize(
    "variant,overrides",
    [
        ("default", {}),
        ("yarn", dict(rope_parameters=YARN)),
        ("no_q_lora", dict(q_lora_rank=None)),
        (
            "all_moe_topk1",
            dict(
                first_k_dense_replace=0,
                num_experts_per_tok=1,
                n_group=1,
                norm_topk_prob=False,
                routed_scaling_factor=1.0,
            ),
        ),
    ],
)
def test_logits_match_transformers(tmp_path, variant, overrides):
    hf_model = make_hf_model("deepseek_v3", **overrides)
    hf_model.save_pretrained(tmp_path)
    model, cfg = load_hf_model(str(tmp_path))
    assert cfg.num_layers == 3 and cfg.mla is not None
    diff = max_logit_diff(hf_model, model, seq=64)
    print(f"deepseek_v3 {variant}: max |logit diff| = {diff:.2e}")
    assert diff <= TOL


def test_packed_sequences_match_transformers(tmp_path):
    """The trainer packs sequences (megatron's thd format): MLA's RoPE restarts per sequence
    (YaRN here) and attention stays within each."""
    hf_model = make_hf_model("deepseek_v3", seed=2, rope_parameters=YARN)
    hf_model.save_pretrained(tmp_path)
    model, _ = load_hf_model(str(tmp_path))
    lengths = [40, 17, 7]
    seqs = [token_batch(i, batch=1, seq=n)[0] for i, n in enumerate(lengths)]
    params, positions = packed(lengths)
    with torch.no_grad():
        got = model(torch.cat(seqs)[None], positions, None, packed_seq_params=params)[0]
    want = torch.cat([hf_logits(hf_model, s[None])[0] for s in seqs])
    assert (got - want).abs().max() <= TOL


def test_layers_router_and_expert_bias(tmp_path):
    """Layer 0 dense, 1-2 MoE with the checkpoint's expert bias; the bias changes the routing
    (zeroing it moves the logits) and stays as loaded through a training step, megatron's
    bias update included."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    hf_model = make_hf_model("deepseek_v3", seed=4)
    hf_model.save_pretrained(tmp_path)
    model, cfg = load_hf_model(str(tmp_path))
    assert cfg.moe_layer_freq == [0, 1, 1] and cfg.moe_router_num_groups == 2
    layers = model.decoder.layers
    assert not hasattr(layers[0].mlp, "router")
    bias = layers[1].mlp.router.expert_bias
    want = hf_model.model.layers[1].mlp.gate.e_score_correction_bias
    assert want.abs().min() > 0 and torch.equal(bias, want)
    assert not any("expert_bias" in n for n, _ in model.named_parameters())
    mm.apply_multi_lora(model, 2, 4, 8.0, target_modules=["linear_fc1"])
    ids = token_batch(0)
    mm.set_tokens_per_adapter_slot(model.train(), [ids.numel(), 0])
    positions = torch.arange(ids.size(1))[None].expand_as(ids)
    model(ids, positions, None).sum().backward()  # with grad the router counts tokens
    _update_router_expert_bias([model], model.config)
    assert torch.equal(bias, want)
    with torch.no_grad():
        for layer in layers[1:]:
            layer.mlp.router.expert_bias.zero_()
    assert max_logit_diff(hf_model, model.eval()) > 1e-2


def test_sharded_checkpoint(tmp_path):
    hf_model = make_hf_model("deepseek_v3", seed=3)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_hf_model(str(tmp_path))
    assert max_logit_diff(hf_model, model) <= TOL


def test_prediction_module_tensors_are_skipped_others_refused(tmp_path):
    """DeepSeek-V3 checkpoints append multi-token-prediction layers past num_hidden_layers;
    they are skipped, while an unknown tensor of a real layer still fails the import."""
    import os

    from safetensors.torch import save_file

    hf_model = make_hf_model("deepseek_v3", seed=6)
    hf_model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    extra = {"model.layers.3.eh_proj.weight": torch.ones(64, 128)}
    save_file({**state, **extra}, os.path.join(tmp_path, "model.safetensors"))
    model, _ = load_hf_model(str(tmp_path))
    assert max_logit_diff(hf_model, model) <= TOL
    save_file(
        {**state, "model.layers.2.mlp.bogus.weight": torch.ones(2)},
        os.path.join(tmp_path, "model.safetensors"),
    )
    with pytest.raises(ValueError, match="bogus"):
        load_hf_model(str(tmp_path))


def test_config_mapping():
    cfg = hf_to_model_config(make_hf_model("deepseek_v3", rope_parameters=YARN).config.to_dict())
    mla = cfg.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim) == (48, 32, 16)
    assert (mla.qk_pos_emb_head_dim, mla.v_head_dim, mla.rope_type) == (8, 24, "yarn")
    assert (mla.rotary_scaling_factor, mla.mscale, mla.mscale_all_dim) == (4.0, 0.9, 0.8)
    assert (cfg.ffn_hidden_size, cfg.moe_ffn_hidden_size) == (96, 32)
    assert cfg.moe_shared_expert_intermediate_size == 32
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert (cfg.moe_router_group_topk, cfg.moe_router_topk_scaling_factor) == (1, 1.7)


def test_layout_checks():
    """MLA at TP > 1 needs sequence parallelism (megatron leaves the RoPE key's gradient
    partial without it); the dense/MoE pattern names every layer."""
    from megatron_multilora.models.mla_config import mla_layout_problems

    cfg = hf_to_model_config(make_hf_model("deepseek_v3").config.to_dict())
    assert cfg.check(2) == []
    assert mla_layout_problems(2, True) == [] and mla_layout_problems(1, False) == []
    assert "needs sequence parallelism" in mla_layout_problems(2, False)[0]
    cfg.moe_layer_freq = [0, 1]
    cfg.mla = dataclasses.replace(cfg.mla, qk_pos_emb_head_dim=7)
    problems = "\n".join(cfg.check(2))
    assert "moe_layer_freq=[0, 1]: give each of the num_layers=3 layers 0" in problems
    cfg.moe_layer_freq = [0, 2, 1]
    assert "moe_layer_freq=[0, 2, 1]" in "\n".join(cfg.check(2))
    assert "mla.qk_pos_emb_head_dim=7 must be even" in problems


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"rope_interleave": False}, "rope_interleave=False"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
        ({"n_group": 2, "topk_group": 2}, "n_group=2"),  # groups ranked by top 1 in megatron
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters"),
        (
            {"rope_parameters": {**YARN, "mscale": None}},  # transformers ignores mscale_all_dim
            "mscale_all_dim without mscale",
        ),
        ({"rope_parameters": {**YARN, "truncate": False}}, "truncate=False"),
    ],
)
def test_refused(fields, named):
    config = {**make_hf_model("deepseek_v3").config.to_dict(), **fields}
    with pytest.raises(ValueError, match="deepseek_v3") as err:
        hf_to_model_config(config)
    assert named in str(err.value)


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_peft_export_loads_in_peft_and_round_trips(tmp_path, q_lora_rank):
    import peft

    hf = make_hf_model("deepseek_v3", q_lora_rank=q_lora_rank)
    hf.save_pretrained(tmp_path / "base")
    model, cfg = load_hf_model(str(tmp_path / "base"))
    q = ["linear_q_proj"] if q_lora_rank is None else ["linear_q_down_proj", "linear_q_up_proj"]
    mm.apply_multi_lora(model, 3, 8, 1.0, target_modules=[*q, *LINEARS])
    trained_like_slot(model, 1)
    ids = token_batch()
    mm.set_tokens_per_adapter_slot(model, [0, ids.numel(), 0])
    want = megatron_logits(model, ids)
    export_peft(model, 1, tmp_path / "peft", cfg, "deepseek_v3", str(tmp_path / "base"))
    tensors = load_file(str(tmp_path / "peft/adapter_model.safetensors"))
    hf_q = ["q_proj"] if q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    for name in [
        *hf_q,
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "mlp.gate_proj",
        "shared_experts.up_proj",
        "experts.3.down_proj",
    ]:
        assert any(f".{name}.lora_B" in k for k in tensors), name

    wrapped = peft.PeftModel.from_pretrained(
        make_hf_model("deepseek_v3", q_lora_rank=q_lora_rank), str(tmp_path / "peft")
    ).eval()
    add_skipped_mlp_deltas(wrapped, tmp_path / "peft")
    got = hf_logits(wrapped, ids)
    assert (want - hf_logits(hf, ids)).abs().max() > 1e-2  # the adapter matters
    print(f"deepseek_v3 peft vs megatron: {(got - want).abs().max():.2e}")
    assert (got - want).abs().max() <= TOL

    import_peft(model, 2, tmp_path / "peft", cfg, "deepseek_v3")
    one, two = get_slot_tensors(model, 1), get_slot_tensors(model, 2)
    assert one.keys() == two.keys()
    for key in one:
        assert torch.equal(one[key], two[key]), key


def test_peft_target_names_wrap_the_mla_linears_they_name(tmp_path):
    """lora.targets as DeepSeek-V3's PEFT users write them: q_a_proj, kv_b_proj and o_proj
    wrap megatron's q down-, kv up- and output projections only, and export as those."""
    hf = make_hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path / "base")
    model, cfg = load_hf_model(str(tmp_path / "base"))
    mm.apply_multi_lora(model, 2, 4, 1.0, target_modules=["q_a_proj", "kv_b_proj", "o_proj"])
    wrapped = {name.rsplit(".", 1)[-1] for name, _ in named_multi_lora_modules(model)}
    assert wrapped == {"linear_q_down_proj", "linear_kv_up_proj", "linear_proj"}
    trained_like_slot(model, 1)
    export_peft(model, 1, tmp_path / "peft", cfg, "deepseek_v3", str(tmp_path / "base"))
    config = json.loads((tmp_path / "peft/adapter_config.json").read_text())
    assert config["target_modules"] == ["kv_b_proj", "o_proj", "q_a_proj"]
