"""Frozen linears on packed weights (ops/packed_linear.py): the model built on CPU runs its
frozen linears' forwards on them, and their input gradients too off Intel CPUs, with
megatron's outputs and gradients; a changed weight is repacked, a trainable one, or one
without room for all its packs, runs megatron's own path, and a row's output does not
depend on the rows beside it (what mixed == alone rests on). With bf16 GEMMs
(trainer.cpu_base_gemms) the same, inputs and weights rounded to bf16, fp32 out, and the
output layer's logits in fp32."""

import types

import pytest
import torch

from megatron_multilora.data.packing import pack_micro_batches
from megatron_multilora.layers.lifecycle import slot_parameters
from megatron_multilora.ops import packed_linear
from megatron_multilora.ops.packed_linear import use_packed_frozen_weights
from megatron_multilora.training import model_setup
from megatron_multilora.training.step.micro_batches import chunk_inputs
from tests.unit.test_step_schedule import DENSE, PAD, N, build, slot_examples

needs_bf16_gemms = pytest.mark.skipif(
    not packed_linear.bf16_gemms_supported(), reason="oneDNN runs no bf16 GEMMs on this CPU"
)
# Where oneDNN emulates bf16 (plain AVX-512), a one-row GEMM rounds differently from the same
# row among others (measured under ONEDNN_MAX_CPU_ISA=AVX512_CORE on a Zen 4): rows are
# independent only on bf16 instructions (AVX-512 BF16, AMX), whose sums keep their order.
needs_bf16_instructions = pytest.mark.skipif(
    not packed_linear.bf16_gemms_fast(),
    reason="oneDNN emulates bf16 on this CPU: rows of a bf16 GEMM are not independent",
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
    # Each frozen linear's forward ran packed, and its input gradient too where that is faster.
    assert len(packed_calls) == len(linears) * (2 if input_grad_packed else 1)
    calls = len(packed_calls)
    for module in linears:
        del module._forward_impl  # megatron's own implementation
    plain = _loss_and_grads(model)
    assert len(packed_calls) == calls
    torch.testing.assert_close(packed[0], plain[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed[1], plain[1], rtol=1e-4, atol=1e-7)
    for a, b in zip(packed[2], plain[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


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


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(input_grad_packed):
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
    torch.testing.assert_close(whole_grad, g @ weight, rtol=1e-5, atol=1e-6)
    for rows in (1, 7, 33):
        part, part_grad = run(rows)
        assert torch.equal(part, whole[:rows])
        if input_grad_packed:  # MKL's grad @ weight blocks rows by their number: close only
            assert torch.equal(part_grad, whole_grad[:rows])
        else:
            torch.testing.assert_close(part_grad, whole_grad[:rows], rtol=1e-5, atol=1e-6)


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
    assert packed_calls == [9, 9]  # the forward and the input gradient, each on its bf16 pack
    # fp32 accumulation of the bf16 products, the result rounded to bf16 (within its last bit)
    want = (_rounded(x) @ _rounded(weight).t()).bfloat16().float()
    torch.testing.assert_close(out, want, rtol=8e-3, atol=1e-6)
    assert (out - x.detach() @ weight.t()).abs().max() > 1e-4  # really not fp32
    want_grad = (_rounded(grad) @ _rounded(weight)).bfloat16().float()
    torch.testing.assert_close(x.grad, want_grad, rtol=8e-3, atol=1e-6)


@needs_bf16_instructions
def test_with_bf16_gemms_a_rows_results_do_not_depend_on_the_rows_beside_it():
    layer = _bf16_model().decoder.layers[0].mlp.linear_fc2.to_wrap
    x = torch.randn(300, 1, layer.weight.size(1))
    grad = torch.randn(300, 1, layer.weight.size(0))

    def run(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = x[:rows].clone().requires_grad_()
        out, _ = layer(part)
        out.backward(grad[:rows])
        return out.detach(), part.grad

    whole, whole_grad = run(300)
    for rows in (1, 7, 33, 180):
        out, input_grad = run(rows)
        assert torch.equal(out, whole[:rows]) and torch.equal(input_grad, whole_grad[:rows])


@needs_bf16_instructions
@pytest.mark.parametrize(
    "in_f,out_f",
    [(576, 960), (576, 3072), (1536, 576)],
    ids=["smollm2_qkv", "smollm2_fc1", "smollm2_fc2"],
)
def test_with_bf16_gemms_rows_are_independent_at_the_main_jobs_widths(in_f, out_f):
    """The same at SmolLM2's widths, where a sum runs over 576 or 1536 terms (fp32 GEMMs of
    one row there differ from the same row among others, on oneDNN as on MKL)."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(out_f, in_f, generator=gen) * 0.05
    packs = packed_linear._pack(weight, torch.bfloat16)
    x = torch.randn(300, in_f, generator=gen)
    grad = torch.randn(300, out_f, generator=gen)

    def run(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        part = x[:rows].clone().requires_grad_()
        out = packed_linear._PackedFrozenLinear.apply(part, packs, weight, None, False, None)
        out.backward(grad[:rows])
        return out.detach(), part.grad

    whole, whole_grad = run(300)
    for rows in (1, 2, 7, 68, 180):
        out, input_grad = run(rows)
        assert torch.equal(out, whole[:rows]), rows
        assert torch.equal(input_grad, whole_grad[:rows]), rows


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
