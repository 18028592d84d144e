"""DeepSeek-V3 under TP=2 with SP (MLA at TP=2 without SP is refused: megatron leaves a
gradient partial), EP=2 and PP=2: Megatron logits and gradients equal transformers', each
rank reads only its slices (under PP only its stage's layers, dense or MoE by global layer),
multi-LoRA slots give the one-process logits and gradients (MLA's linears, the experts,
shared experts and dense MLPs adapted), and a slot's PEFT export does not depend on the
layout. Also: a TP-replicated base carrying TE's ``sequence_parallel=False`` (MLA's
duplicated down-projections under TE) takes the model's SP flag."""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import load_file

import megatron_multilora as mm
from megatron_multilora.checkpoint.peft_format import export_peft
from megatron_multilora.layers.slot_tensors import get_slot_tensors, set_slot_tensors
from megatron_multilora.models.hf_config import hf_to_model_config
from megatron_multilora.models.hf_import import load_hf_model
from tests.distributed.conftest import assert_all_ranks, compare
from tests.distributed.test_hf_import_parallel import REL, recorded_reads, saved_checkpoint
from tests.hf_models import hf_logits, make_hf_model, megatron_logits, token_batch
from tests.unit.test_deepseek_v3 import (
    LINEARS,
    TOL,
    add_skipped_mlp_deltas,
    trained_like_slot,
)

pytest.importorskip("transformers")

TARGETS = ["linear_q_down_proj", "linear_q_up_proj", *LINEARS]


@pytest.mark.parametrize(
    "tp,ep,sp,shards",
    [(2, 1, True, None), (1, 2, False, None), (2, 1, True, "40KB")],
    ids=["tp2_sp", "ep2", "tp2_sp_sharded_checkpoint"],
)
def test_logits_and_reads(layout, monkeypatch, tp, ep, sp, shards):
    layout(tp=tp, ep=ep, sp=sp)
    hf_model = make_hf_model("deepseek_v3", seed=11)
    save = {"max_shard_size": shards} if shards else {}
    reads = recorded_reads(monkeypatch)
    with saved_checkpoint(hf_model, **save) as folder:
        model, _ = load_hf_model(folder, sequence_parallel=sp)
    failures: list[str] = []
    for seed in range(3):
        ids = token_batch(seed)
        compare(failures, megatron_logits(model, ids), hf_logits(hf_model, ids), REL, "logits")
    shapes = dict(reads)
    if tp == 2:  # heads and o_proj's columns halved, the replicated latents whole
        for name, want in (
            ("self_attn.q_a_proj.weight", (48, 64)),
            ("self_attn.q_b_proj.weight", (48, 48)),
            ("self_attn.kv_a_proj_with_mqa.weight", (40, 64)),
            ("self_attn.kv_b_proj.weight", (80, 32)),
            ("self_attn.o_proj.weight", (64, 48)),
            ("mlp.gate_proj.weight", (48, 64)),
            ("mlp.shared_experts.down_proj.weight", (64, 16)),
        ):
            layer = 0 if name.startswith("mlp.gate") else 1
            got = shapes.get(f"model.layers.{layer}.{name}")
            if got != want:
                failures.append(f"layer {layer} {name}: read {got}, want this rank's {want}")
    if ep == 2:
        first = 2 * parallel_state.get_expert_model_parallel_rank()  # 4 experts, 2 per rank
        mine = {f".experts.{e}." for e in (first, first + 1)}
        experts = [n for n, _ in reads if ".experts." in n]
        if not experts or any(not any(m in n for m in mine) for n in experts):
            failures.append(f"expert reads {sorted(set(experts))[:4]}, want only {sorted(mine)}")
    assert_all_ranks(failures)


def test_tp2_without_sp_is_refused(layout):
    layout(tp=2)
    cfg = hf_to_model_config(make_hf_model("deepseek_v3").config.to_dict())
    with pytest.raises(ValueError, match="needs sequence parallelism"):
        mm.build_gpt_model(cfg)


def test_tp2_sp_gradients_match_transformers(layout):
    """The shared RoPE key's gradient sums over the TP ranks' heads: every layer's input
    norm gradient (it sees all of attention's input gradient) equals transformers'."""
    layout(tp=2, sp=True)
    hf_model = make_hf_model("deepseek_v3", seed=9)
    with saved_checkpoint(hf_model) as folder:
        model, _ = load_hf_model(folder, sequence_parallel=True)
    ids = token_batch(0)
    weights = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(ids.size(1))[None].expand_as(ids)
    (model(ids, positions, None, runtime_gather_output=True) * weights).sum().backward()
    (hf_model(ids).logits * weights).sum().backward()
    failures: list[str] = []
    for i, layer in enumerate(model.decoder.layers):
        grad = layer.input_layernorm.weight.grad  # this rank's sequence shard's part
        dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        want = hf_model.model.layers[i].input_layernorm.weight.grad
        compare(failures, grad, want, 1e-4, f"layer {i} input_layernorm grad")
    assert_all_ranks(failures)


def test_pp2_stages_build_and_load_their_layers(layout, monkeypatch):
    """4 layers, 3 dense first: stage 1 holds global layers 2 (dense) and 3 (MoE), which it
    builds only if the dense/MoE pattern is taken at its offset; parameters and expert biases
    equal PP=1's import per global layer, and a stage reads only its layers."""
    from megatron_multilora.models.gpt import build_model_chunks
    from megatron_multilora.models.hf_config import read_hf_config
    from megatron_multilora.models.hf_import import load_hf_checkpoint
    from tests.distributed.test_pipeline_parallel import by_global_key

    hf_model = make_hf_model("deepseek_v3", seed=5, num_hidden_layers=4, first_k_dense_replace=3)
    failures: list[str] = []
    layout()
    with saved_checkpoint(hf_model) as folder:
        want, _ = load_hf_model(folder)
        want_bias = want.decoder.layers[3].mlp.router.expert_bias.clone()
        want = by_global_key([want], "data")
        layout(pp=2)
        cfg = hf_to_model_config(read_hf_config(folder))
        chunks = build_model_chunks(cfg)
        reads = recorded_reads(monkeypatch)
        load_hf_checkpoint(chunks, folder, cfg)
    got = by_global_key(chunks, "data")
    if not got.keys() <= want.keys():
        failures.append(f"parameters PP=1 lacks: {sorted(got.keys() - want.keys())[:3]}")
    for key in got.keys() & want.keys():
        compare(failures, got[key], want[key], 0.0, key)
    layers = {layer.layer_number - 1: layer for c in chunks for layer in c.decoder.layers}
    moe = {i: hasattr(layer.mlp, "router") for i, layer in layers.items()}
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if moe != ({0: False, 1: False} if stage == 0 else {2: False, 3: True}):
        failures.append(f"stage {stage}: MoE layers {moe}")
    if stage == 1:
        compare(failures, layers[3].mlp.router.expert_bias, want_bias, 0.0, "expert bias")
    read_layers = {int(n.split(".")[2]) for n, _ in reads if n.startswith("model.layers.")}
    if read_layers != set(layers):
        failures.append(f"read layers {sorted(read_layers)}, holds {sorted(layers)}")
    assert_all_ranks(failures)


@pytest.mark.parametrize("tp,ep,sp", [(2, 1, True), (1, 2, False)], ids=["tp2_sp", "ep2"])
def test_lora_slot_logits_and_peft_export_match_one_process(layout, tmp_path, tp, ep, sp):
    """A slot adapting every MLA linear, expert, shared expert and dense MLP gives the
    one-process logits on the sharded layout, exports the same PEFT files, and peft (plus
    the MLP deltas it skips, merged by hand) gives those logits."""
    import peft

    layout(tp=1)
    folder = [str(tmp_path)]
    dist.broadcast_object_list(folder, src=0)  # one folder for all ranks
    root = folder[0]
    if dist.get_rank() == 0:
        make_hf_model("deepseek_v3").save_pretrained(f"{root}/base")
    dist.barrier()
    ids = token_batch()
    model, cfg = load_hf_model(f"{root}/base")
    mm.apply_multi_lora(model, 3, 8, 1.0, target_modules=TARGETS)
    trained_like_slot(model, 1)
    full = get_slot_tensors(model, 1)
    mm.set_tokens_per_adapter_slot(model, [0, ids.numel(), 0])
    want = megatron_logits(model, ids)
    export_peft(model, 1, f"{root}/one", cfg, "deepseek_v3", f"{root}/base")
    mm.destroy_parallel()

    layout(tp=tp, ep=ep, sp=sp)
    model, cfg = load_hf_model(f"{root}/base", sequence_parallel=sp)
    mm.apply_multi_lora(model, 3, 8, 1.0, target_modules=TARGETS)
    set_slot_tensors(model, 1, full, rank=4, alpha=6.0)
    mm.set_tokens_per_adapter_slot(model, [0, ids.numel(), 0])
    failures: list[str] = []
    got = megatron_logits(model, ids)
    compare(failures, got, want, 1e-5, f"slot logits tp={tp} ep={ep} sp={sp} vs one process")
    export_peft(model, 1, f"{root}/sharded", cfg, "deepseek_v3", f"{root}/base")
    one = load_file(f"{root}/one/adapter_model.safetensors")
    sharded = load_file(f"{root}/sharded/adapter_model.safetensors")
    if one.keys() != sharded.keys() or any(not torch.equal(one[k], sharded[k]) for k in one):
        failures.append("the export depends on the layout")
    wrapped = peft.PeftModel.from_pretrained(make_hf_model("deepseek_v3"), f"{root}/sharded")
    add_skipped_mlp_deltas(wrapped, Path(root) / "sharded")
    hf = hf_logits(wrapped.eval(), ids)
    if (hf - got).abs().max() > TOL:
        failures.append(f"peft logits differ by {(hf - got).abs().max():.2e}")
    assert_all_ranks(failures)


@pytest.mark.parametrize("tp,ep,sp", [(2, 1, True), (1, 2, False)], ids=["tp2_sp", "ep2"])
def test_training_grads_match_one_process(layout, tp, ep, sp):
    """Per-slot losses and every slot's factor gradients (megatron DDP + finalize) on the
    sharded layout equal one process's: four slots of unequal ranks, one without tokens, one
    across the SP window boundary, through MLA, dense, shared-expert and expert LoRA."""
    from megatron.core.distributed import finalize_model_grads

    from tests.distributed.harness import (
        build,
        load_full_state,
        local_view,
        micro_batch,
        step,
        trainable_grads,
    )

    cfg = hf_to_model_config(make_hf_model("deepseek_v3").config.to_dict())
    counts, rel = [5, 0, 7, 4], 2e-5

    def run(ddp):
        ddp.zero_grad_buffer()
        losses = step(ddp, micro_batch(0, counts, cfg.vocab_size))
        finalize_model_grads([ddp])
        return losses, trainable_grads(ddp)

    layout(tp=1)
    ddp = build(cfg, targets=TARGETS)
    state = {k: v.clone() for k, v in ddp.module.state_dict().items() if torch.is_tensor(v)}
    want_losses, want = run(ddp)
    mm.destroy_parallel()

    layout(tp=tp, ep=ep, sp=sp)
    ddp = build(cfg, sp, targets=TARGETS)
    load_full_state(ddp, state, cfg)
    losses, grads = run(ddp)
    failures: list[str] = []
    compare(failures, losses, want_losses, rel, "per-slot loss")
    like = ddp.module.state_dict(keep_vars=True)
    if not any(".linear_kv_down_proj.adapters." in k for k in grads):
        failures.append("no adapter on linear_kv_down_proj")
    for key, grad in grads.items():
        compare(failures, grad, local_view(key, want, like[key], cfg), rel, key)
    assert_all_ranks(failures)


class DuplicatedLinear(torch.nn.Module):
    """Stands in for TE's duplicated ``TELinear`` (MLA's down-projections under TE): the
    whole weight on every TP rank, ``(out, bias)`` returned, and ``sequence_parallel=False``,
    which TE sets for a linear it runs at TP 1, though under SP it reads a sequence shard."""

    parallel_mode = "duplicated"
    sequence_parallel = False

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x @ self.weight.t(), None


def test_duplicated_base_under_sp_takes_the_models_flag(layout):
    """Under TP=2 + SP each rank's duplicated base sees its half of the rows; the LoRA term
    must intersect each slot's tokens with that window (a slot spans the boundary), and the
    replicated factors' gradients are partial sums that the SP reduction completes."""
    from megatron_multilora.ops.slot_layout import SlotLayout
    from tests.distributed.test_tp_layers import sum_sequence_parallel_grads
    from tests.reference import lora_reference, random_slots

    layout(tp=2, sp=True)
    rank = parallel_state.get_tensor_model_parallel_rank()
    counts, dim, n_in, n_out = [5, 0, 7, 4], 8, 16, 24
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n_out, n_in, generator=gen) * 0.3
    slots = random_slots(4, dim, n_in, n_out, [8, 3, 1, 5], [16.0, 4.0, 2.0, 10.0], gen)
    x = torch.randn(sum(counts), n_in, generator=gen)
    g = torch.randn(sum(counts), n_out, generator=gen)
    x_ref = x.clone().requires_grad_()
    y_ref = lora_reference(x_ref, w, slots, counts)
    (y_ref * g).sum().backward()

    layer = mm.MultiLoRALinear(DuplicatedLinear(w), 4, dim, 1.0, "dup", sequence_parallel=True)
    with torch.no_grad():
        for i, f in enumerate(slots):
            layer.init_adapter_slot(i, f.rank, f.alpha)
            layer.adapters[i].linear_in.weight.copy_(f.a)
            layer.adapters[i].linear_out.weight.copy_(f.b)
    layer.slot_layout = SlotLayout(counts)
    x_local = x.chunk(2)[rank].clone().requires_grad_()
    y, _ = layer(x_local.unsqueeze(1))
    (y.squeeze(1) * g.chunk(2)[rank]).sum().backward()
    sum_sequence_parallel_grads(layer)
    failures: list[str] = []
    compare(failures, y.squeeze(1).detach(), y_ref.chunk(2)[rank].detach(), 1e-5, "output")
    compare(failures, x_local.grad, x_ref.grad.chunk(2)[rank], 1e-5, "input grad")
    for i, f in enumerate(slots):
        compare(failures, layer.adapters[i].linear_in.weight.grad, f.a.grad, 1e-5, f"A{i} grad")
        compare(failures, layer.adapters[i].linear_out.weight.grad, f.b.grad, 1e-5, f"B{i} grad")
    assert_all_ranks(failures)
