"""The hot path does only the work its micro-batch needs: idle slots and padded rank are not
computed, and nothing in forward/backward waits on the device (a host-device sync on GPU)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_multilora import MultiLoRALinear
from megatron_multilora.layers import multi_lora_linear
from megatron_multilora.layers.expert_lora import MultiLoRAGroupedExpertLinear
from megatron_multilora.layers.slot_routing import build_expert_slot_routing
from megatron_multilora.models.torch_modules import TorchGroupedLinear
from megatron_multilora.ops.slot_layout import SlotLayout
from tests.reference import linear_config, lora_reference, random_slots

IN, OUT, DIM = 16, 24, 32
RANKS = [4, 32, 12, 2]
ALPHAS = [8.0, 4.0, 6.0, 2.0]

aten = torch.ops.aten
# Ops that read device values back to the host (or need a data-dependent output size).
SYNCING = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}


class SyncDetector(TorchDispatchMode):
    """Records every syncing op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING or (
            func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        ):
            self.syncs.append(str(func))
        return func(*args, **kwargs)


def test_detector_catches_a_sync():
    with SyncDetector() as det:
        torch.ones(3).sum().item()
        torch.tensor([0, 1, 1]).nonzero()
    assert len(det.syncs) == 2


def wrapped(counts):
    base = torch.nn.Linear(IN, OUT, bias=False)
    layer = MultiLoRALinear(base, len(RANKS), DIM, 1.0, "test.less")
    slots = random_slots(len(RANKS), DIM, IN, OUT, RANKS, ALPHAS, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i, f in enumerate(slots):
            layer.init_adapter_slot(i, f.rank, f.alpha)
            layer.adapters[i].linear_in.weight.copy_(f.a)
            layer.adapters[i].linear_out.weight.copy_(f.b)
    layer.slot_layout = SlotLayout(counts)
    return layer, slots


def test_dense_forward_backward_has_no_host_sync():
    layer, _ = wrapped([3, 0, 5, 2])
    x = torch.randn(10, 1, IN, requires_grad=True)
    layer(x).sum().backward()  # builds this micro-batch's segments (host work, once)
    with SyncDetector() as det:
        layer(x).sum().backward()
    assert det.syncs == []


def test_expert_routing_forward_backward_has_no_host_sync():
    e, n = 4, len(RANKS)
    base = TorchGroupedLinear(
        e,
        IN,
        OUT,
        config=linear_config(),
        init_method=torch.nn.init.normal_,
        bias=False,
        skip_bias_add=True,
        is_expert=True,
    )
    layer = MultiLoRAGroupedExpertLinear(
        base, n, DIM, 1.0, "test.experts", e, row_init_method="normal"
    )
    tokens_per_expert = torch.tensor([3, 0, 4, 2])  # as the dispatcher hands them (host)
    slot = torch.tensor([0, 2, 2, 0, 3, 2, 0, 3, 3])
    x = torch.randn(9, IN, requires_grad=True)
    with SyncDetector() as det:
        layer.routing = build_expert_slot_routing(slot, tokens_per_expert, (0, 2, 3), n, e)
        out, _ = layer(x, tokens_per_expert.tolist())
        out.sum().backward()
    # The base's own grouped GEMM splits rows by the host list it is given; ours add nothing.
    assert det.syncs == []
    assert layer.adapters[1].linear_in.weight.grad is None  # slot 1 took no part


def test_idle_slots_and_padded_rank_are_not_computed(monkeypatch):
    shapes = []

    def recording(x, w, seg, **kwargs):
        shapes.append(tuple(w.shape))
        return real(x, w, seg, **kwargs)

    real = multi_lora_linear.grouped_linear
    monkeypatch.setattr(multi_lora_linear, "grouped_linear", recording)
    counts = [3, 0, 5, 0]  # slots 0 and 2 (ranks 4 and 12); slot 1 (rank 32) is idle
    layer, slots = wrapped(counts)
    x = torch.randn(sum(counts), IN, requires_grad=True)
    y = layer(x.view(-1, 1, IN)).view(sum(counts), -1)
    # Two active slots, computed at rank 16 (12 rounded up to a multiple of 8), not 32.
    assert shapes == [(2, 16, IN), (2, OUT, 16)]

    x_ref = x.detach().clone().requires_grad_()
    y_ref = lora_reference(x_ref, layer.to_wrap.weight.detach(), slots, counts)
    g = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(1))
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for i in (0, 2):
        torch.testing.assert_close(layer.adapters[i].linear_in.weight.grad, slots[i].a.grad)
        torch.testing.assert_close(layer.adapters[i].linear_out.weight.grad, slots[i].b.grad)
    for i in (1, 3):
        assert layer.adapters[i].linear_in.weight.grad is None


@pytest.mark.parametrize("alpha_of_idle", [0.0, 5.0])
def test_a_freed_slot_does_not_raise_the_computed_rank(monkeypatch, alpha_of_idle):
    """A slot at alpha 0 (a free slot) contributes nothing, so its rank is not computed."""
    shapes = []
    real = multi_lora_linear.grouped_linear
    monkeypatch.setattr(
        multi_lora_linear,
        "grouped_linear",
        lambda x, w, seg, **kw: shapes.append(tuple(w.shape)) or real(x, w, seg, **kw),
    )
    layer, _ = wrapped([3, 4, 0, 0])
    layer.init_adapter_slot(1, 32, alpha_of_idle)
    layer(torch.randn(7, 1, IN))
    assert shapes[0] == (2, 8 if alpha_of_idle == 0.0 else 32, IN)


@pytest.mark.parametrize("counts", [[3, 4, 5, 2], [3, 0, 9, 2]])
def test_factor_copies_are_not_kept_for_backward(counts):
    """Only the slots' own parameters grow with the slot count: contiguous active slots'
    factors are read as views of the layer's slot buffer, and the copy that non-contiguous
    ones need is freed after forward and rebuilt in backward."""
    import gc
    import weakref

    layer, _ = wrapped(counts)
    copies, rebuilds = [], []
    real = layer.adapters.stack

    def recording(factor, slots, r):
        w, rebuild = real(factor, slots, r)
        buffer = layer.adapters.factor_buffers[factor].buffer
        if w.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
            assert rebuild is None
            return w, None
        copies.append(weakref.ref(w))
        return w, lambda: rebuilds.append(factor) or rebuild()

    layer.adapters.stack = recording
    x = torch.randn(14, 1, IN, requires_grad=True)
    y = layer(x)
    gc.collect()
    assert len(copies) == (2 if 0 in counts else 0)
    assert all(ref() is None for ref in copies), "a copy of the factors is kept"
    y.sum().backward()  # backward rebuilds any copy and still gives every active slot's gradient
    assert sorted(f.name for f in rebuilds) == (["A", "B"] if 0 in counts else [])
    for i, c in enumerate(counts):
        assert (layer.adapters[i].linear_in.weight.grad is not None) == (c > 0)
