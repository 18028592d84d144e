"""apply_multi_lora on a real megatron GPT, and the model builder's config checks."""

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.layers.inject import set_adapter_trainability
from tests.models import tiny_gpt

CFG = tiny_gpt()
N, DIM = 3, 4


def gpt(cfg=CFG):
    torch.manual_seed(0)
    return mm.build_gpt_model(cfg)


def lora_params_expected(model):
    """N * (dim*in + out*dim) per wrapped layer, from the base weights' shapes."""
    total = 0
    for layer in mm.multi_lora_modules(model):
        out_f, in_f = layer.to_wrap.weight.shape
        total += N * DIM * (in_f + out_f)
    return total


def test_wraps_all_four_targets_and_trains_only_adapters():
    model = mm.apply_multi_lora(gpt(), N, DIM, 8.0)
    names = [n for n, _ in mm.layers.lifecycle.named_multi_lora_modules(model)]
    assert len(names) == 4 * CFG.num_layers
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapter = {n for n, _ in model.named_parameters() if ".adapters." in n}
    assert trainable == adapter
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == lora_params_expected(
        model
    )
    # qkv: 32 -> (4 + 2*2) heads * 8 = 64 outputs, 3 slots of rank 4: 3 * 4 * (32 + 64)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    gated = {
        n.rsplit(".", 1)[-1]: m.tp_layout.gated
        for n, m in mm.layers.lifecycle.named_multi_lora_modules(model)
    }
    assert gated == {
        "linear_qkv": False,
        "linear_proj": False,
        "linear_fc1": True,
        "linear_fc2": False,
    }
    assert sum(p.numel() for p in qkv.adapters.parameters()) == 3 * 4 * (32 + 64)


def test_idempotent_and_conflicting_reapply():
    model = mm.apply_multi_lora(gpt(), N, DIM, 8.0)
    before = [id(m) for m in mm.multi_lora_modules(model)]
    mm.apply_multi_lora(model, N, DIM, 8.0)
    assert [id(m) for m in mm.multi_lora_modules(model)] == before
    assert not any(isinstance(m.to_wrap, mm.MultiLoRALinear) for m in mm.multi_lora_modules(model))
    with pytest.raises(ValueError, match="already wrapped with n_slots=3"):
        mm.apply_multi_lora(model, N + 1, DIM, 8.0)


def test_the_old_names_of_slots_and_max_rank_still_work_deprecated():
    """n_adapters / dim were renamed n_slots / max_rank: users' code keeps working, warned."""
    with pytest.warns(DeprecationWarning, match=r"apply_multi_lora\(n_adapters=...\)"):
        model = mm.apply_multi_lora(gpt(), n_adapters=N, dim=DIM, alpha=8.0)
    layer = mm.multi_lora_modules(model)[0]
    assert (layer.n_slots, layer.max_rank) == (N, DIM)
    with pytest.warns(DeprecationWarning, match=r"MultiLoRALinear.dim is deprecated"):
        assert (layer.n_adapters, layer.dim) == (N, DIM)
    with pytest.raises(TypeError, match="give n_slots= only"):
        mm.apply_multi_lora(gpt(), N, n_slots=N, n_adapters=N, max_rank=DIM, alpha=8.0)


def test_wildcard_targets_and_model_chunks():
    chunks = [gpt(), gpt()]
    mm.apply_multi_lora(chunks, N, DIM, 8.0, target_modules=["*.layers.0.*.linear_qkv"])
    for chunk in chunks:
        wrapped = [n for n, m in chunk.named_modules() if isinstance(m, mm.MultiLoRALinear)]
        assert wrapped == ["decoder.layers.0.self_attention.linear_qkv"]
    # Separate models (no virtual pipeline stages) keep their paths apart by chunk.
    assert [n for n, _ in mm.layers.lifecycle.named_multi_lora_modules(chunks)] == [
        f"chunk{k}.decoder.layers.0.self_attention.linear_qkv" for k in range(2)
    ]
    with pytest.raises(ValueError, match="matched no linear"):
        mm.apply_multi_lora(gpt(), N, DIM, 8.0, target_modules=["linear_nope"])
    # One misspelt target among good ones used to wrap nothing there, silently.
    model = gpt()
    with pytest.raises(ValueError, match=r"\['linear_fc_2'\] matched no linear"):
        mm.apply_multi_lora(model, N, DIM, 8.0, target_modules=["linear_qkv", "linear_fc_2"])
    assert not any(isinstance(m, mm.MultiLoRALinear) for m in model.modules())  # left as it was


def test_base_checkpoint_keys_unchanged_and_fresh_adapters_are_a_noop():
    plain = gpt().requires_grad_(False)  # a frozen base, as the wrapped model's: the same GEMMs
    ids = torch.randint(0, CFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)[None]
    want = plain(ids, pos, None, labels=ids)
    model = mm.apply_multi_lora(gpt(), N, DIM, 8.0)
    with mm.hide_adapters(model):
        assert set(model.state_dict()) == set(plain.state_dict())
        model.load_state_dict(plain.state_dict())
    mm.set_tokens_per_adapter_slot(model, [5, 0, 7])
    assert torch.equal(model(ids, pos, None, labels=ids), want)


def test_set_adapter_trainability_counts():
    model = mm.apply_multi_lora(gpt(), N, DIM, 8.0)
    for p in model.parameters():
        p.requires_grad_(True)
    assert set_adapter_trainability(model) == lora_params_expected(model)


def test_model_config_errors_are_collected():
    bad = mm.GPTModelConfig(
        hidden_size=30, num_attention_heads=4, num_query_groups=3, activation="tanh"
    )
    with pytest.raises(ValueError) as err:
        mm.build_gpt_model(bad)
    msg = str(err.value)
    assert "num_attention_heads=4 is not divisible by num_query_groups=3" in msg
    assert "hidden_size=30 is not divisible" in msg and "activation='tanh'" in msg
    assert mm.GPTModelConfig(vocab_size=257).check(2) == [
        "vocab_size=257 is not divisible by tensor parallel size 2"
    ]


@pytest.mark.parametrize(
    "variant",
    [
        dict(normalization="LayerNorm", activation="gelu", gated_linear_unit=False),
        dict(position_embedding_type="learned_absolute", tie_word_embeddings=True),
        dict(add_bias_linear=True, add_qkv_bias=True, qk_layernorm=True),
    ],
    ids=["layernorm_gelu", "absolute_tied", "biases_qknorm"],
)
def test_builder_variants_train_through_adapters(variant):
    cfg = mm.GPTModelConfig(**{**CFG.__dict__, **variant})
    model = mm.apply_multi_lora(gpt(cfg), N, DIM, 8.0, row_init_method="normal")
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    mm.set_tokens_per_adapter_slot(model, [4, 6, 0])
    model(ids, torch.arange(10)[None], None, labels=ids).mean().backward()
    grads = [p.grad for p in mm.slot_parameters(model, 0)]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    # No tokens: left out of the GEMMs, so no gradient at all.
    assert all(p.grad is None for p in mm.slot_parameters(model, 2))


def test_init_parallel_rejects_unsupported_layouts():
    with pytest.raises(
        ValueError,
        match=r"tensor_model_parallel_size=1 x "
        r"pipeline_model_parallel_size=2 must divide the world "
        r"size 1",
    ):
        mm.init_parallel(pipeline_model_parallel_size=2)
    with pytest.raises(
        ValueError,
        match="virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1",
    ):
        mm.init_parallel(virtual_pipeline_model_parallel_size=2)
    with pytest.raises(
        ValueError,
        match="expert_model_parallel_size=2 must divide the 1 processes of each pipeline stage",
    ):
        mm.init_parallel(expert_model_parallel_size=2)
    with pytest.raises(ValueError, match="sequence_parallel=true needs"):
        mm.init_parallel(sequence_parallel=True)
    with pytest.raises(ValueError, match="must divide the world size 1"):
        mm.init_parallel(tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="expert_model_parallel_size=0: must be at least 1"):
        mm.init_parallel(expert_model_parallel_size=0)
    mm.init_parallel(seed=1234)  # the session's layout is still usable


def test_destroy_parallel_frees_every_group_with_megatrons_gloo_groups_too():
    """On a GPU megatron also makes gloo groups (``init_parallel`` asks for them there) and
    destroys those itself, while its list of every group it made holds them too: each group
    must be destroyed exactly once (this raised 'Invalid process group' on the first GPU)."""
    from megatron.core import parallel_state
    from torch.distributed.distributed_c10d import _world

    mm.destroy_parallel()
    try:
        parallel_state.initialize_model_parallel(create_gloo_process_groups=True)
        made = [g for g in parallel_state._global_process_group_list if g is not None]
        gloo = parallel_state.get_data_parallel_group_gloo()
        assert any(g is gloo for g in made)  # the state the GPU run was in
        assert all(g in _world.pg_map for g in made)
        mm.destroy_parallel()
        assert not [g for g in made if g in _world.pg_map]
    finally:
        mm.init_parallel(seed=1234)


def test_a_walk_of_the_adapted_layers_costs_the_same_whatever_the_slots(monkeypatch):
    """Starting, freeing or reading one slot walks the model's layers, not its slots: the
    walk visits the same modules with 2 slots as with 64 (it was every slot's too, so
    starting N jobs cost N^2)."""
    from megatron_multilora.layers import model_paths

    visited = []
    walk = model_paths._named_modules

    def counted(root, skip_inside):
        for item in walk(root, skip_inside):
            visited.append(item[0])
            yield item

    monkeypatch.setattr(model_paths, "_named_modules", counted)
    counts = []
    for n in (2, 64):
        model = mm.apply_multi_lora(gpt(), n, DIM, 8.0)
        visited.clear()
        layers = mm.multi_lora_modules(model)
        counts.append(len(visited))
        assert len(layers) == 8 and all(layer.n_slots == n for layer in layers)
    assert counts[0] == counts[1]
