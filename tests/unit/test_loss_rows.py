"""The output layer at the loss rows only (models/loss_rows.py): the same per-token loss and
adapter gradients as megatron's whole-model loss at the positions with a loss, 0 elsewhere,
while the output layer projects only those rows."""

import torch

from megatron_multilora.layers.lifecycle import slot_parameters
from megatron_multilora.models.loss_rows import token_loss
from megatron_multilora.training.step.micro_batches import chunk_inputs, pack_micro_batches
from megatron_multilora.training.step.schedule import loss_rows
from tests.unit.test_step_schedule import DENSE, PAD, N, build, slot_examples


def test_the_loss_at_its_rows_equals_the_whole_models_there():
    model = build(DENSE)
    (mb,) = pack_micro_batches(slot_examples(), 10**6, 1, PAD)
    mask = mb.loss_mask[0] > 0
    rows = loss_rows(mb)
    assert 0 < rows.numel() < mask.numel()  # some positions have no loss
    results = []
    for at in (None, rows):
        model.zero_grad()
        seen = []
        hook = model.output_layer.register_forward_hook(  # the rows it projected
            lambda module, args, out, seen=seen: seen.append(out[0].shape[0])
        )
        loss = token_loss(model, chunk_inputs(model, mb), mb.labels, at)
        hook.remove()
        (loss[0] * mask).sum().backward()
        grads = [p.grad.clone() for s in range(N) for p in slot_parameters(model, s)]
        results.append((loss.detach(), grads, seen))
    (whole, whole_grads, whole_seen), (picked, picked_grads, picked_seen) = results
    assert whole_seen == [mask.numel()] and picked_seen == [rows.numel()]
    torch.testing.assert_close(picked[0][mask], whole[0][mask], rtol=1e-5, atol=1e-6)
    assert not picked[0][~mask].any()
    for a, b in zip(picked_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
