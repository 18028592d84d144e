"""Gemma 3 text (``gemma3_text``) import, world of one: Megatron logits equal transformers'
(plain, sharded, packed sequences, linear RoPE scaling), every Gemma part moves the logits
when taken away, PEFT export/import round-trips, and config.json maps (Gemma 3 270M's too)
or is refused naming what is not reproduced."""

import dataclasses
import json

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.checkpoint.peft_format import export_peft, import_peft
from megatron_multilora.layers.slot_tensors import get_slot_tensors
from megatron_multilora.models.hf_config import hf_to_model_config, read_hf_config
from megatron_multilora.models.hf_import import (
    INIT_FOR_CHECKPOINT,
    load_hf_checkpoint,
    load_hf_model,
)
from megatron_multilora.training.step import generation
from tests.hf_models import hf_logits, make_hf_model, packed, token_batch
from tests.unit.test_hf_import import TOL, max_logit_diff, save

pytest.importorskip("transformers")

GEMMA = "gemma3_text"
FOUR_LAYERS = dict(num_hidden_layers=4)  # sliding, full, sliding, full (pattern 2)
S, F = "sliding_attention", "full_attention"
# Taking a part away must move the logits by far more than the tolerance.
MATTERS = 100 * TOL


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    hf = make_hf_model(GEMMA, **FOUR_LAYERS)
    return hf, save(hf, tmp_path_factory.mktemp("gemma3"))


def test_logits_match_transformers(gemma):
    hf, folder = gemma
    model, cfg = load_hf_model(folder)
    assert cfg.layer_types == [S, F, S, F] and cfg.tie_word_embeddings
    assert (cfg.rotary_base, cfg.local_rotary_base, cfg.sliding_window) == (50000, 500.0, 5)
    assert cfg.softmax_scale == 24**-0.5 and cfg.activation == "gelu_tanh"
    diff = max_logit_diff(hf, model)
    print(f"gemma3_text: max |logit diff| = {diff:.2e}")
    assert diff <= TOL


def test_norm_weights_are_imported_as_one_plus_w(gemma):
    hf, folder = gemma
    params = dict(load_hf_model(folder)[0].named_parameters())
    hf_layer = hf.model.layers[2]
    for key, weight in (
        ("input_layernorm", hf_layer.input_layernorm),
        ("self_attn_bda.norm", hf_layer.post_attention_layernorm),
        ("pre_mlp_layernorm", hf_layer.pre_feedforward_layernorm),
        ("mlp_bda.norm", hf_layer.post_feedforward_layernorm),
        ("self_attention.q_layernorm", hf_layer.self_attn.q_norm),
        ("self_attention.k_layernorm", hf_layer.self_attn.k_norm),
    ):
        assert torch.equal(params[f"decoder.layers.2.{key}.weight"], 1 + weight.weight), key
    assert torch.equal(params["decoder.final_layernorm.weight"], 1 + hf.model.norm.weight)


def test_gradients_match_transformers(gemma):
    """Backward through the scaled (tied) embedding, the post norms, the per-head q/k norms
    and both RoPE tables."""
    _, folder = gemma
    hf = make_hf_model(GEMMA, **FOUR_LAYERS)  # the fixture's weights, its own gradients
    model, _ = load_hf_model(folder)
    ids = token_batch(0)
    weights = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(ids.size(1))[None].expand_as(ids)
    (model(ids, positions, None, runtime_gather_output=True) * weights).sum().backward()
    (hf(ids).logits * weights).sum().backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    hf_layer = hf.model.layers[0]
    for key, hf_module in (
        ("embedding.word_embeddings.weight", hf.model.embed_tokens),
        ("decoder.layers.0.self_attn_bda.norm.weight", hf_layer.post_attention_layernorm),
        ("decoder.layers.0.mlp_bda.norm.weight", hf_layer.post_feedforward_layernorm),
        ("decoder.layers.0.self_attention.k_layernorm.weight", hf_layer.self_attn.k_norm),
        ("decoder.layers.0.self_attention.linear_proj.weight", hf_layer.self_attn.o_proj),
    ):
        got, want = grads[key], hf_module.weight.grad
        if key.startswith("embedding"):  # transformers: no lookup gradient for the pad row 0
            got, want = got[1:], want[1:]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), key


def test_sharded_checkpoint(tmp_path):
    hf = make_hf_model(GEMMA, seed=3, **FOUR_LAYERS)
    folder = save(hf, tmp_path, max_shard_size="40KB")
    assert len([f for f in tmp_path.iterdir() if f.suffix == ".safetensors"]) > 1
    assert max_logit_diff(hf, load_hf_model(folder)[0]) <= TOL


def test_linear_rope_scaling_of_the_global_layers(tmp_path):
    hf = make_hf_model(GEMMA, **FOUR_LAYERS, rope_scaling={"rope_type": "linear", "factor": 4.0})
    folder = save(hf, tmp_path)
    model, cfg = load_hf_model(folder)
    assert cfg.seq_len_interpolation_factor == 4.0
    assert max_logit_diff(hf, model) <= TOL
    assert max_logit_diff(hf, variant(folder, seq_len_interpolation_factor=None)) > MATTERS


def variant(folder: str, **changes) -> torch.nn.Module:
    """The checkpoint in a model whose config differs by ``changes``."""
    cfg = dataclasses.replace(hf_to_model_config(read_hf_config(folder)), **changes)
    model = mm.build_gpt_model(cfg, **INIT_FOR_CHECKPOINT)
    load_hf_checkpoint(model, folder, cfg)
    return model.eval()


@pytest.mark.parametrize(
    "changes,at_least",
    [
        pytest.param(dict(scale_embeddings=False), MATTERS, id="embedding-scale"),
        # the sliding layers rotating with the global base
        pytest.param(dict(local_rotary_base=None), MATTERS, id="local-rope-base"),
        # 1/sqrt(head_dim) instead of query_pre_attn_scalar ** -0.5
        pytest.param(dict(softmax_scale=None), MATTERS, id="softmax-scale"),
        # exact GELU instead of its tanh approximation: close, yet 15x the tolerance (1.5e-3)
        pytest.param(dict(activation="gelu"), 5 * TOL, id="gelu-tanh"),
    ],
)
def test_each_part_moves_the_logits(gemma, changes, at_least):
    hf, folder = gemma
    diff = max_logit_diff(hf, variant(folder, **changes))
    print(f"without {changes}: max |logit diff| = {diff:.2e}")
    assert diff > at_least


def test_post_norms_move_the_logits(gemma):
    hf, folder = gemma
    model, _ = load_hf_model(folder)
    for layer in model.decoder.layers:
        layer.self_attn_bda.norm = layer.mlp_bda.norm = torch.nn.Identity()
    assert max_logit_diff(hf, model) > MATTERS


def test_packed_sequences_match_transformers_per_sequence(gemma):
    """Packed (thd) sequences rotate from their own position 0; the packed RoPE keeps one
    cos/sin per table (global and local) for all layers of the micro-batch."""
    hf, folder = gemma
    model, _ = load_hf_model(folder)
    lengths = [5, 7, 4]
    params, positions = packed(lengths)
    ends = params.cu_seqlens_q
    ids = token_batch(4, batch=1)
    with torch.no_grad():
        got = model(ids, positions, None, packed_seq_params=params, runtime_gather_output=True)
    for a, b in zip(ends[:-1].tolist(), ends[1:].tolist()):
        assert (got[0, a:b] - hf_logits(hf, ids[:, a:b])[0]).abs().max() <= TOL
    assert len(ends._rope_cos_sin) == 2


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv-cache", "uncached"])
def test_generation_logprobs_match_transformers(gemma, kv_cache):
    """Serving: with the KV cache each step rotates at its offset in the RoPE tables (the
    local one derived from the global one). The continuations are scripted (this tiny tied
    model greedily repeats its last token), and each step's log-prob of its token must be
    transformers' on the whole sequence."""
    hf, folder = gemma
    model = mm.apply_multi_lora(load_hf_model(folder)[0], 1, 4, 1.0)
    prompts = [token_batch(s, batch=1, seq=n)[0].tolist() for s, n in ((0, 5), (1, 3))]
    script = token_batch(2, batch=2, seq=8).tolist()

    def scripted(logits: torch.Tensor, rows: list[int], done: list[int]) -> torch.Tensor:
        return torch.tensor([script[r][n] for r, n in zip(rows, done)])

    got = generation.generate(
        model, [(0, p) for p in prompts], 1, 8, -1, 1, 0, kv_cache, pick=scripted
    )
    for prompt, tail, out in zip(prompts, script, got):
        assert out.tokens == tail
        logprobs = torch.log_softmax(hf_logits(hf, torch.tensor([prompt + tail]))[0], -1)
        want = logprobs[len(prompt) - 1 : -1].gather(1, torch.tensor(tail)[:, None])[:, 0]
        assert (torch.tensor(out.logprobs) - want).abs().max() <= TOL


def test_peft_round_trip_is_exact(gemma, tmp_path):
    _, folder = gemma
    model, cfg = load_hf_model(folder)
    mm.apply_multi_lora(model, 3, 8, 1.0, row_init_method="normal")
    mm.init_adapter_slot(model, 0, 4, 12.0)
    export_peft(model, 0, tmp_path / "a", cfg, GEMMA, folder)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == {
        *("q_proj", "k_proj", "v_proj", "o_proj"),
        *("gate_proj", "up_proj", "down_proj"),
    }
    import_peft(model, 2, tmp_path / "a", cfg, GEMMA)
    first, second = get_slot_tensors(model, 0), get_slot_tensors(model, 2)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


GEMMA3_270M = {
    "model_type": GEMMA,
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "layer_types": [F if (i + 1) % 6 == 0 else S for i in range(18)],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
}


def test_gemma3_270m_config_maps():
    cfg = hf_to_model_config(GEMMA3_270M)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size) == (
        18,
        640,
        2048,
        262144,
    )
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels) == (4, 1, 256)
    assert cfg.tie_word_embeddings and cfg.qk_layernorm and cfg.post_norms
    assert cfg.scale_embeddings and cfg.activation == "gelu_tanh" and cfg.softmax_scale == 1 / 16
    assert (cfg.rotary_base, cfg.local_rotary_base, cfg.seq_len_interpolation_factor) == (
        1000000,
        10000.0,
        None,
    )
    assert [i for i, t in enumerate(cfg.layer_types) if t == F] == [5, 11, 17]
    assert cfg.sliding_window == 512 and cfg.check(1) == []


def test_older_config_json_maps():
    """Top-level rope fields (rope_scaling for the global layers) and sliding_window_pattern
    instead of layer_types, as configs written before transformers 5 have them."""
    old = {k: v for k, v in GEMMA3_270M.items() if k not in ("layer_types", "rope_parameters")}
    old.update(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
    )
    cfg = hf_to_model_config(old)
    assert cfg.layer_types == GEMMA3_270M["layer_types"] and cfg.sliding_window == 512
    assert (cfg.rotary_base, cfg.local_rotary_base, cfg.seq_len_interpolation_factor) == (
        1000000,
        10000.0,
        8.0,
    )


@pytest.mark.parametrize(
    "fields,named",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}},
            "rope_parameters['full_attention']",
        ),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope_parameters['sliding_attention']",
        ),
        ({"rope_parameters": {"rope_type": "default"}}, "rope_parameters"),
    ],
)
def test_unsupported_gemma3_config_raises(fields, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[")) as e:
        hf_to_model_config({**GEMMA3_270M, **fields})
    assert GEMMA in str(e.value)
