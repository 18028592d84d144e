"""``get_slot_tensors`` / ``set_slot_tensors``: full per-slot tensors, whatever the layout.

A MoE GPT with attention, gated shared experts and gated grouped experts wrapped, under
TP=2 (+SP: column- and row-parallel factors, fc1's per-rank [gate; up]) and EP=2 (expert
chunks), against the same model at TP=1/EP=1.
"""

import pytest
import torch

import megatron_multilora as mm
from tests.distributed.conftest import assert_all_ranks
from tests.distributed.harness import SEQ, N, build, micro_batch
from tests.distributed.test_moe_parallel import moe_cfg


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)], ids=["tp2_sp", "ep2"])
def test_full_slot_tensors_equal_one_process_and_load_into_any_slot(layout, tp, ep):
    cfg = moe_cfg("alltoall")
    layout(tp=1)
    full = [mm.get_slot_tensors(build(cfg, ddp=False), i) for i in range(N)]
    mm.destroy_parallel()

    layout(tp=tp, ep=ep, sp=tp > 1)
    model = build(cfg, sp=tp > 1, ddp=False)
    failures: list[str] = []
    if not any(".experts.linear_fc1." in k for k in full[0]) or not any(
        ".shared_experts.linear_fc1." in k for k in full[0]
    ):
        failures.append("the model must adapt grouped and gated dense linears")
    for i in range(N):
        got = mm.get_slot_tensors(model, i)
        failures += [f"slot {i} {k}" for k, v in full[i].items() if not torch.equal(got[k], v)]

    # Slot 1's adapter (rank 3, alpha 4) into slot 2: same tensors back, same outputs.
    mm.set_slot_tensors(model, 2, full[1], rank=3, alpha=4.0)
    back = mm.get_slot_tensors(model, 2)
    failures += [f"round trip {k}" for k, v in full[1].items() if not torch.equal(back[k], v)]
    ids, labels, _ = micro_batch(3, [SEQ], cfg.vocab_size)
    outputs = []
    with torch.no_grad():
        for counts in ([0, SEQ, 0, 0], [0, 0, SEQ, 0]):
            mm.set_tokens_per_adapter_slot(model, counts)
            outputs.append(model(ids, torch.arange(SEQ)[None], None, labels=labels))
    if not torch.equal(*outputs):
        failures.append("slot 2 holding slot 1's tensors gives other losses than slot 1")

    # Bad input changes nothing.
    before = mm.get_slot_tensors(model, 3)
    bad = {k: v[..., :2, :] if k.endswith("linear_in.weight") else v for k, v in full[1].items()}
    for tensors, rank, match in ((bad, 3, "does not fit"), (full[1], 99, "rank=99")):
        try:
            mm.set_slot_tensors(model, 3, tensors, rank=rank, alpha=1.0)
            failures.append(f"no error for {match}")
        except ValueError as err:
            if match not in str(err):
                failures.append(f"error {err} does not say {match!r}")
    after = mm.get_slot_tensors(model, 3)
    failures += [
        f"changed by a refused load: {k}" for k in before if not torch.equal(before[k], after[k])
    ]
    assert_all_ranks(failures)
