"""The training step, evaluation and generation under pipeline parallelism (PP=2 with
megatron's 1F1B schedule; PP=4 with the interleaved one, two virtual stages per rank) against
a plain per-micro-batch loop on one process's whole model, dense and MoE, with a filler.

Interleaving is tested at PP=4, not 2: with two stages a rank's previous and next stage are
the same peer, and gloo pairs megatron's batched sends and receives by order, which differs
between the two sides (send_prev first, recv_prev first): activations and gradients swap.

Until the model builder makes pipeline stages (``build_model_chunks``) and ``init_parallel``
takes a pipeline size, this test builds each chunk's GPTModel and the layout by hand; the
weights of the whole model are mapped onto the chunks (megatron's layer offsets).
"""

import dataclasses


import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

import megatron_multilora as mm
from megatron_multilora.data.packing import pack_micro_batches
from megatron_multilora.models.gpt import transformer_config
from megatron_multilora.models.specs import gpt_block_spec
from megatron_multilora.platform.cpu_support import activate_cpu_support
from megatron_multilora.training import evaluation
from megatron_multilora.training.schedule import micro_batch_multiple
from megatron_multilora.training.slot_optimizer import slot_grad_norm
from megatron_multilora.training.step import (
    SlotTrainStep,
    equalize_micro_batches,
    global_loss_tokens,
)
from tests.distributed.conftest import TIMEOUT_S, assert_all_ranks, compare
from tests.unit.test_step_schedule import DENSE, MOE, N, PAD, build, reference, slot_examples

BUDGET = 32


def prompts() -> list[tuple[int, list[int]]]:
    gen = torch.Generator().manual_seed(3)
    return [(s, torch.randint(1, 64, (n,), generator=gen).tolist())
            for s, n in ((0, 5), (1, 3), (2, 7), (0, 4))]


def chunk_models(cfg: mm.GPTModelConfig, pp: int, vpp: int, full: dict[str, torch.Tensor]
                 ) -> list[GPTModel]:
    """This rank's model chunks (one per virtual stage) with the whole model's weights."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    per_chunk = cfg.num_layers // (pp * vpp)
    config = transformer_config(cfg, False, torch.float32, calculate_per_token_loss=True,
                                pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    chunks = []
    for v in range(vpp):
        chunk = GPTModel(
            config=config, transformer_layer_spec=gpt_block_spec(per_chunk, num_experts=cfg.num_moe_experts),
            vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_sequence_length,
            position_embedding_type=cfg.position_embedding_type,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
            vp_stage=v if vpp > 1 else None)
        offset = v * cfg.num_layers // vpp + stage * per_chunk  # megatron's layer offset

        def global_key(key: str, offset: int = offset) -> str:
            if not key.startswith("decoder.layers."):
                return key
            layer, _, rest = key[len("decoder.layers."):].partition(".")
            return f"decoder.layers.{int(layer) + offset}.{rest}"

        chunk.global_key = global_key
        chunks.append(chunk)
    mm.apply_multi_lora(chunks, N, 8, 1.0, row_init_method="normal")
    for chunk in chunks:
        chunk.load_state_dict({k: full[chunk.global_key(k)] if torch.is_tensor(v) else v
                               for k, v in chunk.state_dict().items()})
    return chunks


@pytest.mark.parametrize("pp, vpp", [(2, 1), pytest.param(4, 2, marks=pytest.mark.world(4))],
                         ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe_aux_loss"])
def test_pipeline_step_matches_a_plain_loop(layout, cfg, pp, vpp):
    cfg = dataclasses.replace(cfg, num_layers=max(4, pp * vpp))
    # megatron's process-wide aux-loss logging tracker is sized by the first MoE model's
    # layer count (its clear_aux_losses_tracker only zeroes it).
    get_moe_layer_wise_logging_tracker().clear()
    layout()  # DP=2 here: the reference below runs no collective
    ref = build(cfg)
    full = {k: v.clone() for k, v in ref.state_dict().items() if torch.is_tensor(v)}
    plain_mbs = pack_micro_batches(slot_examples(), BUDGET, 1, PAD)
    want_losses, want_grads = reference(ref, plain_mbs, sum(mb.loss_tokens_per_slot()
                                                              for mb in plain_mbs))
    want = {k: p.grad.clone() for k, p in ref.named_parameters() if p.requires_grad}
    want_norms = [torch.stack([g.norm() for g in want_grads[s]]).norm() for s in range(N)]
    want_eval = evaluation.eval_losses(ref, slot_examples(), BUDGET, 1, PAD)
    want_gen = evaluation.greedy_generate(ref, prompts(), N, 4, -1, 1, PAD, kv_cache=False)
    mm.destroy_parallel()

    activate_cpu_support()
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        distributed_timeout_minutes=max(1, int(TIMEOUT_S // 60)),
        create_gloo_process_groups=False)  # as init_parallel does
    model_parallel_cuda_manual_seed(0)
    model = chunk_models(cfg, pp, vpp, full)
    step = SlotTrainStep(model, N, BUDGET, 1, PAD)
    # The filler in the middle: the micro-batch after it must train normally again.
    mbs = equalize_micro_batches(plain_mbs[:1] + [step.filler] + plain_mbs[1:], step.filler,
                                 micro_batch_multiple(model))
    failures: list[str] = []
    if len({mb.tokens.size(1) for mb in mbs}) != 1 or len({mb.tokens.size(1) for mb in plain_mbs}) == 1:
        failures.append("the micro-batches must differ in length, and be padded to one under PP")
    if len(mbs) % (pp if vpp > 1 else 1):  # interleaving runs groups of PP micro-batches
        failures.append(f"{len(mbs)} micro-batches for vpp={vpp}")
    step.grad_sync.zero_grad(range(N))
    losses = step.losses(mbs, global_loss_tokens(mbs, N))
    step.grad_sync.sync(range(N))
    compare(failures, losses, want_losses, 1e-6, "per-slot losses")
    compared = 0
    for chunk in model:
        for key, p in chunk.named_parameters():
            if p.requires_grad:
                compare(failures, p.main_grad, want[chunk.global_key(key)], 1e-5, f"gradient {key}")
                compared += 1
    if compared != len(want) // pp:  # an equal share of the layers on each rank
        failures.append(f"{compared} adapter parameters on this rank, of {len(want)}")
    for s in range(N):
        compare(failures, torch.tensor(slot_grad_norm(mm.slot_parameters(model, s))),
                want_norms[s], 1e-5, f"slot {s} gradient norm")
    compare(failures, evaluation.eval_losses(model, slot_examples(), BUDGET, 1, PAD), want_eval,
            1e-5, "eval losses")
    got_gen = evaluation.greedy_generate(model, prompts(), N, 4, -1, 1, PAD)
    if got_gen != want_gen:
        failures.append(f"generations {got_gen} != {want_gen}")
    assert_all_ranks(failures)
