"""The code paths that only a GPU takes, each against the path CI checks on CPU.

Skipped without CUDA (``scripts/gpu_check.sh`` runs them on a GPU machine):
- bf16 grouped GEMM (``torch._grouped_mm``, Hopper or newer) against the exact per-group loop,
  outputs and both gradients;
- Transformer Engine's layer spec against megatron's local spec with our pure-torch modules,
  dense and MoE, on the same weights: per-slot losses and every adapter gradient (needs TE);
- the training step on CUDA (NCCL process group of one, the collectives' device tensors)
  against a plain per-micro-batch loop on the same model.
"""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N, DIM = 4, 8
RANKS, ALPHAS = [8, 2, 4, 5], [16.0, 4.0, 8.0, 10.0]
DENSE_KW = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=128, vocab_size=128)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12))


def test_bf16_grouped_gemm_matches_the_per_group_loop():
    from megatron_multilora.ops.grouped_mm import group_offsets, grouped_mm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm on CUDA needs Hopper or newer")
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [64, 0, 48, 16]  # a group without rows
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16, generator=gen,
                    requires_grad=True)
    w = torch.randn(len(counts), 128, 256, device="cuda", dtype=torch.bfloat16, generator=gen,
                    requires_grad=True)
    y = grouped_mm(x, w, group_offsets(counts, x.device), counts)
    grad = torch.randn_like(y)
    y.backward(grad)
    # The loop, in fp32, is the reference (the fallback CI runs on CPU).
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yf = torch.cat([p @ wf[g].t() for g, p in enumerate(torch.split(xf, counts))])
    yf.backward(grad.float())
    assert relative(y, yf) < 2e-2
    assert relative(x.grad, xf.grad) < 2e-2
    assert relative(w.grad, wf.grad) < 2e-2
    assert float(w.grad[1].abs().max()) == 0.0  # the empty group gets no gradient


def _step_on(device_model, cfg, examples):
    """One SlotTrainStep's per-slot losses and slot gradients (full tensors, by key)."""
    import megatron_multilora as mm
    from megatron_multilora.training.step import SlotTrainStep

    step = SlotTrainStep(device_model, N, 64, 1, 0)
    mbs = step.pack(examples)
    from megatron_multilora.training.step import global_loss_tokens

    step.grad_sync.zero_grad(range(N))
    losses = step.losses(mbs, global_loss_tokens(mbs, N))
    step.grad_sync.sync(range(N))
    grads = {s: mm.get_slot_tensors(device_model, s, value=lambda p: p.main_grad) for s in range(N)}
    return losses, grads


def _examples():
    from megatron_multilora.data.datasets import Example

    gen = torch.Generator().manual_seed(1)
    lengths = [[9, 14], [11], [], [7, 10, 5]]

    def example(n):
        return Example(tuple(torch.randint(1, 128, (n,), generator=gen).tolist()),
                       tuple([False] * (n // 3) + [True] * (n - 1 - n // 3)))

    return [[example(n) for n in slot] for slot in lengths]


def _adapted(model, adapters=None):
    import megatron_multilora as mm

    mm.apply_multi_lora(model, N, DIM, 1.0, row_init_method="normal", seed=3)
    for s, (r, a) in enumerate(zip(RANKS, ALPHAS)):
        if adapters is None:
            mm.init_adapter_slot(model, s, r, a)
        else:
            mm.set_slot_tensors(model, s, adapters[s], r, a)
    return model


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_transformer_engine_spec_matches_the_local_spec(moe, monkeypatch):
    pytest.importorskip("transformer_engine")
    import megatron_multilora as mm
    from megatron_multilora.models import specs

    cfg = mm.GPTModelConfig(**DENSE_KW, **(dict(num_moe_experts=4, moe_router_topk=2) if moe else {}))
    mm.init_parallel(seed=0)
    try:
        te_model = _adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True))
        adapters = {s: mm.get_slot_tensors(te_model, s) for s in range(N)}
        monkeypatch.setattr(specs, "transformer_engine_usable", lambda: False)
        local = _adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True), adapters)
        # TE fuses the pre-attention / pre-MLP norms into its linears; the rest shares names.
        renames = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                   "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}
        state = {}
        for key, value in te_model.state_dict().items():
            if "_extra_state" in key or ".adapters." in key or not torch.is_tensor(value):
                continue
            for te_name, local_name in renames.items():
                key = key.replace(te_name, local_name)
            state[key] = value
        missing, unexpected = local.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        assert not [k for k in missing if ".adapters." not in k and "_extra_state" not in k]
        te_losses, te_grads = _step_on(te_model, cfg, _examples())
        local_losses, local_grads = _step_on(local, cfg, _examples())
        assert relative(te_losses, local_losses) < 1e-4
        for s in range(N):
            for key, want in local_grads[s].items():
                assert relative(te_grads[s][key], want) < 1e-3, (s, key)
    finally:
        mm.destroy_parallel()


def test_the_step_on_cuda_matches_a_plain_loop():
    """The schedule-driven step on the GPU (an NCCL group of one: every collective takes device
    tensors) against plain per-micro-batch forward/backward on the same model, fp32."""
    import megatron_multilora as mm
    from tests.unit.test_step_schedule import reference

    cfg = mm.GPTModelConfig(**DENSE_KW)
    mm.init_parallel(seed=0)
    try:
        model = _adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True))
        # The reference: the same config and adapters built again (layer init is seeded per
        # layer), with plain .grad gradients.
        ref = _adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True),
                       {s: mm.get_slot_tensors(model, s) for s in range(N)})
        from megatron_multilora.data.packing import pack_micro_batches
        from megatron_multilora.training.step import global_loss_tokens

        mbs = [mb.to(torch.device("cuda")) for mb in pack_micro_batches(_examples(), 64, 1, 0)]
        want_losses, want_grads = reference(ref, mbs, global_loss_tokens(mbs, N))
        losses, _ = _step_on(model, cfg, _examples())
        assert relative(losses, want_losses) < 1e-5
        assert set(want_grads) == {s for s in range(N) if _examples()[s]}
        for s, params in want_grads.items():
            for p, want in zip(mm.slot_parameters(model, s), params):
                assert relative(p.main_grad, want) < 1e-4, s
    finally:
        mm.destroy_parallel()
