"""Hugging Face checkpoint import (world of one): Megatron logits equal transformers logits
for every supported family, sharded and fused-expert checkpoints, wrapped models, and clear
errors for what is not supported."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import megatron_multilora as mm
from megatron_multilora.models.gpt_config import YarnConfig
from megatron_multilora.models.hf_config import hf_to_model_config, read_hf_config
from megatron_multilora.models.hf_import import (
    MissingTensorError,
    load_hf_checkpoint,
    load_hf_model,
    load_hf_tokenizer,
)
from tests.hf_models import FAMILIES, MOE, hf_logits, make_hf_model, megatron_logits, token_batch

pytest.importorskip("transformers")

# fp32 on both sides; observed <= 5e-6 (MoE: different summation orders) on logits of
# magnitude ~6, while a mis-mapped tensor gives O(1) errors.
TOL = 1e-4


def max_logit_diff(hf_model, model, seeds=(0, 1, 2)) -> float:
    return max(
        (megatron_logits(model, token_batch(s)) - hf_logits(hf_model, token_batch(s)))
        .abs()
        .max()
        .item()
        for s in seeds
    )


def save(hf_model, folder, **kwargs) -> str:
    hf_model.save_pretrained(folder, **kwargs)
    return str(folder)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_logits_match_transformers(tmp_path, model_type):
    hf_model = make_hf_model(model_type)
    model, cfg = load_hf_model(save(hf_model, tmp_path))
    assert cfg.num_layers == 2 and cfg.vocab_size == 128
    diff = max_logit_diff(hf_model, model)
    print(f"{model_type}: max |logit diff| = {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("model_type", ["qwen3", "phi3", "mixtral", "qwen2_moe"])
def test_sharded_checkpoint(tmp_path, model_type):
    hf_model = make_hf_model(model_type, seed=3)
    folder = save(hf_model, tmp_path, max_shard_size="40KB")
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    assert "model.safetensors.index.json" in os.listdir(folder) and len(shards) > 1
    model, _ = load_hf_model(folder)
    assert max_logit_diff(hf_model, model) <= TOL


def test_tied_embeddings(tmp_path):
    hf_model = make_hf_model("llama", tie_word_embeddings=True)
    model, cfg = load_hf_model(save(hf_model, tmp_path))
    assert cfg.tie_word_embeddings and model.output_layer.weight is None
    assert max_logit_diff(hf_model, model) <= TOL


def test_fused_expert_tensors(tmp_path):
    """transformers 5 keeps experts fused in memory (gate_up_proj [E, 2I, H],
    down_proj [E, H, I]); a checkpoint written from that state dict loads too."""
    hf_model = make_hf_model("qwen3_moe", seed=5)
    hf_model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    model, _ = load_hf_model(str(tmp_path))
    assert max_logit_diff(hf_model, model) <= TOL


@pytest.mark.parametrize("model_type", ["qwen2", "qwen2_moe"])
def test_wrapped_model_loads_base_weights(tmp_path, model_type):
    """After apply_multi_lora the base linears sit at ``<name>.to_wrap``; loading fills them
    and leaves the adapter slots alone (zero B: logits stay the base model's)."""
    hf_model = make_hf_model(model_type, seed=7)
    folder = save(hf_model, tmp_path)
    cfg = hf_to_model_config(read_hf_config(folder))
    model = mm.build_gpt_model(cfg)
    mm.apply_multi_lora(model, 2, 4, 8.0)
    adapters_before = {k: v.clone() for k, v in model.state_dict().items() if ".adapters." in k}
    load_hf_checkpoint(model, folder, cfg)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    assert isinstance(qkv, mm.MultiLoRALinear)
    # Group 0 of the fused layout starts with q heads 0..1 of q_proj.
    torch.testing.assert_close(
        qkv.to_wrap.weight[:32], hf_model.model.layers[0].self_attn.q_proj.weight[:32]
    )
    for k, v in model.state_dict().items():
        if k in adapters_before:
            assert torch.equal(v, adapters_before[k]), k
    # One adapter slot holds every token of the (3 x 16)-token batches.
    mm.set_tokens_per_adapter_slot(model, [token_batch(0).numel(), 0])
    assert max_logit_diff(hf_model, model.eval()) <= TOL


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_bf16_load_casts_each_tensor(tmp_path, model_type):
    hf_model = make_hf_model(model_type, seed=2)
    model, _ = load_hf_model(save(hf_model, tmp_path), params_dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    want = hf_model.model.layers[1].self_attn.o_proj.weight.to(torch.bfloat16)
    assert torch.equal(params["decoder.layers.1.self_attention.linear_proj.weight"], want)
    ids = token_batch(0)
    per_token = (megatron_logits(model, ids).float() - hf_logits(hf_model, ids)).abs().amax(-1)
    p90 = per_token.flatten().quantile(0.9).item()
    print(
        f"{model_type} bf16 vs fp32 transformers: per-token max |logit diff| "
        f"p90 {p90:.2e}, max {per_token.max().item():.2e}"
    )
    # bf16 rounding (transformers in bf16 is as far off); a rare MoE top-k flip may move one
    # token by ~1, a mapping error moves nearly all tokens by O(1).
    assert p90 < 0.3


def test_config_mapping():
    cfg = hf_to_model_config(
        {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 3,
            "hidden_size": 64,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 96,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "vocab_size": 100,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "qkv_bias": True,
        }
    )
    assert (cfg.num_layers, cfg.num_query_groups, cfg.kv_channels) == (3, 2, 8)
    assert (cfg.rotary_base, cfg.norm_epsilon, cfg.max_sequence_length) == (1000000, 1e-6, 256)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and not cfg.qk_layernorm
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (6, 2, 24)
    assert cfg.moe_router_pre_softmax  # no renormalisation of the top-k probabilities
    assert cfg.moe_shared_expert_intermediate_size == 40 and cfg.moe_shared_expert_gate
    mixtral = hf_to_model_config({**_minimal("mixtral"), "norm_topk_prob": False})
    assert not mixtral.moe_router_pre_softmax  # Mixtral always renormalises
    assert mixtral.moe_ffn_hidden_size == mixtral.ffn_hidden_size
    olmoe = hf_to_model_config(_minimal("olmoe"))
    assert olmoe.qk_layernorm and olmoe.qk_layernorm_across_heads
    qwen3 = hf_to_model_config({**_minimal("qwen3"), "rope_theta": 12345.5})
    assert qwen3.qk_layernorm and not qwen3.qk_layernorm_across_heads
    assert qwen3.rotary_base == 12345.5


S, F = "sliding_attention", "full_attention"


def _minimal(model_type: str) -> dict:
    d = {
        "model_type": model_type,
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 128,
        "hidden_act": "silu",
    }
    if model_type in MOE:
        d.update(
            num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
        )
    return d


@pytest.mark.parametrize(
    "model_type,fields,named",
    [
        ("gpt2", {}, "model_type 'gpt2'"),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
            "rope_parameters",
        ),
        ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("llama", {"attention_bias": True}, "attention_bias=True"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("qwen3", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
        ("phi3", {"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "rope_scaling"),
        (
            "phi3",
            {
                "partial_rotary_factor": 0.5,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 8,
                },
            },
            "YaRN over part of each head",
        ),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("qwen3_5_text", {"layer_types": ["linear_attention", S]}, "layer_types"),
        ("qwen3_5_text", {"attn_output_gate": False}, "attn_output_gate=False"),
        ("qwen3_5_text", {"attention_bias": True}, "attention_bias=True"),
        ("qwen3_5_moe_text", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        (
            "qwen3_5_text",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "rope_parameters",
        ),
    ],
)
def test_unsupported_config_raises(model_type, fields, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")) as e:
        hf_to_model_config({**_minimal(model_type), **fields})
    assert model_type in str(e.value)


@pytest.mark.parametrize(
    "model_type,fields,window,layer_types",
    [
        ("mistral", {"sliding_window": 64, "max_position_embeddings": 4096}, 64, None),
        ("mistral", {"sliding_window": None}, None, None),
        ("phi3", {"sliding_window": 2047, "max_position_embeddings": 4096}, 2047, None),
        ("mixtral", {"sliding_window": 4096, "max_position_embeddings": 4096}, None, None),
        # Qwen2/3 before config.json named the layers: from max_window_layers on
        (
            "qwen2",
            {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1},
            64,
            [F, S],
        ),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, None, None),  # 28 on
        ("qwen2", {"use_sliding_window": False, "sliding_window": 64}, None, None),
        ("qwen3", {"layer_types": [S, F], "sliding_window": 8}, 8, [S, F]),
        ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, 8, None),
        ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 8}, 8, [S, F]),
    ],
)
def test_which_layers_have_a_window(model_type, fields, window, layer_types):
    cfg = hf_to_model_config({**_minimal(model_type), **fields})
    assert (cfg.sliding_window, cfg.layer_types) == (window, layer_types)


def test_glm4_moe_maps_its_defaults_and_keeps_q_k_v_biases_its_own():
    """GLM-4.5's RoPE covers half of each head where config.json says nothing, its
    attention_bias is q/k/v biases (Llama's is still refused: it would bias o_proj too), and
    its MoE starts after first_k_dense_replace dense layers."""
    glm = {
        **_minimal("glm4_moe"),
        "num_hidden_layers": 3,
        "attention_bias": True,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 2,
    }
    cfg = hf_to_model_config(glm)
    assert (cfg.rotary_percent, cfg.add_qkv_bias, cfg.qk_layernorm) == (0.5, True, False)
    assert cfg.moe_layer_freq == [0, 0, 1] and cfg.moe_router_score_function == "sigmoid"
    assert hf_to_model_config({**glm, "partial_rotary_factor": 1.0}).rotary_percent == 1.0
    with pytest.raises(ValueError, match="llama: attention_bias=True"):
        hf_to_model_config({**_minimal("llama"), "attention_bias": True})


def test_glm4_moe_skips_the_prediction_layers_a_checkpoint_appends(tmp_path):
    hf_model = make_hf_model("glm4_moe")
    folder = save(hf_model, tmp_path)
    tensors = load_file(f"{folder}/model.safetensors")
    extra = {"model.layers.2.eh_proj.weight": torch.ones(64, 128)}
    save_file({**tensors, **extra}, f"{folder}/model.safetensors", metadata={"format": "pt"})
    model, _ = load_hf_model(folder)
    assert max_logit_diff(hf_model, model) <= TOL


def test_llama3_rope_scaling_maps_every_band_setting():
    cfg = hf_to_model_config(
        {
            **_minimal("llama"),
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rope_theta": 500000.0,
        }
    )
    assert (cfg.rope_scaling_factor, cfg.rope_original_max_positions) == (32.0, 8192)
    assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rotary_base) == (
        1.0,
        4.0,
        500000,
    )


@pytest.mark.parametrize(
    "model_type,field,value",
    [
        ("llama3", "rope_scaling_factor", None),
        ("llama3", "rope_low_freq_factor", 1.0),  # megatron's default band, not the checkpoint's
        ("phi3", "rotary_percent", 1.0),
        ("gpt_oss", "activation_clamp", None),
        ("gpt_oss", "glu_linear_offset", 0.0),
        ("gpt_oss", "sliding_window", None),
        ("gpt_oss", "yarn", None),
        ("qwen3_yarn", "yarn", None),
        ("qwen3_yarn", "yarn", YarnConfig(4.0, 8, 8.0, 0.5, truncate=True)),
        ("qwen3_yarn", "yarn", YarnConfig(4.0, 8, 8.0, 0.5, False, attention_factor=1.0)),
    ],
)
def test_each_rope_setting_changes_the_logits(tmp_path, model_type, field, value):
    """The settings the families above differ by are not idle: built without one, the
    model is far from transformers' logits (so the equality tests check them)."""
    import dataclasses

    hf_model = make_hf_model(model_type)
    folder = save(hf_model, tmp_path)
    cfg = dataclasses.replace(hf_to_model_config(read_hf_config(folder)), **{field: value})
    model = mm.build_gpt_model(cfg)
    load_hf_checkpoint(model, folder, cfg)
    assert max_logit_diff(hf_model, model.eval()) > 1e-2


def test_mixtral_window_covering_every_position_is_accepted():
    cfg = hf_to_model_config(
        {**_minimal("mixtral"), "sliding_window": 4096, "max_position_embeddings": 4096}
    )
    assert cfg.num_moe_experts == 4 and cfg.sliding_window is None


def test_missing_tensor_raises_naming_it(tmp_path):
    folder = save(make_hf_model("llama"), tmp_path)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, path)
    with pytest.raises(
        MissingTensorError,
        match=r"model\.layers\.1\.self_attn\.k_proj\.weight"
        r".*decoder\.layers\.1\.self_attention\.linear_qkv\.weight",
    ):
        load_hf_model(folder)


def test_unexpected_tensor_raises_naming_it(tmp_path):
    """A tensor the model has no place for (here an o_proj bias) would be silently lost."""
    folder = save(make_hf_model("llama"), tmp_path)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(state, path)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_hf_model(folder)


def test_missing_shard_file_raises(tmp_path):
    folder = save(make_hf_model("llama"), tmp_path, max_shard_size="40KB")
    shard = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(folder, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        load_hf_model(folder)


def test_tokenizer_loads_from_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<s>", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(tmp_path)
    loaded = load_hf_tokenizer(str(tmp_path))
    assert loaded("hello world")["input_ids"] == [3, 4]


def test_reading_config_json_names_the_file(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"config\.json not found \(expected a Hugging Face"
    ):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": ')
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('["llama"]')
    with pytest.raises(ValueError, match=r"config\.json: not a JSON object"):
        read_hf_config(tmp_path)


def test_renormalised_top1_moe_imports_exactly(tmp_path):
    """Mixtral with one expert per token renormalises its top-1 probability to 1.0: megatron's
    softmax over the chosen logit gives the same (it refuses it only for router training)."""
    hf_model = make_hf_model("mixtral", num_experts_per_tok=1)
    model, cfg = load_hf_model(save(hf_model, tmp_path))
    assert cfg.moe_router_topk == 1 and not cfg.moe_router_pre_softmax
    assert max_logit_diff(hf_model, model) <= TOL


def test_a_weights_file_damaged_after_the_check_is_named(tmp_path):
    """The config check finds a truncated file first; one damaged later (or read without the
    check) still ends in a message naming it, not safetensors' own error."""
    from megatron_multilora.errors import RunError

    folder = save(make_hf_model("llama"), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096])
    with pytest.raises(RunError, match=f"{weights} cannot be read .*damaged or incomplete"):
        load_hf_model(folder)


WINDOWED = ("mistral", "phi3", "qwen2", "gemma3_text", "smollm3", "mixtral", "gpt_oss")


@pytest.mark.parametrize("model_type", WINDOWED)
def test_windows_hold_packed_and_in_the_kv_cache(tmp_path, model_type):
    """Sequences of several windows, packed (per-length batches, and the one pass a CUDA
    graph takes) and generated through the KV cache, each equal to transformers' logits of
    the sequence alone; without the window the logits differ by O(1)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_multilora.models.torch_modules import attend_in_one_pass
    from tests.hf_models import packed

    hf_model = make_hf_model(model_type)
    model, cfg = load_hf_model(save(hf_model, tmp_path))
    lengths = [16, 7, 13]
    assert cfg.sliding_window is not None and 2 * cfg.sliding_window < max(lengths)
    ids = token_batch(batch=1, seq=sum(lengths))
    alone = [hf_logits(hf_model, seq)[0] for seq in ids.split(lengths, dim=1)]
    full = hf_model.config.sliding_window
    hf_model.config.sliding_window = 10**6
    assert (hf_logits(hf_model, ids[:, :16])[0] - alone[0]).abs().max() > 0.1
    hf_model.config.sliding_window = full
    for one_pass in (False, True):
        params, positions = packed(lengths)
        if one_pass:
            attend_in_one_pass(params)
        with torch.no_grad():
            out = model(ids, positions, None, packed_seq_params=params)[0]
        assert (out - torch.cat(alone)).abs().max() <= TOL, f"one pass: {one_pass}"
    seq, prefill = ids[:, :16], 3
    context = StaticInferenceContext(max_batch_size=1, max_sequence_length=16)
    with torch.no_grad():
        for end in range(prefill, 17):
            start = 0 if end == prefill else end - 1
            out = model(
                seq[:, start:end],
                torch.arange(start, end)[None],
                None,
                inference_context=context,
                runtime_gather_output=True,
            )
            context.sequence_len_offset = end
            assert (out[0, -1] - alone[0][end - 1]).abs().max() <= TOL, f"position {end - 1}"


def test_gpt_oss_mxfp4_experts_are_dequantized(tmp_path):
    """gpt-oss checkpoints ship their experts in MXFP4 (``*_blocks``, ``*_scales``): loaded
    dequantized (transformers' own function), the logits equal transformers' with those
    values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model = make_hf_model("gpt_oss")
    gen = torch.Generator().manual_seed(4)
    packed = {}
    for layer in hf_model.model.layers:
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)  # [E, in, out]
            e, n_in, n_out = param.shape
            blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=gen).to(
                torch.uint8
            )
            scales = torch.randint(118, 123, (e, n_out, n_in // 32), generator=gen).to(torch.uint8)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed[name, id(layer)] = blocks, scales
    folder = save(hf_model, tmp_path)
    tensors = load_file(f"{folder}/model.safetensors")
    for i, layer in enumerate(hf_model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = packed[name, id(layer)]
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    model, _ = load_hf_model(folder)
    assert max_logit_diff(hf_model, model) <= TOL


def test_a_gpt_oss_20b_shaped_config_maps_every_field():
    """config.json fields as gpt-oss-20b's (rope_scaling at the top level, 24 layers
    alternating from sliding, a 128-token window, 32 experts, top-4, the clamp at 7)."""
    cfg = hf_to_model_config(
        {
            "model_type": "gpt_oss",
            "num_hidden_layers": 24,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "head_dim": 64,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "vocab_size": 201088,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-05,
            "rope_theta": 150000,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
                "truncate": False,
            },
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "swiglu_limit": 7.0,
            "attention_bias": True,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
    )
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.rotary_base) == (64, 8, 150000)
    assert (cfg.sliding_window, cfg.layer_types[:2]) == (
        128,
        ["sliding_attention", "full_attention"],
    )
    assert cfg.yarn == YarnConfig(32.0, 4096, 32.0, 1.0, truncate=False)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_ffn_hidden_size) == (32, 4, 2880)
    assert not cfg.moe_router_pre_softmax  # softmax over the top-k logits
    assert (cfg.activation, cfg.activation_clamp, cfg.glu_linear_offset) == ("quick_gelu", 7.0, 1.0)
    assert cfg.add_bias_linear and cfg.add_qkv_bias and cfg.softmax_type == "learnable"
    assert cfg.check(8) == []
    with pytest.raises(ValueError, match=r"swiglu_alpha=2\.0"):
        hf_to_model_config({**_minimal("gpt_oss"), "swiglu_alpha": 2.0})
