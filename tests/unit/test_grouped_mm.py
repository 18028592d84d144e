"""``ops.grouped_mm`` on CPU against a float64 per-group loop: outputs and both gradients, on
every path it takes (the kernel with its own backward for a narrow input side, i.e. a LoRA
B; the kernel with torch's backward; the per-group loop for shapes the kernel refuses),
with an empty group, a group of one row and odd group sizes."""

import collections
import ctypes
import re

import pytest
import torch

from megatron_multilora.ops import grouped_mm as gmm

COUNTS = [5, 0, 1, 23, 9]
# (in, out, whether the narrow-input backward runs)
SHAPES = {
    "lora_b_rank_8": (8, 40, True),
    "lora_b_rank_12": (12, 32, True),
    "lora_a_rank_8": (48, 8, False),
    "rank_16": (16, 40, False),
    "wide": (24, 40, False),
    "loop_rank_3": (3, 40, False),
}


def reference(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return torch.cat([xg @ w[g].t() for g, xg in enumerate(x.split(counts))])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "dtype,rel", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"]
)
def test_grouped_mm_matches_float64_loop(monkeypatch, shape, dtype, rel):
    in_f, out_f, narrow = SHAPES[shape]
    used = []
    function = gmm._GroupedMM.apply
    monkeypatch.setattr(gmm._GroupedMM, "apply", lambda *a: used.append(a[3]) or function(*a))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(COUNTS), in_f, generator=gen).to(dtype)
    w = torch.randn(len(COUNTS), out_f, in_f, generator=gen).to(dtype)
    g = torch.randn(sum(COUNTS), out_f, generator=gen).to(dtype)
    x_l, w_l = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = gmm.grouped_mm(x_l, w_l, gmm.group_offsets(COUNTS, x.device), COUNTS)
    (y * g).sum().backward()
    # the kernel reads rows of whole 16-byte units (bf16 at rank 12 falls back to the loop)
    assert any(used) == (narrow and in_f * x.element_size() % 16 == 0)
    x_r, w_r = x.double().requires_grad_(), w.double().requires_grad_()
    y_r = reference(x_r, w_r, COUNTS)
    (y_r * g.double()).sum().backward()
    assert y.dtype == dtype and x_l.grad.is_contiguous()
    for got, want, what in (
        (y, y_r, "output"),
        (x_l.grad, x_r.grad, "input grad"),
        (w_l.grad, w_r.grad, "weight grad"),
    ):
        assert got.shape == want.shape, what
        err = (got.double() - want).abs().max().item()
        assert err <= rel * want.abs().max().item(), f"{what}: max abs error {err:.3e}"
    assert w_l.grad[1].abs().max() == 0  # the empty group's weight gets a zero gradient


def test_a_narrow_input_takes_no_kernel_call_with_a_narrow_output(monkeypatch):
    """With a LoRA rank as the input side, both gradients are transposes of wide products:
    no kernel call writes an output whose rows are the rank wide (MKL runs that orientation
    several times slower)."""
    outputs = []
    kernel = gmm._GROUPED_MM
    monkeypatch.setattr(
        gmm, "_GROUPED_MM", lambda *a, **k: outputs.append(kernel(*a, **k).shape) or kernel(*a, **k)
    )
    x = torch.randn(sum(COUNTS), 8, requires_grad=True)
    w = torch.randn(len(COUNTS), 40, 8, requires_grad=True)
    y = gmm.grouped_mm(x, w, gmm.group_offsets(COUNTS, x.device), COUNTS)
    y.sum().backward()
    assert len(outputs) == 3 and all(shape[-1] >= 16 for shape in outputs), outputs


def test_an_expanded_gradient_is_read_with_the_kernel_layout():
    """``y.sum()``'s gradient is a stride-0 view, which the kernel would refuse."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(sum(COUNTS), 8, generator=gen, requires_grad=True)
    w = torch.randn(len(COUNTS), 40, 8, generator=gen, requires_grad=True)
    gmm.grouped_mm(x, w, gmm.group_offsets(COUNTS, x.device), COUNTS).sum().backward()
    x_r, w_r = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    reference(x_r, w_r, COUNTS).sum().backward()
    assert torch.allclose(x.grad.double(), x_r.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad.double(), w_r.grad, rtol=1e-5, atol=1e-5)


def run_groups_alone(x, w, g):
    """Each group's rows through ``single_group_mm``, forward and backward: its output and
    gradients, group by group."""
    results, start = [], 0
    for group, rows in enumerate(COUNTS):
        x_one = x[start : start + rows].clone().requires_grad_()
        w_one = w[group].clone().requires_grad_()
        y_one = gmm.single_group_mm(x_one, w_one)
        (y_one * g[start : start + rows]).sum().backward()
        results.append((y_one, x_one.grad, w_one.grad))
        start += rows
    return results


def run_grouped(x, w, g):
    x_all, w_all = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_all = gmm.grouped_mm(x_all, w_all, gmm.group_offsets(COUNTS, x.device), COUNTS)
    (y_all * g).sum().backward()
    return y_all, x_all.grad, w_all.grad


def operands(shape: str, seed: int = 2):
    in_f, out_f, _ = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(sum(COUNTS), in_f, generator=gen),
        torch.randn(len(COUNTS), out_f, in_f, generator=gen),
        torch.randn(sum(COUNTS), out_f, generator=gen),
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_one_groups_product_has_the_grouped_calls_bits(shape):
    """``single_group_mm`` on one group's rows gives that group's rows of the grouped call
    and its weight's gradient to the last bit, forward and backward (groups of 0, 1, 5, 9 and
    23 rows): a slot trained alone and beside others sees the same numbers, which later bf16
    rounding would otherwise turn into visible differences. It holds because the GEMMs are
    the same BLAS calls (the next test); this checks the bits on whatever path MKL takes."""
    x, w, g = operands(shape)
    y_all, gx_all, gw_all = run_grouped(x, w, g)
    start = 0
    for group, (y_one, gx_one, gw_one) in enumerate(run_groups_alone(x, w, g)):
        span = slice(start, start + COUNTS[group])
        assert torch.equal(y_one, y_all[span]), group
        assert torch.equal(gx_one, gx_all[span]), group
        assert torch.equal(gw_one, gw_all[group]), group
        start += COUNTS[group]


def blas_calls(capfd, run) -> collections.Counter:
    """The fp32 GEMMs MKL runs for ``run()``, counted by what selects its kernel and the
    order of its sums: transposes, m, n, k and the operands' leading dims (not the output's
    leading dim or the addresses)."""
    capfd.readouterr()
    with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
        run()
    ctypes.CDLL(None).fflush(None)  # MKL writes its lines through C's buffered stdout
    calls = re.findall(r"MKL_VERBOSE SGEMM\(([^)]*)\)", capfd.readouterr().out)
    fields = [call.split(",") for call in calls]
    return collections.Counter(
        tuple(f[i] for i in (0, 1, 2, 3, 4, 7, 9)) for f in fields if "0" not in (f[2], f[3], f[4])
    )


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
@pytest.mark.parametrize("shape", SHAPES)
def test_one_groups_product_runs_the_grouped_calls_blas_calls(capfd, shape):
    """Alone, a group's forward and backward issue exactly the BLAS calls its rows issue in
    the grouped call, so equal bits do not depend on how MKL rounds on this CPU. This fails
    where bits may happen to agree: before ``single_group_mm`` ran the kernel, a one-row
    group's input gradient was a column-major ``[in, 1]`` GEMM alone, a row-major one
    grouped (equal on AMD's MKL path, not on Intel's AVX-512 one)."""
    x, w, g = operands(shape)
    grouped = blas_calls(capfd, lambda: run_grouped(x, w, g))
    alone = blas_calls(capfd, lambda: run_groups_alone(x, w, g))
    assert sum(grouped.values()) >= 3 * sum(1 for c in COUNTS if c), grouped  # MKL ran them
    assert alone == grouped
