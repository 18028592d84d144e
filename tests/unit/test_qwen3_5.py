"""Qwen3.5: the gated delta rule against transformers' torch fallback; the model's Gated
DeltaNet layers on packed sequences longer than a chunk and through the KV cache, each equal
to transformers' logits of the sequence alone; the published image-text checkpoints.
(Logits, PEFT exports and layouts of the text models: with every family's, over
``tests/hf_models.py``.)"""

import pytest
import torch

from megatron_multilora.models.hf_import import load_hf_model
from megatron_multilora.ops.gated_delta_rule import (
    CHUNK,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from tests.hf_models import COMMON as COMMON_TEXT
from tests.hf_models import hf_logits, make_hf_model, megatron_logits, packed, token_batch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import modeling_qwen3_5 as reference  # noqa: E402

# Observed <= 3e-4 on logits of ~7 over 150 tokens (fp32; the tiny model's 0.2-std weights
# amplify rounding through its layers), while a state leaking between packed sequences or a
# chunk boundary off by one gives O(1) errors.
TOL = 2e-3


def rule_inputs(batch: int, length: int, key_heads: int = 2, ratio: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    heads = key_heads * ratio

    def draw(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = draw(batch, length, key_heads, 8), draw(batch, length, key_heads, 8)
    v = draw(batch, length, heads, 12)
    g = -torch.rand(batch, length, heads, generator=gen)  # log decays <= 0
    beta = torch.rand(batch, length, heads, generator=gen)
    return q, k, v, g, beta


def repeated(q, k, ratio=2):
    return q.repeat_interleave(ratio, 2), k.repeat_interleave(ratio, 2)


@pytest.mark.parametrize("length", [1, CHUNK - 1, CHUNK, CHUNK + 1, 150])
def test_the_chunked_rule_equals_transformers(length):
    q, k, v, g, beta = rule_inputs(2, length)
    state = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(9))
    want, want_state = reference.torch_chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    got, got_state = chunk_gated_delta_rule(*repeated(q, k), v, g, beta, state)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=0, atol=1e-5)
    # a step at a time, as decoding runs it
    steps, step_state = recurrent_gated_delta_rule(*repeated(q, k), v, g, beta, state)
    torch.testing.assert_close(steps, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(step_state, want_state, rtol=0, atol=1e-4)


def test_a_right_padded_sequence_keeps_its_own_outputs_and_state():
    q, k, v, g, beta = rule_inputs(1, 100)
    alone, alone_state = chunk_gated_delta_rule(
        *repeated(q[:, :70], k[:, :70]), v[:, :70], g[:, :70], beta[:, :70]
    )
    padded = [
        torch.nn.functional.pad(t[:, :70], (0, 0) * (t.dim() - 2) + (0, 30))
        for t in (q, k, v, g, beta)
    ]
    out, state = chunk_gated_delta_rule(*repeated(*padded[:2]), *padded[2:])
    torch.testing.assert_close(out[:, :70], alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, alone_state, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_delta_net_layers_packed_and_in_the_kv_cache(tmp_path, model_type):
    """Packed sequences across chunk boundaries start from zero states; the KV cache's
    prefill and decode steps carry the convolution's inputs and the rule's state, per row."""
    from megatron.core.inference.contexts import StaticInferenceContext

    hf_model = make_hf_model(model_type)
    hf_model.save_pretrained(tmp_path)
    model, cfg = load_hf_model(str(tmp_path))
    assert cfg.layer_types == ["linear_attention", "full_attention"]
    lengths = [150, 7, 70]
    ids = token_batch(batch=1, seq=sum(lengths))
    alone = [hf_logits(hf_model, seq)[0] for seq in ids.split(lengths, dim=1)]
    params, positions = packed(lengths)
    with torch.no_grad():
        out = model(ids, positions, None, packed_seq_params=params)[0]
    assert (out - torch.cat(alone)).abs().max() <= TOL
    # two rows generated together, the first prefilled alone (as generation does per slot)
    rows = torch.stack([ids[0, :20], ids[0, 150:170]])
    want = hf_logits(hf_model, rows)
    context = StaticInferenceContext(max_batch_size=2, max_sequence_length=20)
    prefill = 5
    with torch.no_grad():
        for row in (0, 1):
            context.batch_size_offset = row
            model(
                rows[row : row + 1, :prefill],
                torch.arange(prefill)[None],
                None,
                inference_context=context,
                runtime_gather_output=True,
            )
        context.batch_size_offset = 0
        for end in range(prefill + 1, 21):
            context.sequence_len_offset = end - 1
            out = model(
                rows[:, end - 1 : end],
                torch.full((2, 1), end - 1),
                None,
                inference_context=context,
                runtime_gather_output=True,
            )
            assert (out[:, -1] - want[:, end - 1]).abs().max() <= TOL, f"position {end - 1}"


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_the_published_image_text_checkpoints_load_their_language_model(tmp_path, model_type):
    """A ``qwen3_5`` checkpoint (transformers' image-text model: the language model below
    ``model.language_model``, a vision tower beside it) gives the text model's logits, and
    a slot's PEFT export, named for that model, loads onto it with peft."""
    import peft

    import megatron_multilora as mm
    from megatron_multilora.checkpoint.peft_format import export_peft
    from tests.hf_models import FAMILIES
    from tests.unit.test_peft_interop import merge_by_hand, trained_like_slot

    text = {**COMMON_TEXT, **FAMILIES[f"{model_type}_text"]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

    def published():
        config = transformers.AutoConfig.for_model(
            model_type, text_config=text, vision_config=vision
        )
        torch.manual_seed(0)
        return transformers.AutoModelForImageTextToText.from_config(config).float().eval()

    hf_model = published()
    hf_model.save_pretrained(tmp_path / "base")
    model, cfg = load_hf_model(str(tmp_path / "base"))
    assert cfg.layer_types == ["linear_attention", "full_attention"]
    ids = token_batch()
    assert (megatron_logits(model, ids) - hf_logits(hf_model, ids)).abs().max() <= TOL

    mm.apply_multi_lora(model, 2, 8, 1.0)
    trained_like_slot(model, 1)
    mm.set_tokens_per_adapter_slot(model, [0, ids.numel()])
    want = megatron_logits(model, ids)
    export_peft(model, 1, tmp_path / "peft", cfg, model_type, str(tmp_path / "base"))
    if model_type == "qwen3_5_moe":  # peft 0.21 skips its experts (test_peft_interop.py)
        got_model = published()
        merge_by_hand(got_model, tmp_path / "peft", model_type)
    else:
        got_model = peft.PeftModel.from_pretrained(published(), str(tmp_path / "peft")).eval()
    assert (hf_logits(got_model, ids) - want).abs().max() <= TOL


def test_a_config_without_layer_types_takes_transformers_rule():
    from megatron_multilora.models.hf_config import hf_to_model_config

    cfg = hf_to_model_config(
        dict(COMMON_TEXT, model_type="qwen3_5_text", num_hidden_layers=8, head_dim=16)
    )
    linear, full = "linear_attention", "full_attention"
    assert cfg.layer_types == [linear, linear, linear, full] * 2  # full_attention_interval 4
    assert cfg.attention_output_gate and cfg.rotary_percent == 0.25 and cfg.qk_layernorm
    assert (
        cfg.linear_attention.linear_num_key_heads,
        cfg.linear_attention.linear_num_value_heads,
    ) == (16, 32)
