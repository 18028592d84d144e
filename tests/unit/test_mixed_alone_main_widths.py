"""Mixed == alone at the main job's shapes: a job's loss, per-token log-probs and adapter
gradients beside another job in the same micro-batch against alone, on a model of
SmolLM2-135M's widths (two layers; hidden 576, 9 heads over 3 key-value groups, MLP 1536).

Beside the other job this job's rows sit at another offset of the packed micro-batch, in
frozen GEMMs of another row count and at other positions of their row blocks, and its loss
rows are others of the output layer's. With bf16 frozen GEMMs (where the CPU has them) the
bits are equal by construction: every bf16 GEMM runs in calls of the same row count
(ops/packed_linear.py), an example's attention is its own (padded to a length of its own),
and a slot's LoRA GEMMs are the same BLAS calls alone and beside others at the same rank.
With fp32 frozen GEMMs (run whole: MKL and oneDNN choose their kernels by row count) within
the rounding of the sums that lead to each value. Both jobs have rank 8, as in the main job.
The same at Qwen3.5's layer kinds (a Gated DeltaNet, gated attention) and these widths."""

import dataclasses

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.models.gpt_config import DeltaNetConfig
from megatron_multilora.ops import packed_linear
from megatron_multilora.training.objectives.registry import DEFAULT
from megatron_multilora.training.step.slot_step import SlotStep, SlotWork
from tests.tolerances import chain_atol

SMOLLM2_WIDTHS = mm.GPTModelConfig(
    num_layers=2,
    hidden_size=576,
    num_attention_heads=9,
    num_query_groups=3,
    ffn_hidden_size=1536,
    vocab_size=1024,  # 49,152 in SmolLM2: the output layer's rows are blocked the same way
    max_sequence_length=256,
    tie_word_embeddings=True,
)
# Qwen3.5's layers at those widths: a Gated DeltaNet (its examples each batched with those
# of their padded length, from a zero state), then attention with an output gate.
QWEN3_5_WIDTHS = dataclasses.replace(
    SMOLLM2_WIDTHS,
    layer_types=["linear_attention", "full_attention"],
    linear_attention=DeltaNetConfig(3, 6, 64, 64),
    attention_output_gate=True,
    qk_layernorm=True,
    rotary_percent=0.25,
)
PAD = 0


def _examples(gen: torch.Generator, lengths: tuple[int, ...]) -> list[Example]:
    out = []
    for n in lengths:
        tokens = tuple(torch.randint(1, SMOLLM2_WIDTHS.vocab_size, (n,), generator=gen).tolist())
        prompt = n // 3
        out.append(Example(tokens, (False,) * prompt + (True,) * (n - 1 - prompt)))
    return out


def _model(
    gemm_dtype: torch.dtype, state: dict | None = None, cfg: mm.GPTModelConfig = SMOLLM2_WIDTHS
) -> torch.nn.Module:
    torch.manual_seed(0)
    model = mm.apply_multi_lora(
        mm.build_gpt_model(cfg, calculate_per_token_loss=True, cpu_gemm_dtype=gemm_dtype),
        2,
        8,
        16.0,
        row_init_method="normal",  # B not zero: every factor has a gradient
    )
    for slot in range(2):
        mm.init_adapter_slot(model, slot, 8, 16.0)
    if state is not None:
        model.load_state_dict(state)
    return model


@pytest.mark.parametrize(
    "gemm_dtype,input_grad_packed",
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
    ids=["fp32_input_grad_mkl", "fp32_input_grad_packed", "bf16"],
)
@pytest.mark.parametrize("lengths", [(30, 41, 70, 9), (7,)], ids=["four_examples", "seven_rows"])
@pytest.mark.parametrize("cfg", [SMOLLM2_WIDTHS, QWEN3_5_WIDTHS], ids=["smollm2", "qwen3_5"])
def test_a_job_at_smollm2_widths_has_the_same_bits_beside_another_as_alone(
    monkeypatch, gemm_dtype, input_grad_packed, lengths, cfg
):
    """``seven_rows``: alone, every frozen GEMM of the job has 7 rows, a count at which MKL's
    fp32 kernels sum in another order than among more rows (on AMD and Intel CPUs alike):
    checked to differ in fp32 on MKL's path, so the fp32 bound is needed there."""
    if gemm_dtype == torch.bfloat16 and not packed_linear.bf16_gemms_supported():
        pytest.skip("oneDNN runs no bf16 GEMMs on this CPU")
    # Which way the fp32 input gradient runs, set here instead of by the CPU's vendor.
    monkeypatch.setattr(packed_linear, "_INPUT_GRAD_PACKED", input_grad_packed)
    gen = torch.Generator().manual_seed(3)
    # The other job's 45 rows (not a multiple of the GEMMs' row block) come first; this job's
    # examples cross block boundaries either way.
    other, job = _examples(gen, (17, 28)), _examples(gen, lengths)
    state = {
        k: v for k, v in _model(gemm_dtype, cfg=cfg).state_dict().items() if torch.is_tensor(v)
    }
    results = {}
    for name, work in {"mixed": {0: other, 1: job}, "alone": {1: job}}.items():
        model = _model(gemm_dtype, state, cfg)
        step = SlotStep([model], 2, 4096, 1, PAD)
        result = step.train(
            {s: SlotWork(items, DEFAULT()) for s, items in work.items()}, keep=("logprobs",)
        )
        grads = [p.main_grad.clone() for p in mm.slot_parameters(model, 1)]
        results[name] = (result.losses[1], result.kept["logprobs"][1], grads)
    (loss, logprobs, grads), (loss_alone, logprobs_alone, grads_alone) = results.values()
    assert all(g.abs().sum() > 0 for g in grads)  # every factor really trained
    if gemm_dtype == torch.bfloat16:  # built in
        assert float(loss) == float(loss_alone)
        assert logprobs == logprobs_alone
        for g, want in zip(grads, grads_alone, strict=True):
            assert torch.equal(g, want)
        return
    # fp32: each value within the rounding of the GEMM sums before it, forward and backward
    sums = 2 * (4 * cfg.num_layers + 1)
    longest = max(cfg.ffn_hidden_size, cfg.vocab_size, sum(lengths) + 45)
    want = torch.tensor([v for row in logprobs_alone for v in row])
    got = torch.tensor([v for row in logprobs for v in row])
    torch.testing.assert_close(got, want, rtol=0, atol=chain_atol(want, sums, longest))
    torch.testing.assert_close(loss, loss_alone, rtol=0, atol=chain_atol(loss_alone, sums, longest))
    for g, w in zip(grads, grads_alone, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=chain_atol(w, sums, longest))
