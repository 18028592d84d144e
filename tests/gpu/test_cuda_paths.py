"""The code paths that only a GPU takes, each against the path CI checks on CPU.

Skipped without CUDA (``scripts/gpu_check.sh`` runs them on a GPU machine):
- the bf16 grouped GEMM (``torch._grouped_mm``, Hopper or newer) against the exact per-group
  loop, with odd and empty groups, asserting the kernel ran;
- a bf16 ``MultiLoRALinear`` against the fp32 token-by-token reference (max ranks that are
  and are not multiples of 8, ranks below them, an idle slot, odd and zero group sizes, a gap
  in the active slots), forward and backward, both LoRA GEMMs on the kernel (asserted);
- the training step in bf16 against fp32 on the same weights, dense and MoE (the MoE router
  without Transformer Engine), with the kernel asserted;
- Transformer Engine's layer spec against megatron's local spec (needs TE);
- the training step on CUDA (an NCCL group of one: every collective takes device tensors)
  against a plain per-micro-batch loop, fp32;
- a slot optimizer restored from its saved state on the GPU (the stacked AdamW keeps its rows
  on the device) and the CUDA generator saved and restored with a checkpoint's RNG;
- the tables' greedy generations read off the held-out pass of a bf16 model (its 1.0
  margin) against cached decoding on the GPU;
- the paged adapter table (pinned host pages, copies on a side stream): adapters taking turns
  in fewer slots against each alone;
- flash attention's varlen kernel with a sliding window (the graphed pass's attention)
  against the per-length masked batches, and attention sinks on the GPU against the CPU;
- Qwen3.5's Gated DeltaNet and gated attention (packed, and the KV cache's decode steps)
  against the CPU;
- the training pass under CUDA graphs (``trainer.cuda_graphs``): a replay against the same
  static pass run eagerly, and the graphed pass and the trainer's graphed step against the
  eager ones (losses and every slot's gradients), one capture per length, again on a rank
  change.
"""

import pytest
import torch

import megatron_multilora as mm
from tests.unit.test_known_generations import CFG as KNOWN_CFG
from tests.unit.test_known_generations import adapted, known_against_generated
from tests.unit.test_multi_lora_linear import KERNEL_CASES, check_grouped_kernel_parity
from tests.unit.test_step_schedule import DENSE, MOE, check_bf16_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N, DIM = 4, 8
RANKS, ALPHAS = [8, 2, 4, 5], [16.0, 4.0, 8.0, 10.0]
DENSE_KW = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=128,
)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(
        (got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-12)
    )


def needs_grouped_kernel() -> None:
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip(f"torch {torch.__version__} has no torch._grouped_mm")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm on CUDA needs Hopper or newer")


def _poison_free_memory(mib: int = 256) -> None:
    """Fill memory the caching allocator holds free with NaN, so a kernel's output it hands
    out next reads NaN where the kernel wrote nothing (fresh memory often reads as zeros,
    which would pass a check for a group that got no gradient)."""
    torch.cuda.synchronize()
    torch.full((mib << 18,), float("nan"), device="cuda").fill_(float("nan"))
    torch.cuda.synchronize()


def test_the_stacked_adamw_is_torchs_adamw_on_the_gpu():
    """The unit test on the GPU (its tiny model is built there): each slot's stacked update
    against ``torch.optim.AdamW`` on that slot alone, within the ulps CUDA's kernels differ by
    (``_assert_adamw_equal``)."""
    from tests.unit import test_slot_optimizer as unit

    assert next(unit.tiny_model(1).parameters()).is_cuda
    unit.test_each_slot_steps_as_torch_adamw_on_that_slot_alone(stacked=True)


def test_bf16_grouped_gemm_matches_the_per_group_loop(monkeypatch):
    from megatron_multilora.ops import grouped_mm as gmm

    needs_grouped_kernel()
    calls = []
    kernel = gmm._GROUPED_MM
    monkeypatch.setattr(gmm, "_GROUPED_MM", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = [37, 0, 5, 16, 1, 64]  # odd sizes and a group without rows
    x = torch.randn(
        sum(counts), 256, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True
    )
    w = torch.randn(
        len(counts),
        128,
        256,
        device="cuda",
        dtype=torch.bfloat16,
        generator=gen,
        requires_grad=True,
    )
    offsets = gmm.group_offsets(counts, x.device)
    grad = torch.randn(sum(counts), 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    _poison_free_memory()  # an unwritten empty group would read NaN, not fresh zeros
    y = gmm.grouped_mm(x, w, offsets, counts)
    assert calls == [1]
    y.backward(grad)
    # The loop, in fp32, is the reference (the fallback CI runs on CPU).
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    yf = torch.cat([p @ wf[g].t() for g, p in enumerate(torch.split(xf, counts))])
    yf.backward(grad.float())
    assert relative(y, yf) < 2e-2
    assert relative(x.grad, xf.grad) < 2e-2
    assert relative(w.grad, wf.grad) < 2e-2
    assert float(w.grad[1].abs().max()) == 0.0  # the empty group gets no gradient


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_bf16_multi_lora_linear_matches_fp32_reference(monkeypatch, case):
    needs_grouped_kernel()
    check_grouped_kernel_parity(monkeypatch, "cuda", torch.bfloat16, 2e-2, *KERNEL_CASES[case])


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_bf16_step_matches_fp32(monkeypatch, cfg):
    needs_grouped_kernel()
    check_bf16_step(monkeypatch, "cuda", cfg)


def _step_on(model, examples):
    """One SlotStep's per-slot losses; slot gradients stay in ``main_grad``."""
    from megatron_multilora.training.step.micro_batches import agree
    from megatron_multilora.training.step.slot_step import SlotStep

    step = SlotStep(model, N, 64, 1, 0)
    mbs = step.batcher.ready(examples)
    step.grad_sync.zero_grad(range(N))
    losses = step.losses(mbs, agree(mbs, N).loss_units)
    step.grad_sync.sync(range(N))
    return losses


def _examples():
    from megatron_multilora.data.datasets import Example

    gen = torch.Generator().manual_seed(1)
    lengths = [[9, 14], [11], [], [7, 10, 5]]

    def example(n):
        return Example(
            tuple(torch.randint(1, 128, (n,), generator=gen).tolist()),
            tuple([False] * (n // 3) + [True] * (n - 1 - n // 3)),
        )

    return [[example(n) for n in slot] for slot in lengths]


def _adapted(model):
    import megatron_multilora as mm

    mm.apply_multi_lora(model, N, DIM, 1.0, row_init_method="normal", seed=3)
    for s, (r, a) in enumerate(zip(RANKS, ALPHAS)):
        mm.init_adapter_slot(model, s, r, a)
    return model


def _tensors(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_transformer_engine_spec_matches_the_local_spec(moe, monkeypatch):
    pytest.importorskip("transformer_engine")
    import megatron_multilora as mm
    from megatron_multilora.models import specs

    cfg = mm.GPTModelConfig(
        **DENSE_KW, **(dict(num_moe_experts=4, moe_router_topk=2) if moe else {})
    )
    te_model = _adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True))
    monkeypatch.setattr(specs, "transformer_engine_usable", lambda: False)
    local = _adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True))
    # TE fuses the pre-attention / pre-MLP norms into its linears; the rest shares names.
    renames = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }
    state = {}
    for key, value in _tensors(te_model).items():
        if "_extra_state" in key:
            continue
        for te_name, local_name in renames.items():
            key = key.replace(te_name, local_name)
        state[key] = value
    missing, unexpected = local.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if "_extra_state" not in k]
    te_losses = _step_on(te_model, _examples())
    local_losses = _step_on(local, _examples())
    assert relative(te_losses, local_losses) < 1e-4
    for s in range(N):
        for p, want in zip(mm.slot_parameters(te_model, s), mm.slot_parameters(local, s)):
            if want.main_grad.abs().max() > 0:
                assert relative(p.main_grad, want.main_grad) < 1e-3, s


def test_the_step_on_cuda_matches_a_plain_loop():
    """The schedule-driven step on the GPU (an NCCL group of one: every collective takes device
    tensors) against plain per-micro-batch forward/backward on the same model, fp32."""
    import megatron_multilora as mm
    from megatron_multilora.training.step.micro_batches import agree, pack_micro_batches
    from tests.unit.test_step_schedule import reference

    cfg = mm.GPTModelConfig(**DENSE_KW)
    model = _adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True))
    # On CUDA megatron draws base weights from its tensor-parallel RNG stream, which a
    # second build does not repeat: the reference gets the model's weights loaded.
    ref = _adapted(mm.build_gpt_model(cfg, calculate_per_token_loss=True))
    ref.load_state_dict(_tensors(model))
    mbs = [mb.to(torch.device("cuda")) for mb in pack_micro_batches(_examples(), 64, 1, 0)]
    want_losses, want_grads = reference(ref, mbs, agree(mbs, N).loss_units)
    losses = _step_on(model, _examples())
    assert relative(losses, want_losses) < 1e-5
    assert set(want_grads) == {s for s in range(N) if _examples()[s]}
    for s, params in want_grads.items():
        for p, want in zip(mm.slot_parameters(model, s), params):
            assert relative(p.main_grad, want) < 1e-4, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_slot_optimizer_resumes_on_cuda(dtype):
    """The unit test's round trip on the GPU (its tiny model is built there): stepped, saved,
    loaded into a fresh optimizer of another model, both take the same next step, bit for
    bit (the stacked AdamW's state, step counts and fp32 masters on the device)."""
    from tests.unit import test_slot_optimizer as unit

    assert next(unit.tiny_model(1, dtype).parameters()).is_cuda
    unit.test_reloaded_optimizer_takes_the_same_next_step("cosine", dtype)


def test_checkpoint_rng_restores_the_cuda_generator():
    from megatron_multilora.training.checkpoints import restore_rng_state, rng_state

    state = rng_state()
    assert state["cuda"] is not None
    want = torch.rand(8, device="cuda")
    restore_rng_state(state)
    assert torch.equal(torch.rand(8, device="cuda"), want)


def test_experts_built_for_the_gpu_are_drawn_there():
    """Without CPU initialisation each rank draws its experts from megatron's expert-parallel
    CUDA stream, which only tensors on the GPU take from (a CPU tensor would draw from the
    CPU generator, the same on every expert-parallel rank)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_multilora.models.torch_modules import TorchGroupedLinear

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        use_cpu_initialization=False,
        params_dtype=torch.bfloat16,
    )
    linear = TorchGroupedLinear(
        2,
        16,
        32,
        config=cfg,
        init_method=torch.nn.init.normal_,
        bias=False,
        skip_bias_add=True,
        is_expert=True,
    )
    assert linear.weight0.is_cuda and linear.weight0.dtype == torch.bfloat16
    assert linear.weight0.abs().sum() > 0


def test_bf16_known_generations_are_the_generated_ones():
    model = adapted(
        mm.build_gpt_model(KNOWN_CFG, params_dtype=torch.bfloat16, calculate_per_token_loss=True)
    )
    assert next(model.parameters()).is_cuda
    failures, *_ = known_against_generated(model)
    assert not failures, failures


def _graph_models(dim: int = 16):
    """An fp32 reference and two bf16 models on the same (bf16-rounded) weights, slots of
    unequal ranks and one slot without rows in the examples (``_examples``)."""
    from megatron_multilora.training.step.slot_adamw import SlotAdamW

    cfg = mm.GPTModelConfig(**DENSE_KW)
    models = []
    for dtype in (torch.float32, torch.bfloat16, torch.bfloat16):
        model = mm.build_gpt_model(cfg, params_dtype=dtype, calculate_per_token_loss=True)
        mm.apply_multi_lora(model.cuda(), N, dim, 1.0, row_init_method="normal", seed=3)
        for s, (r, a) in enumerate(zip(RANKS, ALPHAS)):
            mm.init_adapter_slot(model, s, r, a)
        if models:
            model.load_state_dict(_tensors(models[0]))
        else:
            model.load_state_dict(
                {
                    k: v.bfloat16().to(v.dtype) if v.is_floating_point() else v
                    for k, v in _tensors(model).items()
                }
            )
        SlotAdamW.of(model)
        models.append(model)
    return models


def _pass(model, graphs=None):
    """The training pass over ``_examples`` padded to the graph lengths: per-slot losses and
    the slots' gradient rows."""
    from megatron_multilora.training.step.cuda_graphs import graph_lengths
    from megatron_multilora.training.step.micro_batches import MicroBatcher, agree
    from megatron_multilora.training.step.schedule import per_slot_results_and_data
    from megatron_multilora.training.step.slot_adamw import SlotAdamW

    mbs = MicroBatcher(model, N, 64, 1, 0, graph_lengths(64)).ready(_examples())
    rows = SlotAdamW.of(model).rows
    rows.grad_buffer.zero_()
    table, _ = per_slot_results_and_data(
        model, mbs, agree(mbs, N).loss_units, keep=(), graphs=graphs
    )
    return table[:, 0], rows.grads["dense"].clone()


def test_cuda_graph_pass_equals_the_eager_pass():
    from megatron_multilora.training.step.cuda_graphs import ChunkGraphs, StaticChunk
    from megatron_multilora.training.step.slot_adamw import SlotAdamW

    needs_grouped_kernel()
    ref, eager, graphed = _graph_models()
    graphs = ChunkGraphs(graphed, SlotAdamW.of(graphed).rows)
    want_losses, want_grads = _pass(ref)
    eager_losses, eager_grads = _pass(eager)
    losses, grads = _pass(graphs=graphs, model=graphed)
    assert graphs.captures >= 1
    again = _pass(graphs=graphs, model=graphed)  # replays, captures nothing new
    captured = graphs.captures
    torch.testing.assert_close(again[0], losses, rtol=0, atol=0)
    torch.testing.assert_close(again[1], grads, rtol=1e-6, atol=0)
    assert graphs.captures == captured
    # A replay is the static pass run eagerly, kernel for kernel.
    from megatron_multilora.training.step.micro_batches import pack_micro_batches, pad_micro_batch

    (mb,) = pack_micro_batches(_examples(), 64, 1, 0)
    mb = pad_micro_batch(mb, 64, 0)
    static = StaticChunk(graphed)(*graphs.inputs(mb))
    torch.testing.assert_close(graphs(graphs.inputs(mb)), static, rtol=1e-3, atol=1e-3)
    # Against fp32: no further from it than the eager bf16 pass (or 2%).
    assert relative(losses, want_losses) <= max(2 * relative(eager_losses, want_losses), 2e-2)
    for s in range(N):
        if not _examples()[s]:
            assert grads[s].abs().max() == 0  # a slot without rows gets nothing
            continue
        bound = max(2 * relative(eager_grads[s], want_grads[s]), 2e-2)
        assert relative(grads[s], want_grads[s]) <= bound, s
    # A rank change moves what every layer computes at: captured again, still right.
    mm.init_adapter_slot(graphed, 0, 16, ALPHAS[0])
    mm.init_adapter_slot(ref, 0, 16, ALPHAS[0])
    losses, _ = _pass(graphs=graphs, model=graphed)
    assert graphs.captures == captured + 1
    want_losses, _ = _pass(ref)
    assert relative(losses, want_losses) < 5e-2


def test_the_trainer_step_with_cuda_graphs_equals_the_eager_step():
    """``SlotStep(cuda_graphs=True).train``: two steps with each slot's AdamW, as the trainer
    runs them, against the eager bf16 step on the same weights."""
    from megatron_multilora.training.config import AdapterJob
    from megatron_multilora.training.objectives.registry import DEFAULT
    from megatron_multilora.training.runtime import start_job
    from megatron_multilora.training.step.slot_step import SlotStep, SlotWork

    needs_grouped_kernel()
    _, eager, graphed = _graph_models()
    results = []
    for model, graphs in ((eager, False), (graphed, True)):
        step = SlotStep(model, N, 64, 1, 0, cuda_graphs=graphs)
        work = {}
        for s, items in enumerate(_examples()):
            if items:  # each job's adapter drawn from its name: the same on both models
                job = AdapterJob(
                    name=f"job{s}",
                    dataset="(examples)",
                    rank=RANKS[s],
                    alpha=ALPHAS[s],
                    lr=1e-3,
                    schedule="constant",
                    max_steps=10,
                )
                opt = start_job(model, s, job, 10, mm.GPTModelConfig(**DENSE_KW))
                work[s] = SlotWork(items, DEFAULT(), opt)
        steps = [step.train(work) for _ in range(2)]
        results.append(
            (
                [r.losses for r in steps],
                # Gradient norms, not weights after Adam: Adam moves each weight by about lr
                # whatever the gradient's scale, so weights would hide a gradient 4x off.
                [torch.tensor([r.grad_norms[s] for s in sorted(work)]) for r in steps],
            )
        )
        if graphs:
            assert step.graphs.captures >= 1
    (want, want_norms), (got, got_norms) = results
    for a, b in zip(got, want):
        assert relative(a, b) < 5e-2
    for a, b in zip(got_norms, want_norms):
        assert (a / b - 1).abs().max() < 5e-2, (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_adapters_on_cuda_train_as_each_alone(dtype):
    """The paged table's GPU path: pages in pinned host memory, copied on a side stream. 12
    adapters taking turns in 4 slots against each alone (the CPU asserts the bits; here a
    step's reductions may be shaped by the slot count, so within a few ulps of each
    value's step)."""
    from tests.unit.test_adapter_table import turns_and_alone

    table, pairs = turns_and_alone(dtype)
    assert table._side is not None
    assert all(t.is_pinned() for page in table.pages.values() for t in page.rows.values())
    assert table.pages  # some are still paged out
    for got, want in pairs:
        for key in want:
            assert got[key].is_cuda
            scale = float(want[key].abs().max()) or 1.0
            bound = 8 * torch.finfo(want[key].dtype).eps * scale
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=bound, msg=key)


def test_flash_varlen_keeps_the_window_and_sinks_match_the_cpu():
    """The one pass (flash varlen, ``window_size=(w - 1, 0)``) against per-length batches
    masked to the window, bf16; sinks (off varlen) on the GPU against the CPU, fp32."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_multilora.models.gpt import transformer_config
    from megatron_multilora.models.torch_modules import SDPAttention, attend_in_one_pass
    from tests.hf_models import packed
    from tests.models import tiny_gpt

    lengths = [37, 5, 20]
    cfg = tiny_gpt(num_attention_heads=4, num_query_groups=2, sliding_window=6)
    attention = SDPAttention(transformer_config(cfg), 1, AttnMaskType.causal, "self").cuda()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(sum(lengths), heads, 16, generator=gen).cuda().bfloat16() for heads in (4, 2, 2)
    )
    params, _ = packed(lengths)
    params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.cuda()
    batched = attention(q, k, v, None, packed_seq_params=params)
    params, _ = packed(lengths)
    params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.cuda()
    one_pass = attention(q, k, v, None, packed_seq_params=attend_in_one_pass(params))
    torch.testing.assert_close(one_pass, batched, rtol=2e-2, atol=2e-2)

    cfg.softmax_type = "learnable"
    sinks = SDPAttention(transformer_config(cfg), 1, AttnMaskType.causal, "self")
    with torch.no_grad():
        sinks.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    q, k, v = (t.float().cpu()[:, None] for t in (q, k, v))  # [s, b=1, heads, dim]
    want = sinks(q, k, v, None)
    got = sinks.cuda()(q.cuda(), k.cuda(), v.cuda(), None)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_qwen3_5_layers_on_the_gpu_match_the_cpu(tmp_path):
    """Qwen3.5's Gated DeltaNet and gated attention on the GPU (plain torch: the rule in fp32
    whatever the weights' dtype), packed sequences across chunk boundaries and the KV cache's
    decode steps, against the same model on the CPU, fp32."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_multilora.models.hf_import import load_hf_model
    from tests.hf_models import make_hf_model, packed, token_batch

    make_hf_model("qwen3_5_text").save_pretrained(tmp_path)
    cpu, _ = load_hf_model(str(tmp_path))
    gpu, _ = load_hf_model(str(tmp_path))
    gpu.cuda()
    lengths = [130, 9, 40]
    ids = token_batch(batch=1, seq=sum(lengths))
    params, positions = packed(lengths)
    with torch.no_grad():
        want = cpu(ids, positions, None, packed_seq_params=params)
        params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.cuda()
        got = gpu(ids.cuda(), positions.cuda(), None, packed_seq_params=params)
    assert relative(got.cpu(), want) < 1e-4
    rows = ids[:, :12].expand(2, 12)
    outs = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        context = StaticInferenceContext(max_batch_size=2, max_sequence_length=12)
        with torch.no_grad():
            model(
                rows[:, :4].to(device),
                torch.arange(4, device=device).expand(2, 4),
                None,
                inference_context=context,
                runtime_gather_output=True,
            )
            for end in range(5, 13):
                context.sequence_len_offset = end - 1
                position = torch.full((2, 1), end - 1, device=device)
                out = model(
                    rows[:, end - 1 : end].to(device),
                    position,
                    None,
                    inference_context=context,
                    runtime_gather_output=True,
                )
        outs.append(out.cpu())
    assert relative(outs[1], outs[0]) < 1e-4
