"""PEFT export from TP=2 and EP=2 layouts: the same files as from one process, and peft's
logits equal the sharded Megatron model's with the slot active."""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import megatron_multilora as mm
from megatron_multilora.checkpoint.peft_format import export_peft
from megatron_multilora.layers.slot_tensors import get_slot_tensors, set_slot_tensors
from megatron_multilora.models.hf_import import load_hf_model
from tests.distributed.conftest import assert_all_ranks
from tests.hf_models import hf_logits, make_hf_model, megatron_logits, token_batch
from tests.unit.test_peft_interop import TOL, trained_like_slot


@pytest.mark.parametrize(
    "model_type,tp,ep",
    [
        ("llama", 2, 1),
        ("qwen3_moe", 1, 2),
        ("qwen2", 2, 1),
        ("gemma3_text", 2, 1),
        ("gpt_oss", 1, 2),
        ("gpt_oss", 2, 1),
    ],
)
def test_export_from_a_sharded_layout(layout, tmp_path, model_type, tp, ep):
    import peft

    layout(tp=1)
    folder = [str(tmp_path)]
    dist.broadcast_object_list(folder, src=0)  # one folder for all ranks
    root = folder[0]
    if dist.get_rank() == 0:
        make_hf_model(model_type).save_pretrained(f"{root}/base")
    dist.barrier()
    model, cfg = load_hf_model(f"{root}/base")
    mm.apply_multi_lora(model, 3, 8, 1.0)
    trained_like_slot(model, 1)
    full = get_slot_tensors(model, 1)
    export_peft(model, 1, f"{root}/one", cfg, model_type, f"{root}/base")
    mm.destroy_parallel()

    layout(tp=tp, ep=ep)
    model, cfg = load_hf_model(f"{root}/base")
    mm.apply_multi_lora(model, 3, 8, 1.0)
    set_slot_tensors(model, 1, full, rank=4, alpha=6.0)
    ids = token_batch()
    mm.set_tokens_per_adapter_slot(model, [0, ids.numel(), 0])
    want = megatron_logits(model, ids)
    export_peft(model, 1, f"{root}/sharded", cfg, model_type, f"{root}/base")
    one = load_file(f"{root}/one/adapter_model.safetensors")
    sharded = load_file(f"{root}/sharded/adapter_model.safetensors")
    failures = []
    if one.keys() != sharded.keys() or any(not torch.equal(one[k], sharded[k]) for k in one):
        failures.append("the export depends on the layout")
    got = hf_logits(
        peft.PeftModel.from_pretrained(make_hf_model(model_type), f"{root}/sharded").eval(), ids
    )
    if (got - want).abs().max() > TOL:
        failures.append(f"peft logits differ by {(got - want).abs().max():.2e}")
    assert_all_ranks(failures)
