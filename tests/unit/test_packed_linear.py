"""Frozen linears on packed weights (ops/packed_linear.py): the model built on CPU runs its
frozen linears' forwards on them, and their input gradients too off Intel CPUs, with
megatron's outputs and gradients; a changed weight is repacked, a trainable one, or one
without room for all its packs, runs megatron's own path, and a row's output does not
depend on the rows beside it (what mixed == alone rests on): in fp32 within the rounding of
its sums (the kernels choose by the row count), with bf16 GEMMs (trainer.cpu_base_gemms)
exactly, by construction (calls of ROW_BLOCK rows), at any offset of a block; with bf16,
inputs and weights rounded to bf16, fp32 out, and the output layer's logits in fp32."""

import types

import pytest
import torch

from megatron_multilora.layers.lifecycle import slot_parameters
from megatron_multilora.ops import packed_linear
from megatron_multilora.ops.packed_linear import ROW_BLOCK, use_packed_frozen_weights
from megatron_multilora.training import model_setup
from megatron_multilora.training.step.micro_batches import chunk_inputs, pack_micro_batches
from tests.tolerances import chain_atol
from tests.unit.test_step_schedule import DENSE, PAD, N, build, slot_examples

needs_bf16_gemms = pytest.mark.skipif(
    not packed_linear.bf16_gemms_supported(), reason="oneDNN runs no bf16 GEMMs on this CPU"
)


@pytest.fixture
def packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every GEMM run on a packed weight while the test runs."""
    calls = []
    run = packed_linear._onednn_linear

    def counted(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        calls.append(rows.size(0))
        return run(rows, packed)

    monkeypatch.setattr(packed_linear, "_onednn_linear", counted)
    return calls


def _parallel_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if "_forward_impl" in vars(m)]


def _loss_and_grads(model: torch.nn.Module) -> tuple:
    (mb,) = pack_micro_batches(slot_examples(), 10**6, 1, PAD)
    model.zero_grad()
    inputs = chunk_inputs(model, mb)
    embedded = []
    hook = model.embedding.register_forward_hook(
        lambda module, args, out: embedded.append(out.requires_grad_()) or out
    )
    loss = model(**inputs, labels=mb.labels)
    hook.remove()
    embedded[0].retain_grad()
    (loss * mb.loss_mask).sum().backward()
    grads = [p.grad.clone() for s in range(N) for p in slot_parameters(model, s)]
    return loss.detach(), embedded[0].grad.clone(), grads


@pytest.fixture(params=[False, True], ids=["input_grad_mkl", "input_grad_packed"])
def input_grad_packed(request, monkeypatch) -> bool:
    """Which way the fp32 input gradient runs, set here instead of by the CPU's vendor."""
    monkeypatch.setattr(packed_linear, "_INPUT_GRAD_PACKED", request.param)
    return request.param


def test_the_cpu_model_runs_its_frozen_linears_packed_with_megatrons_results(
    packed_calls, input_grad_packed
):
    model = build(DENSE)
    linears = _parallel_linears(model)
    assert len(linears) == 4 * DENSE.num_layers + 1  # qkv, proj, fc1, fc2 a layer, the output layer
    packed = _loss_and_grads(model)
    rows = sum(len(e.tokens) - 1 for examples in slot_examples() for e in examples)
    # Each frozen linear's forward ran packed, whole (fp32), and its input gradient too where
    # that runs on a pack.
    assert set(packed_calls) == {rows}
    assert len(packed_calls) == len(linears) * (2 if input_grad_packed else 1)
    calls = len(packed_calls)
    for module in linears:
        del module._forward_impl  # megatron's own implementation
    plain = _loss_and_grads(model)
    assert len(packed_calls) == calls
    # Other kernels sum in another order: each value within the rounding of the GEMMs that
    # lead to it (the forward's and the backward's, each over at most the widest K).
    longest = max(DENSE.hidden_size, DENSE.ffn_hidden_size, DENSE.vocab_size, rows)
    chain = 2 * len(linears)
    torch.testing.assert_close(
        packed[0], plain[0], rtol=0, atol=chain_atol(plain[0], chain, longest)
    )
    torch.testing.assert_close(
        packed[1], plain[1], rtol=0, atol=chain_atol(plain[1], chain, longest)
    )
    for a, b in zip(packed[2], plain[2]):
        torch.testing.assert_close(a, b, rtol=0, atol=chain_atol(b, chain, longest))


def test_a_changed_weight_is_repacked_and_a_trainable_one_runs_megatrons_path(packed_calls):
    model = build(DENSE)
    layer = model.decoder.layers[0].mlp.linear_fc2.to_wrap
    x = torch.randn(5, 1, layer.weight.size(1))
    first, _ = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)
    second, _ = layer(x)
    torch.testing.assert_close(second, 2 * first, rtol=1e-5, atol=1e-6)

    assert packed_calls == [5, 5]
    layer.weight.requires_grad_(True)
    out, _ = layer(x)
    out.sum().backward()
    assert packed_calls == [5, 5] and layer.weight.grad is not None


def test_an_fp32_rows_results_beside_other_rows_are_within_the_rounding_of_its_sums(
    input_grad_packed,
):
    """fp32 GEMMs run whole: MKL and oneDNN choose their kernels by the row count, so a row's
    bits may depend on how many rows run beside it (not built in), but not by more than the
    rounding of its sums."""
    layer = build(DENSE).output_layer
    weight = build(DENSE).embedding.word_embeddings.weight
    use_packed_frozen_weights(layer)
    x = torch.randn(40, 1, weight.size(1))
    g = torch.randn(40, 1, weight.size(0))

    def run(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        x_rows = x[:rows].clone().requires_grad_()
        out, _ = layer(x_rows, weight=weight)
        (out * g[:rows]).sum().backward()
        return out.detach(), x_rows.grad

    whole, whole_grad = run(40)
    atol = chain_atol(whole_grad, 1, weight.size(0))
    torch.testing.assert_close(whole_grad, g @ weight, rtol=0, atol=atol)
    for rows in (1, 7, 33):
        part, part_grad = run(rows)
        torch.testing.assert_close(
            part, whole[:rows], rtol=0, atol=chain_atol(whole, 1, x.size(-1))
        )
        torch.testing.assert_close(part_grad, whole_grad[:rows], rtol=0, atol=atol)


@pytest.mark.parametrize("vendor,packed", [("GenuineIntel", False), ("AuthenticAMD", True)])
def test_the_input_gradient_runs_packed_off_intel_cpus(tmp_path, monkeypatch, vendor, packed):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: x\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **kw: real_open(info if path == "/proc/cpuinfo" else path, *a, **kw),
    )
    assert packed_linear._mkl_is_tuned_here() is not packed


def test_without_room_for_its_pack_a_weight_runs_megatrons_path(packed_calls, monkeypatch):
    model = build(DENSE)
    layer = model.decoder.layers[0].mlp.linear_fc1.to_wrap
    x = torch.randn(6, 1, layer.weight.size(1))
    monkeypatch.setattr(packed_linear, "_FREE_FRACTION", 1.0)  # nothing may be used
    out, _ = layer(x)
    assert packed_calls == []
    torch.testing.assert_close(out, x @ layer.weight.t(), rtol=1e-5, atol=1e-6)


def test_a_weight_packs_only_with_room_for_all_its_packs(
    packed_calls, monkeypatch, input_grad_packed
):
    """Room for one copy of the weight: enough for the forward's pack alone, not for two."""
    model = build(DENSE)
    layer = model.decoder.layers[0].mlp.linear_fc1.to_wrap
    total = 10**12
    free = packed_linear._FREE_FRACTION * total + 1.5 * layer.weight.nbytes
    monkeypatch.setattr(
        packed_linear.psutil,
        "virtual_memory",
        lambda: types.SimpleNamespace(total=total, available=free),
    )
    x = torch.randn(6, 1, layer.weight.size(1))
    out, _ = layer(x)
    assert packed_calls == ([] if input_grad_packed else [6])
    torch.testing.assert_close(out, x @ layer.weight.t(), rtol=1e-5, atol=1e-6)


def _bf16_model() -> torch.nn.Module:
    model = build(DENSE)
    use_packed_frozen_weights(model, torch.bfloat16)
    return model


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.detach().bfloat16().double()


@needs_bf16_gemms
def test_bf16_gemms_round_inputs_and_weights_and_return_fp32(packed_calls):
    layer = _bf16_model().decoder.layers[0].mlp.linear_fc1.to_wrap
    weight = layer.weight
    x = torch.randn(9, 1, weight.size(1), requires_grad=True)
    out, _ = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    assert out.dtype == x.grad.dtype == torch.float32
    # the forward and the input gradient, each on its bf16 pack (9 rows: one block)
    assert packed_calls == [ROW_BLOCK, ROW_BLOCK]
    # fp32 accumulation of the bf16 products, the result rounded to bf16 (within its last bit)
    want = (_rounded(x) @ _rounded(weight).t()).bfloat16().float()
    torch.testing.assert_close(out, want, rtol=8e-3, atol=1e-6)
    assert (out - x.detach() @ weight.t()).abs().max() > 1e-4  # really not fp32
    want_grad = (_rounded(grad) @ _rounded(weight)).bfloat16().float()
    torch.testing.assert_close(x.grad, want_grad, rtol=8e-3, atol=1e-6)


_SHAPES = pytest.mark.parametrize(
    "in_f,out_f",
    [(32, 48), (576, 960), (576, 3072), (1536, 576), (576, 8192)],
    ids=["tiny", "smollm2_qkv", "smollm2_fc1", "smollm2_fc2", "smollm2_vocab_slice"],
)


def _rows_run(monkeypatch, dtype: torch.dtype, input_grad_packed: bool, in_f: int, out_f: int):
    """A frozen GEMM on its packs: ``run(x, grad)`` gives the output and input gradient, for
    300 rows of random ``x`` and ``grad``."""
    monkeypatch.setattr(packed_linear, "_INPUT_GRAD_PACKED", input_grad_packed)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(out_f, in_f, generator=gen) * 0.05
    packs = packed_linear._pack(weight, dtype)
    assert (packs.input_grad is not None) == (input_grad_packed or dtype != torch.float32)

    def run(x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        part = x.clone().requires_grad_()
        out = packed_linear._PackedFrozenLinear.apply(part, packs, weight, None, False, None)
        out.backward(grad)
        return out.detach(), part.grad

    return run, torch.randn(300, in_f, generator=gen), torch.randn(300, out_f, generator=gen)


_ROWS = (1, 2, 7, 16, 32, 63, 64, 68, 128, 180)


@needs_bf16_gemms
@_SHAPES
def test_a_bf16_rows_results_have_the_same_bits_beside_any_rows(
    monkeypatch, packed_calls, in_f, out_f
):
    """Forward and input gradient at the tiny model's and SmolLM2's widths (a sum over 576 or
    1536 terms: on an AMX Xeon oneDNN blocks by the row count at 2, 7, 16, 32, 64, 68, 128 and
    180 rows there).

    By construction: every call has ROW_BLOCK rows (asserted), so the first ``rows`` rows of
    a ``rows``-row product equal the same rows of a 300-row one. The one kernel property
    this rests on, checked here on whatever CPU runs it: a call of fixed shape treats each of
    its rows alike (the same rows shifted to every offset of their block give the same bits)."""
    run, x, grad = _rows_run(monkeypatch, torch.bfloat16, True, in_f, out_f)
    whole, whole_grad = run(x, grad)
    for rows in _ROWS:
        out, input_grad = run(x[:rows], grad[:rows])
        assert torch.equal(out, whole[:rows]), rows
        assert torch.equal(input_grad, whole_grad[:rows]), rows
    for offset in range(1, ROW_BLOCK, 7):
        out, input_grad = run(x[offset : offset + 150], grad[offset : offset + 150])
        assert torch.equal(out, whole[offset : offset + 150]), offset
        assert torch.equal(input_grad, whole_grad[offset : offset + 150]), offset
    assert set(packed_calls) == {ROW_BLOCK}


@pytest.mark.parametrize(
    "input_grad_packed", [False, True], ids=["input_grad_mkl", "input_grad_packed"]
)
@_SHAPES
def test_an_fp32_rows_results_beside_any_rows_are_within_the_rounding_of_its_sums(
    monkeypatch, input_grad_packed, in_f, out_f
):
    """fp32 GEMMs run whole (blocking them would cost the main job's step 1.18x to 1.58x):
    a row's result beside any number of rows stays within two summation orders' rounding of
    its ``in_f`` (forward) or ``out_f`` (input gradient) products."""
    run, x, grad = _rows_run(monkeypatch, torch.float32, input_grad_packed, in_f, out_f)
    whole, whole_grad = run(x, grad)
    for rows in _ROWS:
        out, input_grad = run(x[:rows], grad[:rows])
        torch.testing.assert_close(out, whole[:rows], rtol=0, atol=chain_atol(whole, 1, in_f))
        atol = chain_atol(whole_grad, 1, out_f)
        torch.testing.assert_close(input_grad, whole_grad[:rows], rtol=0, atol=atol)


@needs_bf16_gemms
def test_a_bf16_gemm_model_keeps_its_logits_fp32_and_stays_close_to_fp32():
    model = _bf16_model()
    dtypes = {
        name: m._frozen_gemm_dtype
        for name, m in model.named_modules()
        if "_forward_impl" in vars(m)
    }
    assert dtypes.pop("output_layer.to_wrap", dtypes.pop("output_layer", None)) == torch.float32
    assert set(dtypes.values()) == {torch.bfloat16}
    low = _loss_and_grads(model)
    high = _loss_and_grads(build(DENSE))
    assert not torch.equal(low[0], high[0])
    torch.testing.assert_close(low[0], high[0], rtol=3e-2, atol=1e-3)
    for a, b in zip(low[2], high[2]):
        torch.testing.assert_close(a, b, rtol=0.1, atol=0.1 * b.abs().max().item())


@pytest.mark.parametrize("fast", [True, False])
def test_auto_picks_bf16_gemms_only_where_the_cpu_multiplies_bf16_in_hardware(monkeypatch, fast):
    monkeypatch.setattr(model_setup, "bf16_gemms_fast", lambda: fast)
    assert model_setup.cpu_gemm_dtype("auto") == (torch.bfloat16 if fast else torch.float32)
    assert model_setup.cpu_gemm_dtype("bf16") == torch.bfloat16
    assert model_setup.cpu_gemm_dtype("fp32") == torch.float32
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        use_packed_frozen_weights(build(DENSE), torch.float16)


@pytest.mark.parametrize(
    "supported, amx, avx512_bf16, fast",
    [
        (True, True, True, True),  # Intel Sapphire Rapids and newer
        (True, False, True, True),  # AMD Zen 4, Intel Cooper Lake: AVX-512 BF16 dot products
        (True, False, False, False),  # plain AVX-512: oneDNN emulates bf16
        (False, False, False, False),
    ],
)
def test_bf16_gemms_count_as_fast_where_the_cpu_has_bf16_instructions(
    monkeypatch, supported, amx, avx512_bf16, fast
):
    monkeypatch.setattr(packed_linear, "bf16_gemms_supported", lambda: supported)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert packed_linear.bf16_gemms_fast() == fast
