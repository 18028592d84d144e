"""Expert multi-LoRA in one process: a MoE layer against a token-by-token reference, the
co-permuted slot ids against the dispatched rows, recompute, and config rejection."""

import pytest
import torch

import megatron_multilora as mm
from tests.reference import ExpertFactors, dispatch_slot_ids, moe_reference

E, TOPK, HID, FFN = 8, 2, 16, 12
N, DIM = 3, 4
COUNTS = [5, 0, 7]  # slot 1 has no tokens
RANKS, ALPHAS = [4, 2, 1], [8.0, 3.0, 2.0]


def moe_model(dispatcher="alltoall", **extra):
    cfg = mm.GPTModelConfig(
        num_layers=1,
        hidden_size=HID,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        vocab_size=32,
        num_moe_experts=E,
        moe_router_topk=TOPK,
        moe_token_dispatcher_type=dispatcher,
        **extra,
    )
    torch.manual_seed(0)
    model = mm.build_gpt_model(cfg)
    mm.apply_multi_lora(model, N, DIM, 1.0, row_init_method="normal")
    for i, (r, a) in enumerate(zip(RANKS, ALPHAS)):
        mm.init_adapter_slot(model, i, r, a)
    return model


def expert_factors(linear):
    """Reference leaves holding the wrapped expert linear's slot factors."""
    return [
        ExpertFactors(
            s.linear_in.weight.detach().clone().requires_grad_(),
            s.linear_out.weight.detach().clone().requires_grad_(),
            int(s.rank),
            float(s.alpha),
        )
        for s in linear.adapters
    ]


CLAMP = 0.05  # small enough that the tiny model's gates and ups are clamped
GPT_OSS = dict(
    add_bias_linear=True, activation="quick_gelu", activation_clamp=CLAMP, glu_linear_offset=1.0
)


def gpt_oss_glu(g: torch.Tensor, u: torch.Tensor, clamp: float | None = CLAMP) -> torch.Tensor:
    """transformers' gpt-oss experts: clamped gate and up, quick GELU, up + 1."""
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    return g * torch.sigmoid(1.702 * g) * (u + 1)


def random_expert_biases(moe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's and every expert's biases (zero as built), set to random values."""
    gen = torch.Generator().manual_seed(3)
    fc1, fc2 = moe.experts.linear_fc1.to_wrap, moe.experts.linear_fc2.to_wrap
    with torch.no_grad():
        for p in (moe.router.bias, *(getattr(f, f"bias{e}") for f in (fc1, fc2) for e in range(E))):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return tuple(
        t.detach().clone()
        for t in (
            moe.router.bias,
            torch.stack([getattr(fc1, f"bias{e}") for e in range(E)]),
            torch.stack([getattr(fc2, f"bias{e}") for e in range(E)]),
        )
    )


@pytest.mark.parametrize("experts", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_layer_matches_token_reference(dispatcher, experts):
    """SwiGLU experts, and gpt-oss's: biases (the router's too; fc2's weighted by the routing
    probability) and the clamped, offset quick-GELU GLU."""
    model = moe_model(dispatcher, **(GPT_OSS if experts == "gpt_oss" else {}))
    moe = model.decoder.layers[0].mlp
    fc1, fc2 = moe.experts.linear_fc1, moe.experts.linear_fc2
    biases, glu = None, lambda g, u: torch.nn.functional.silu(g) * u
    if experts == "gpt_oss":
        biases, glu = random_expert_biases(moe), gpt_oss_glu
    w1 = torch.stack([getattr(fc1.to_wrap, f"weight{e}").detach() for e in range(E)])
    w2 = torch.stack([getattr(fc2.to_wrap, f"weight{e}").detach() for e in range(E)])
    ref1, ref2 = expert_factors(fc1), expert_factors(fc2)
    x = torch.randn(sum(COUNTS), HID, generator=torch.Generator().manual_seed(8))  # expert 1 idle
    x_ref, x_in = x.clone().requires_grad_(), x.clone().view(-1, 1, HID).requires_grad_()
    g = torch.randn(sum(COUNTS), HID, generator=torch.Generator().manual_seed(5))

    mm.set_tokens_per_adapter_slot(model, COUNTS)
    y, _ = moe(x_in)
    (y.view(-1, HID) * g).sum().backward()
    y_ref, per_expert = moe_reference(
        x_ref, moe.router.weight.detach(), TOPK, w1, w2, ref1, ref2, COUNTS, biases, glu
    )
    (y_ref * g).sum().backward()
    if experts == "gpt_oss":  # the clamp is reached: unclamped, the reference differs
        unclamped, _ = moe_reference(
            x_ref.detach(),
            moe.router.weight.detach(),
            TOPK,
            w1,
            w2,
            ref1,
            ref2,
            COUNTS,
            biases,
            lambda g, u: gpt_oss_glu(g, u, None),
        )
        assert (unclamped - y_ref).abs().max() > 1e-3

    assert 0 in per_expert, "the case must include an expert that receives no tokens"
    torch.testing.assert_close(y.view(-1, HID), y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_in.grad.view(-1, HID), x_ref.grad, rtol=1e-5, atol=1e-6)
    for linear, refs in ((fc1, ref1), (fc2, ref2)):
        for s, ref in enumerate(refs):
            for factor, leaf in (
                (linear.adapters[s].linear_in, ref.a),
                (linear.adapters[s].linear_out, ref.b),
            ):
                if factor.weight.grad is None:  # the empty slot takes no part: no gradient
                    assert s == 1 and leaf.grad is None
                    continue
                want = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
                # every (slot, expert) pair, including empty experts
                torch.testing.assert_close(factor.weight.grad, want, rtol=1e-5, atol=1e-6)
    assert fc1.adapters[1].linear_in.weight.grad is None


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_co_permuted_slot_ids_match_dispatched_rows(dispatcher):
    """Encode each token's slot in its hidden state; the experts must see the same slots."""
    counts = [4, 3, 5]
    dispatched, routed = dispatch_slot_ids(moe_model(dispatcher), counts, HID)
    assert dispatched.numel() == sum(counts) * TOPK
    assert torch.equal(dispatched, routed)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_moe_recompute_gives_the_same_gradients(recompute):
    grads = []
    for setting in (None, recompute):
        model = moe_model(recompute_granularity=setting, recompute_modules=["moe"])
        assert model.config.recompute_granularity == setting
        ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
        mm.set_tokens_per_adapter_slot(model, COUNTS)
        model(ids, torch.arange(12)[None], None, labels=ids).mean().backward()
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "router",
    [
        dict(moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.01),
        dict(moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=8),
    ],
    ids=["sigmoid_aux_loss", "pre_softmax_shared_experts"],
)
def test_router_variants_train_expert_adapters(router):
    model = moe_model(**router)
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
    mm.set_tokens_per_adapter_slot(model, COUNTS)
    model(ids, torch.arange(12)[None], None, labels=ids).mean().backward()
    moe = model.decoder.layers[0].mlp
    assert moe.router.weight.grad is None  # the router stays frozen
    assert moe.experts.linear_fc1.adapters[0].linear_in.weight.grad.abs().sum() > 0
    if "moe_shared_expert_intermediate_size" in router:
        assert isinstance(moe.shared_experts.linear_fc1, mm.MultiLoRALinear)
        assert moe.shared_experts.linear_fc1.adapters[2].linear_out.weight.grad.abs().sum() > 0


def plain_moe(dispatcher="alltoall"):
    cfg = mm.GPTModelConfig(
        num_layers=1,
        hidden_size=HID,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        vocab_size=32,
        num_moe_experts=E,
        moe_token_dispatcher_type=dispatcher,
    )
    torch.manual_seed(0)
    return mm.build_gpt_model(cfg)


def test_install_hooks_once_and_counts_only_new_hooks():
    model = moe_model()  # apply_multi_lora installed the hook
    assert len(model.decoder.layers[0].mlp.experts._forward_pre_hooks) == 1
    assert mm.install_moe_slot_routing(model) == 0  # nothing new to hook
    assert len(model.decoder.layers[0].mlp.experts._forward_pre_hooks) == 1
    experts = model.decoder.layers[0].mlp.experts
    experts._slot_routing_handle.remove()
    experts._slot_routing_handle = None
    assert mm.install_moe_slot_routing(model) == 1
    dense = mm.build_gpt_model(
        mm.GPTModelConfig(num_layers=1, hidden_size=HID, num_attention_heads=4, vocab_size=32)
    )
    assert mm.install_moe_slot_routing(mm.apply_multi_lora(dense, N, DIM, 1.0)) == 0


def test_refused_moe_setting_leaves_the_model_untouched():
    """The MoE check runs before any linear is wrapped or the base frozen."""
    plain = plain_moe()
    plain.config.moe_expert_capacity_factor = 1.0
    plain.config.moe_permute_fusion = True
    before = {n: p.requires_grad for n, p in plain.named_parameters()}
    types = [type(m) for m in plain.modules()]
    with pytest.raises(ValueError, match=r"token dropping.*moe_permute_fusion=True"):
        mm.apply_multi_lora(plain, N, DIM, 1.0)
    assert [type(m) for m in plain.modules()] == types  # nothing wrapped
    assert {n: p.requires_grad for n, p in plain.named_parameters()} == before
    assert all(before.values())  # the base was trainable and still is


def test_sequential_experts_are_refused_naming_the_cause():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection

    model = plain_moe()
    moe = model.decoder.layers[0].mlp
    moe.experts = SequentialMLP(
        moe.num_local_experts,
        model.config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        pg_collection=get_default_pg_collection(),
    )
    with pytest.raises(
        ValueError,
        match=r"local_experts\.0\.linear_fc1 is an expert of a "
        r"SequentialMLP.*moe_grouped_gemm=True",
    ):
        mm.apply_multi_lora(model, N, DIM, 1.0)
    assert not any(isinstance(m, mm.MultiLoRALinear) for m in model.modules())
    # Leaving the experts out works.
    mm.apply_multi_lora(model, N, DIM, 1.0, target_modules=["*.self_attention.*"])


def test_expert_adapters_follow_the_slot_api():
    model = moe_model()
    fc1 = model.decoder.layers[0].mlp.experts.linear_fc1
    assert isinstance(fc1, mm.MultiLoRALinear) and fc1.adapters[0].linear_in.weight.shape == (
        E,
        DIM,
        HID,
    )
    assert all(p.allreduce is False for p in fc1.adapters.parameters())
    assert fc1.adapters[1].linear_in.weight[:, 2:].abs().sum() == 0  # rank 2 of 4, every expert
    saved = mm.adapter_state_dict(model, 0)
    mm.clear_adapter_slot(model, 2)
    assert fc1.adapters[2].alpha == 0
    assert mm.load_adapter(model, 2, saved) == len(saved)
    assert torch.equal(fc1.adapters[2].linear_out.weight, fc1.adapters[0].linear_out.weight)
    with mm.hide_adapters(model):
        assert not any("adapter" in k for k in model.state_dict())


@pytest.mark.parametrize("kind", ["dense", "expert"])
def test_both_layer_classes_expose_the_seeds_settings_read_only(kind):
    """The seed API's constructor settings, as Megatron-Bridge's layer tests read them."""
    settings = dict(
        column_init_method="kaiming", row_init_method="normal", dropout=0.1, dropout_position="post"
    )
    cfg = mm.GPTModelConfig(
        num_layers=1,
        hidden_size=HID,
        num_attention_heads=4,
        ffn_hidden_size=FFN,
        vocab_size=32,
        **(dict(num_moe_experts=E, moe_router_topk=TOPK) if kind == "expert" else {}),
    )
    model = mm.apply_multi_lora(mm.build_gpt_model(cfg), N, DIM, 1.0, **settings)
    mlp = model.decoder.layers[0].mlp
    layer = mlp.experts.linear_fc1 if kind == "expert" else mlp.linear_fc1
    assert type(layer).__name__ == (
        "MultiLoRAGroupedExpertLinear" if kind == "expert" else "MultiLoRALinear"
    )
    assert {name: getattr(layer, name) for name in settings} == settings
    assert (layer.n_slots, layer.max_rank) == (N, DIM)
    for name in settings:
        with pytest.raises(AttributeError):
            setattr(layer, name, settings[name])
