"""The fused rotary embedding (ops/rope.py) that megatron calls through ``apply_rope_fusion``
where Transformer Engine is absent: the same values and gradients as megatron's own unfused
RoPE, packed (thd) and padded (bshd), and the model runs it."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_multilora as mm
from megatron_multilora.data.datasets import Example
from megatron_multilora.ops.rope import apply_rope, apply_rope_packed
from megatron_multilora.training.step.micro_batches import pack_micro_batches
from tests.models import tiny_gpt

LENGTHS = [5, 9, 1, 12, 3]


class _OneRank:  # megatron's unfused thd RoPE asks its context-parallel group for size and rank
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def freqs_table(max_len: int, rot_dim: int) -> torch.Tensor:
    """megatron's RotaryEmbedding layout: ``[max_len, 1, 1, rot_dim]``, angles twice."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    angles = torch.outer(torch.arange(max_len).float(), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])  # whole head; partial rotary
def test_packed_rope_equals_megatrons_unfused_values_and_gradients(dtype, rot_dim):
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(sum(LENGTHS), 4, 16, generator=gen).to(dtype).requires_grad_()
    freqs, cu = freqs_table(max(LENGTHS), rot_dim), bounds(LENGTHS)
    grad = torch.randn(t.shape, generator=gen).to(dtype)
    want = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_OneRank())
    got = apply_rope_packed(t, cu, freqs)
    assert torch.equal(got, want)
    (want_grad,), (got_grad,) = (torch.autograd.grad(y, t, grad) for y in (want, got))
    assert torch.equal(got_grad, want_grad)
    # and it rotates: position 0 of every sequence is left as it is, later ones are not
    starts = cu[:-1].long()
    assert torch.equal(got[starts], t[starts]) and not torch.equal(got[1:5], t[1:5])


def test_padded_rope_equals_megatrons_unfused():
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(12, 2, 4, 16, generator=gen, requires_grad=True)
    freqs = freqs_table(12, 16)
    want = rope_utils._apply_rotary_pos_emb_bshd(t, freqs)
    got = apply_rope(t, freqs)
    assert torch.equal(got, want)
    grad = torch.randn(t.shape, generator=gen)
    assert torch.equal(torch.autograd.grad(got, t, grad)[0], torch.autograd.grad(want, t, grad)[0])


def test_a_micro_batchs_cos_and_sin_are_made_once_and_follow_its_freqs():
    t, cu = torch.randn(sum(LENGTHS), 2, 16), bounds(LENGTHS)
    freqs = freqs_table(12, 16)
    apply_rope_packed(t, cu, freqs)
    first = cu._rope_cos_sin
    apply_rope_packed(t, cu, freqs)  # the next layer of the same micro-batch
    assert cu._rope_cos_sin is first
    longer = freqs_table(20, 16)  # other angles (another table): computed anew, not reused
    assert torch.equal(
        apply_rope_packed(t, cu, longer), apply_rope_packed(t, bounds(LENGTHS), longer)
    )
    assert cu._rope_cos_sin[-1][0] is longer and len(cu._rope_cos_sin) == 2  # one per table


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host (``.item()``, ``bool(t)``):
    a device sync each on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_packed_rope_reads_nothing_back_from_the_device_forward_or_backward():
    t = torch.randn(sum(LENGTHS), 2, 16, requires_grad=True)
    cu, freqs = bounds(LENGTHS), freqs_table(12, 16)
    with _HostReads() as megatrons:  # the check sees a read where there is one
        rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_OneRank())
    assert megatrons.count > 0
    with _HostReads() as ours:
        for _ in range(2):  # building the micro-batch's cos/sin, then reusing them
            apply_rope_packed(t, cu, freqs).sum().backward()
    assert ours.count == 0


def test_what_it_does_not_implement_is_refused_by_name():
    t, cu, freqs = torch.randn(4, 2, 16), bounds([4]), freqs_table(4, 16)
    with pytest.raises(ValueError, match="context-parallel"):
        apply_rope_packed(t, cu, freqs, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="rotary_interleaved"):
        apply_rope(t[:, None], freqs, interleaved=True)


def test_the_model_runs_the_fused_rope_and_matches_megatrons_unfused_path():
    if rope_utils.fused_apply_rotary_pos_emb_thd is not apply_rope_packed:
        pytest.skip("Transformer Engine's fused RoPE is installed")
    cfg = tiny_gpt()
    gen = torch.Generator().manual_seed(0)
    (mb,) = pack_micro_batches(
        [
            [
                Example(tuple(torch.randint(0, 64, (n + 1,), generator=gen).tolist()), (True,) * n)
                for n in LENGTHS
            ]
        ],
        1000,
    )
    losses = []
    for fusion in (True, False):
        torch.manual_seed(0)
        model = mm.build_gpt_model(cfg, apply_rope_fusion=fusion)
        assert model.config.apply_rope_fusion is fusion
        loss = model(
            mb.tokens,
            mb.position_ids,
            None,
            labels=mb.labels,
            packed_seq_params=mb.packed_seq_params(),
        )
        loss.sum().backward()
        losses.append((loss, model.embedding.word_embeddings.weight.grad))
    (fused, fused_grad), (unfused, unfused_grad) = losses
    assert torch.equal(fused, unfused) and torch.equal(fused_grad, unfused_grad)
