"""The model-wide slot API (seed: init/clear/load/expose/hide) and its errors."""

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.ops.slot_layout import narrow_counts_to_window
from tests.unit.test_multi_lora_linear import COUNTS, DIM, IN, make_layer, output


class Wrapped(torch.nn.Module):
    """Two wrapped layers in a container, as apply_multi_lora would leave them."""

    def __init__(self, seed=0):
        super().__init__()
        self.q, _ = make_layer("column", seed=seed)
        self.o, _ = make_layer("row", seed=seed + 1)

    def forward(self, x):
        return output(self.o(output(self.q(x))[..., :IN]))


def test_narrow_counts_to_window():
    assert narrow_counts_to_window([3, 0, 5], 4, 4) == [0, 0, 4]
    assert narrow_counts_to_window([3, 0, 5], 0, 4) == [3, 0, 1]
    assert narrow_counts_to_window([2, 2, 2, 2], 2, 4) == [0, 2, 2, 0]


def test_token_count_errors_name_the_problem():
    model = Wrapped()
    with pytest.raises(ValueError, match=r"3 entries but the model has 4"):
        mm.set_tokens_per_adapter_slot(model, [1, 2, 3])
    with pytest.raises(ValueError, match=r"\(1, -2\)"):
        mm.set_tokens_per_adapter_slot(model, [1, -2, 3, 4])
    with pytest.raises(ValueError, match=r"integer tensor"):
        mm.set_tokens_per_adapter_slot(model, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    mm.set_tokens_per_adapter_slot(model, torch.tensor([4, 4, 4, 4]))  # sums to 16
    with pytest.raises(ValueError, match=r"MultiLoRALinear\(test.column\): input has 10 tokens"):
        model(torch.randn(10, 1, IN))
    with pytest.raises(ValueError, match=r"ep_slots=\[0, 2\] leaves out slots \[3\]"):
        mm.set_tokens_per_adapter_slot(model, [4, 0, 4, 8], ep_slots=[0, 2])
    with pytest.raises(ValueError, match=r"slot indices in 0..3; bad entries: \[4\]"):
        mm.set_tokens_per_adapter_slot(model, [4, 0, 4, 8], ep_slots=[0, 2, 3, 4])
    mm.set_tokens_per_adapter_slot(model, [4, 0, 4, 8], ep_slots=[3, 1, 0, 2])
    assert model.q.slot_layout.ep_slots == (0, 1, 2, 3)
    fresh = mm.MultiLoRALinear(torch.nn.Linear(4, 4), 2, 2, 1.0, "lonely")
    with pytest.raises(RuntimeError, match=r"set_tokens_per_adapter_slot"):
        fresh(torch.randn(3, 1, 4))


def test_init_adapter_slot_checks_rank_and_index():
    model = Wrapped()
    for bad in (0, DIM + 1, 2.5):
        with pytest.raises(ValueError, match=rf"rank={bad} is outside 1..{DIM}"):
            mm.init_adapter_slot(model, 0, bad, 1.0)
    with pytest.raises(IndexError, match=r"slot 4 is out of range 0..3"):
        mm.init_adapter_slot(model, 4, 2, 1.0)
    mm.init_adapter_slot(model, 2, 3, 6.0)
    for layer in mm.multi_lora_modules(model):
        assert layer.adapters.scale[2].item() == 2.0
        assert layer.adapters[2].linear_in.weight[3:].abs().sum() == 0


def test_clear_restores_deterministic_init_and_silences_slot():
    model, pristine = Wrapped(), Wrapped()
    mm.clear_adapter_slot(pristine, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    mm.clear_adapter_slot(model, 1)
    for layer, ref in zip(mm.multi_lora_modules(model), mm.multi_lora_modules(pristine)):
        got, want = layer.adapters[1], ref.adapters[1]
        assert torch.equal(got.linear_in.weight, want.linear_in.weight)
        assert torch.equal(got.linear_out.weight, want.linear_out.weight)
        assert got.alpha.item() == 0.0 and got.rank.item() == DIM and layer.adapters.scale[1] == 0
    # An inactive slot's tokens see only the base.
    layer = model.q
    layer.slot_layout = mm.ops.slot_layout.SlotLayout([0, 6, 0, 0])
    x = torch.randn(6, 1, IN)
    assert torch.equal(output(layer(x)), output(layer.to_wrap(x)))


def test_expose_names_one_slot_and_restores_on_error():
    model = Wrapped()
    slot2 = model.q.adapters[2]
    with mm.expose_adapter_slot(model, 2):
        names = [n for n, _ in model.named_parameters()]
        assert "q.adapter.linear_in.weight" in names
        assert not any(".adapters." in n for n in names)
        assert model.q.adapter is slot2
    with pytest.raises(RuntimeError, match=r"boom"):
        with mm.expose_adapter_slot(model, 0):
            raise RuntimeError("boom")
    names = [n for n, _ in model.named_parameters()]
    assert "q.adapters.3.linear_out.weight" in names and not any(".adapter." in n for n in names)
    with pytest.raises(IndexError):
        with mm.expose_adapter_slot(model, 9):
            pass


def test_hide_adapters_leaves_exactly_the_base_state():
    model = Wrapped()
    with mm.hide_adapters(model):
        keys = set(model.state_dict())
    base_keys = {f"{n}.{k}" for n in ("q", "o") for k in getattr(model, n).to_wrap.state_dict()}
    assert keys == base_keys and "q.weight" in keys  # the base's own keys, no wrapper level
    model.load_state_dict({**model.state_dict(), "q.weight": torch.zeros(24, IN)})
    assert model.q.to_wrap.weight.abs().sum() == 0


def test_load_adapter_moves_a_slot_and_rejects_mismatches():
    model = Wrapped()
    x = torch.randn(sum(COUNTS), 1, IN)
    mm.set_tokens_per_adapter_slot(model, [16, 0, 0, 0])
    want = model(x)
    saved = mm.adapter_state_dict(model, 0)
    assert all(".adapter." in k for k in saved) and len(saved) == 10  # 2 layers x 5

    before = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(KeyError, match=r"missing"):
        mm.load_adapter(model, 3, {k: v for k, v in saved.items() if not k.startswith("o.")})
    with pytest.raises(KeyError, match=r"unexpected"):
        mm.load_adapter(model, 3, {**saved, "q.adapter.extra": torch.zeros(1)})
    bad = dict(saved, **{"q.adapter.linear_in.weight": torch.zeros(DIM, IN + 1)})
    with pytest.raises(ValueError, match=r"shapes differ"):
        mm.load_adapter(model, 3, bad)
    bad = dict(saved, **{"q.adapter.rank": torch.tensor(DIM + 3)})
    with pytest.raises(ValueError, match=r"ranks outside"):
        mm.load_adapter(model, 3, bad)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())

    assert mm.load_adapter(model, 3, saved) == 10
    mm.set_tokens_per_adapter_slot(model, [0, 0, 0, 16])
    assert torch.equal(model(x), want)
