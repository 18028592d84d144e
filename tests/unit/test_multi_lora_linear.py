"""MultiLoRALinear at TP=1 against the token-by-token reference in tests/reference.py."""

import pytest
import torch
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_multilora import MultiLoRALinear
from megatron_multilora.layers.factors import A, B
from megatron_multilora.ops.slot_layout import SlotLayout
from tests.reference import linear_config, lora_reference, random_slots

IN, OUT, DIM = 16, 24, 8
COUNTS = [5, 0, 7, 4]  # slot 1 has no tokens
RANKS = [8, 3, 1, 5]  # unequal ranks, slot 0 at the max rank
ALPHAS = [16.0, 4.0, 2.0, 10.0]
KINDS = ["column", "row", "replicated"]


def make_base(kind: str, in_f: int, out_f: int, dtype=torch.float32) -> torch.nn.Module:
    cfg = linear_config(dtype=dtype)
    init = lambda w: torch.nn.init.normal_(w, std=0.3)  # noqa: E731
    if kind == "column":
        return ColumnParallelLinear(
            in_f,
            out_f,
            config=cfg,
            init_method=init,
            bias=False,
            gather_output=False,
            skip_bias_add=True,
        )
    if kind == "row":
        return RowParallelLinear(
            in_f,
            out_f,
            config=cfg,
            init_method=init,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
        )
    base = torch.nn.Linear(in_f, out_f, bias=False, dtype=dtype)
    torch.nn.init.normal_(base.weight, std=0.3)
    return base


def make_layer(kind, in_f=IN, dtype=torch.float32, seed=0, **kwargs):
    """A wrapped base whose slots hold random factors; returns (layer, reference slots)."""
    gen = torch.Generator().manual_seed(seed)
    layer = MultiLoRALinear(
        make_base(kind, in_f, OUT, dtype), len(COUNTS), DIM, 1.0, f"test.{kind}", **kwargs
    )
    slots = random_slots(len(COUNTS), DIM, in_f, OUT, RANKS, ALPHAS, gen)
    with torch.no_grad():
        for i, f in enumerate(slots):
            layer.init_adapter_slot(i, f.rank, f.alpha)
            layer.adapters[i].linear_in.weight.copy_(f.a)
            layer.adapters[i].linear_out.weight.copy_(f.b)
            if dtype != torch.float32:  # the reference uses the same rounded values
                f.a.data.copy_(f.a.to(dtype).float())
                f.b.data.copy_(f.b.to(dtype).float())
    layer.slot_layout = SlotLayout(COUNTS)
    return layer, slots


def output(result):
    return result[0] if isinstance(result, tuple) else result


def run_both(layer, slots, x, dtype=torch.float32, mask=None, seed=3):
    """Forward+backward through the layer and the reference with the same upstream grad."""
    base_w = layer.to_wrap.weight.detach().float()
    x_l = x.to(dtype).detach().requires_grad_()
    x_r = x.to(dtype).float().detach().requires_grad_()
    y = output(layer(x_l.view(-1, 1, x.size(-1)))).view(x.size(0), -1)
    y_ref = lora_reference(x_r, base_w, slots, COUNTS, mask)
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(seed))
    (y.float() * g).sum().backward()
    (y_ref * g).sum().backward()
    return y.float(), y_ref, x_l.grad.float(), x_r.grad


def assert_close(got, want, rel, what):
    if got is None:  # a slot without tokens is left out of the GEMMs: no gradient at all
        assert want is None or want.abs().max() == 0, f"{what}: missing gradient"
        return
    want = torch.zeros_like(got) if want is None else want  # reference: no tokens, no grad
    err = (got.float() - want).abs().max().item()
    scale = max(want.abs().max().item(), 1e-6)
    assert err <= rel * scale, f"{what}: max abs error {err:.3e} > {rel:g} x {scale:.3e}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("in_f", [IN, 10], ids=["grouped_mm", "loop_fallback"])
@pytest.mark.parametrize(
    "dtype,rel", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize(
    "counts",
    [COUNTS, [0, 0, 0, 16], [0, 0, 16, 0]],
    ids=["three_slots", "one_slot", "one_slot_rank1"],
)
def test_outputs_and_grads_match_reference(monkeypatch, kind, in_f, dtype, rel, counts):
    """Several slots run grouped; one slot holding every row runs on its own
    Parameters, unstacked (``one_slot_term``): both as the reference, the idle slots untouched."""
    monkeypatch.setitem(globals(), "COUNTS", counts)
    layer, slots = make_layer(kind, in_f, dtype)
    x = torch.randn(sum(COUNTS), in_f, generator=torch.Generator().manual_seed(1))
    y, y_ref, gx, gx_ref = run_both(layer, slots, x, dtype)
    assert_close(y, y_ref, rel, "output")
    assert_close(gx, gx_ref, rel, "input grad")
    for i, f in enumerate(slots):
        slot = layer.adapters[i]
        if counts[i] == 0:  # no tokens: no part in the GEMMs, no gradient to communicate
            assert slot.linear_in.weight.grad is None and slot.linear_out.weight.grad is None
            continue
        assert_close(slot.linear_in.weight.grad, f.a.grad, rel, f"slot {i} A grad")
        assert_close(slot.linear_out.weight.grad, f.b.grad, rel, f"slot {i} B grad")
        # Beyond the slot's rank: zero gradient, so the padded rank stays zero.
        assert not slot.linear_in.weight.grad[f.rank :].any()
        assert not slot.linear_out.weight.grad[:, f.rank :].any()


DROPOUT = [0.25, 0.0, 0.5, 0.1]  # per slot


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("position", ["pre", "post"])
def test_dropout_matches_reference_mask(kind, position):
    layer, slots = make_layer(kind, dropout=0.3, dropout_position=position)
    for i, f in enumerate(slots):
        layer.init_adapter_slot(i, f.rank, f.alpha, dropout=DROPOUT[i])
    layer.train()
    x = torch.randn(sum(COUNTS), IN, generator=torch.Generator().manual_seed(1))
    tracker = get_cuda_rng_tracker()
    cpu_state, tracker_states = torch.get_rng_state(), tracker.get_states()
    y = output(layer(x.view(-1, 1, IN))).view(x.size(0), -1)
    # Replay the RNG: slot by slot, the slots with tokens and a rate above 0 draw a dropout
    # mask for their rows (the others draw nothing). Row-parallel inputs and column-parallel
    # outputs are TP-sharded, so their draws come from megatron's tensor-parallel stream.
    torch.set_rng_state(cpu_state)
    tracker.set_states(tracker_states)
    sharded = kind == "row" if position == "pre" else kind == "column"
    width = IN if position == "pre" else OUT
    with tracker.fork() if sharded else torch.no_grad():
        mask = torch.cat(
            [
                torch.nn.functional.dropout(torch.ones(c, width), DROPOUT[s])
                for s, c in enumerate(COUNTS)
                if c
            ]
        )
    if position == "pre":
        y_ref = lora_reference(x, layer.to_wrap.weight.detach(), slots, COUNTS, mask)
    else:
        base = x @ layer.to_wrap.weight.detach().t()
        delta = lora_reference(x, torch.zeros(OUT, IN), slots, COUNTS)
        y_ref = base + mask * delta
    # rows 0-4 are slot 0 (rate 0.25), 5-11 slot 2 (0.5), 12-15 slot 3 (0.1)
    assert set(mask[5:12].unique().tolist()) == {0.0, 2.0}
    assert (mask == 0).any() and (mask != 0).any()
    assert_close(y.detach(), y_ref.detach(), 1e-6, f"{position}-dropout output")
    layer.eval()  # no dropout in eval
    y_eval = output(layer(x.view(-1, 1, IN))).view(x.size(0), -1).detach()
    assert_close(
        y_eval,
        lora_reference(x, layer.to_wrap.weight.detach(), slots, COUNTS).detach(),
        1e-6,
        "eval output",
    )


@pytest.mark.parametrize("kind", KINDS)
def test_padded_rank_stays_zero_through_training(kind):
    layer, _ = make_layer(kind)
    opt = torch.optim.AdamW(layer.adapters.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(sum(COUNTS), 1, IN, generator=torch.Generator().manual_seed(step))
        output(layer(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for i, r in enumerate(RANKS):
        slot = layer.adapters[i]
        assert slot.linear_in.weight[r:].abs().sum() == 0
        assert slot.linear_out.weight[:, r:].abs().sum() == 0
        if r > 1:
            assert slot.linear_in.weight[:r].abs().sum() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_adapters_leave_base_output_unchanged(kind):
    layer = MultiLoRALinear(make_base(kind, IN, OUT), 3, DIM, 8.0, "fresh")
    layer.slot_layout = SlotLayout([2, 3, 1])
    x = torch.randn(6, 1, IN)
    assert torch.equal(output(layer(x)), output(layer.to_wrap(x)))


@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 6, 7, 3]], ids=["gap", "contiguous"])
@pytest.mark.parametrize("aliased", [True, False], ids=["slot_buffer", "stacked"])
def test_slot_buffer_reads_match_reference(monkeypatch, counts, aliased):
    """Each factor's slot Parameters are views of one [N, ...] buffer. Results and per-slot
    gradients are the same whether the active slots are read as a view of it (contiguous
    slots), an indexed copy (a gap) or, once a Parameter no longer aliases it, stacked."""
    monkeypatch.setitem(globals(), "COUNTS", counts)
    layer, slots = make_layer("column")
    for factor, name in ((A, "linear_in"), (B, "linear_out")):
        buffer = layer.adapters.factor_buffers[factor].buffer
        assert all(
            getattr(layer.adapters[i], name).weight.data_ptr() == buffer[i].data_ptr()
            for i in range(len(counts))
        )
    if not aliased:
        w = layer.adapters[2].linear_in.weight
        w.data = w.data.clone()
    x = torch.randn(sum(counts), IN, generator=torch.Generator().manual_seed(1))
    y, y_ref, gx, gx_ref = run_both(layer, slots, x)
    assert_close(y, y_ref, 1e-6, "output")
    assert_close(gx, gx_ref, 1e-6, "input grad")
    for i, f in enumerate(slots):
        slot = layer.adapters[i]
        if counts[i] == 0:  # an idle slot: no gradient at all
            assert slot.linear_in.weight.grad is None and slot.linear_out.weight.grad is None
            continue
        assert_close(slot.linear_in.weight.grad, f.a.grad, 1e-6, f"slot {i} A grad")
        assert_close(slot.linear_out.weight.grad, f.b.grad, 1e-6, f"slot {i} B grad")


def test_conversion_realiases_the_slot_buffer():
    """A dtype conversion gives the Parameters new data; the layer re-points them at a new
    buffer (same values), so forward keeps reading views."""
    layer, _ = make_layer("column")
    before = [s.linear_out.weight.detach().clone() for s in layer.adapters]
    layer.to(torch.float64)
    buffer = layer.adapters.factor_buffers[B].buffer
    assert buffer.dtype == torch.float64
    for i, slot in enumerate(layer.adapters):
        assert slot.linear_out.weight.data_ptr() == buffer[i].data_ptr()
        assert torch.equal(slot.linear_out.weight, before[i].double())


@pytest.mark.parametrize("kind,in_place", [("column", True), ("row", False)])
def test_lora_term_is_added_into_the_base_output_it_owns(kind, in_place):
    """The LoRA term goes into the base's output buffer in place, except where that output is
    a view (megatron's TP=1 row-parallel reduction returns its input)."""
    layer, _ = make_layer(kind)
    seen = []
    layer.to_wrap.register_forward_hook(lambda m, args, out: seen.append(output(out)))
    x = torch.randn(sum(COUNTS), 1, IN, requires_grad=True)
    y = output(layer(x))
    assert (y.data_ptr() == seen[0].data_ptr()) == in_place
    y.sum().backward()  # autograd accepts the in-place add (the base saved no output)
    assert x.grad is not None


# A max rank that is not a multiple of 8 (a cut of the [out, max rank] B buffer to the
# computed rank 8 is then a view whose row stride the kernel refuses: the layer must copy
# it), with an idle slot at the max rank (it must not raise the computed rank) and a gap in
# the active slots (read as an indexed copy); and one that is, with contiguous active slots
# from slot 1 (read as a view at an offset). Ranks below the max, odd and zero group sizes.
KERNEL_CASES = {
    "max_rank_12": (12, [3, 12, 5, 7, 2], [37, 0, 5, 19, 1]),
    "max_rank_16": (16, [16, 1, 9, 4, 16], [0, 21, 3, 17, 1]),
}


def check_grouped_kernel_parity(
    monkeypatch,
    device: str,
    dtype: torch.dtype,
    rel: float,
    dim: int,
    ranks: list[int],
    counts: list[int],
) -> None:
    """A column-parallel MultiLoRALinear on ``device`` in ``dtype`` against the fp32
    token-by-token reference: output, input gradient and every slot's factor gradients, with
    both LoRA GEMMs run by ``torch._grouped_mm`` (asserted). Shared with tests/gpu."""
    from megatron_multilora.ops import grouped_mm as gmm

    if gmm._GROUPED_MM is None:
        pytest.skip("this torch has no torch._grouped_mm")
    calls = []
    kernel = gmm._GROUPED_MM
    monkeypatch.setattr(
        gmm, "_GROUPED_MM", lambda *a, **kw: calls.append(a[1].shape) or kernel(*a, **kw)
    )
    n, alphas = len(ranks), [2.0 * r for r in ranks]
    gen = torch.Generator().manual_seed(5)
    base = make_base("column", IN, OUT, dtype)
    layer = MultiLoRALinear(base, n, dim, 1.0, "test.kernel")
    slots = random_slots(n, dim, IN, OUT, ranks, alphas, gen)
    with torch.no_grad():
        for i, f in enumerate(slots):
            layer.init_adapter_slot(i, f.rank, f.alpha)
            layer.adapters[i].linear_in.weight.copy_(f.a)
            layer.adapters[i].linear_out.weight.copy_(f.b)
            f.a.data.copy_(f.a.to(dtype).float())  # the reference uses the same rounded values
            f.b.data.copy_(f.b.to(dtype).float())
    layer.to(device)
    layer.slot_layout = SlotLayout(counts)
    x = torch.randn(sum(counts), IN, generator=torch.Generator().manual_seed(6)).to(dtype).float()
    x_l = x.to(device, dtype, copy=True).requires_grad_()
    x_r = x.clone().requires_grad_()
    y = output(layer(x_l.view(-1, 1, IN))).view(x.size(0), -1)
    assert len(calls) == 2, f"expected both LoRA GEMMs on the grouped kernel, got {calls}"
    y_ref = lora_reference(x_r, base.weight.detach().float().cpu(), slots, counts)
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(7))
    (y.float() * g.to(device)).sum().backward()
    (y_ref * g).sum().backward()
    assert_close(y.detach().cpu(), y_ref.detach(), rel, "output")
    assert_close(x_l.grad.cpu(), x_r.grad, rel, "input grad")
    for i, f in enumerate(slots):
        slot = layer.adapters[i]
        if counts[i] == 0:  # idle: left out of the GEMMs, no gradient at all
            assert slot.linear_in.weight.grad is None and slot.linear_out.weight.grad is None
            continue
        assert_close(slot.linear_in.weight.grad.cpu(), f.a.grad, rel, f"slot {i} A grad")
        assert_close(slot.linear_out.weight.grad.cpu(), f.b.grad, rel, f"slot {i} B grad")


@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize(
    "dtype,rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
def test_grouped_kernel_matches_reference_at_any_max_rank(monkeypatch, case, dtype, rel):
    check_grouped_kernel_parity(monkeypatch, "cpu", dtype, rel, *KERNEL_CASES[case])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("slot", [0, 2, 3], ids=["rank8", "rank1", "rank5"])
@pytest.mark.parametrize("rows", [None, 1], ids=["its_rows", "one_row"])
def test_a_slots_rows_have_the_same_bits_alone_as_beside_others(monkeypatch, kind, slot, rows):
    """A slot's LoRA term, its input gradient and its factor gradients are bit-identical when
    it holds every row (``one_slot_term``) and beside other slots (the grouped call, at the
    largest active rank): with bf16 frozen GEMMs after it, a last-bit difference could round
    to a different bf16 value and make a job train differently beside others. Every slot
    here computes at the layer's max rank 8, alone and beside others; a slot beside a
    higher-rank one computes at that rank, and its bits may differ (docs/reference.md). (The
    frozen base's own GEMM runs packed in a model, where rows are independent: tests of
    ops/packed_linear.) A slot of one row is where a plain matmul's gradient took another
    BLAS call than the grouped call's, which MKL's AVX-512 path rounds differently: this
    failed on Intel's MKL path before ``single_group_mm``."""
    counts = list(COUNTS)
    counts[slot] = rows or counts[slot]
    rows = counts[slot]
    gen = torch.Generator().manual_seed(4)
    x_mixed = torch.randn(sum(counts), IN, generator=gen)
    g_mixed = torch.randn(sum(counts), OUT, generator=gen)
    span = slice(sum(counts[:slot]), sum(counts[: slot + 1]))

    def run(counts, x, g):
        monkeypatch.setitem(globals(), "COUNTS", counts)
        layer, _ = make_layer(kind)
        with torch.no_grad():  # the LoRA term alone: fp32 MKL GEMMs depend on the row count
            layer.to_wrap.weight.zero_()
        x = x.clone().requires_grad_()
        (output(layer(x.view(-1, 1, IN))).view(x.size(0), -1) * g).sum().backward()
        adapter = layer.adapters[slot]
        return (
            output(layer(x.detach().view(-1, 1, IN))).view(x.size(0), -1),
            x.grad,
            adapter.linear_in.weight.grad,
            adapter.linear_out.weight.grad,
        )

    mixed = run(counts, x_mixed, g_mixed)
    alone_counts = [0] * len(counts)
    alone_counts[slot] = rows
    alone = run(alone_counts, x_mixed[span], g_mixed[span])
    for what, got, want in zip(
        ("output", "input grad", "A grad", "B grad"),
        alone,
        (mixed[0][span], mixed[1][span], mixed[2], mixed[3]),
    ):
        assert torch.equal(got, want), what
