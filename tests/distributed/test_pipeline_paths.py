"""Adapters under pipeline parallelism (PP=2, also with two virtual stages per rank) are named
by global layer numbers: keys and init seeds match the one-stage model's for the same layer,
and ``get_slot_tensors``/``set_slot_tensors`` work on the whole model's dict on every stage.
"""

import pytest
import torch
import torch.distributed as dist

import megatron_multilora as mm
from megatron_multilora.layers.lifecycle import named_multi_lora_modules
from megatron_multilora.models.gpt import build_model_chunks
from tests.distributed.conftest import assert_all_ranks
from tests.distributed.harness import ALPHAS, DIM, RANKS, N

CFG = mm.GPTModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=48,
    vocab_size=64,
    num_moe_experts=4,
    moe_shared_expert_intermediate_size=16,
)
SEED = 1234


def adapted(model):
    """Default-seeded adapters, as a recipe applies them after ``init_parallel``."""
    torch.manual_seed(SEED)
    mm.apply_multi_lora(model, N, DIM, 1.0, row_init_method="normal")
    for i, (r, a) in enumerate(zip(RANKS, ALPHAS)):
        mm.init_adapter_slot(model, i, r, a)
    return model


def random_full(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {k: torch.randn(v.shape, generator=gen) for k, v in sorted(like.items())}


@pytest.mark.parametrize("vpp", [None, 2], ids=["pp2", "pp2_vpp2"])
def test_pipeline_stages_use_global_layer_paths(layout, vpp):
    layout(tp=1)
    one = adapted(mm.build_gpt_model(CFG))
    # Cloned: on one process the tensors can be views of the parameters.
    want_slots = [{k: v.clone() for k, v in mm.get_slot_tensors(one, i).items()} for i in range(N)]
    want_state = mm.adapter_state_dict(one, 0)
    want_names = {p: m.full_name for p, m in named_multi_lora_modules(one)}
    mm.set_slot_tensors(one, 3, random_full(want_slots[3]), rank=RANKS[3], alpha=ALPHAS[3])
    want_loaded = mm.adapter_state_dict(one, 3)
    mm.destroy_parallel()

    layout(pp=2, vpp=vpp)
    chunks = adapted(build_model_chunks(CFG))
    failures: list[str] = []

    names = {p: m.full_name for p, m in named_multi_lora_modules(chunks)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(names))
    if set(every[0]) & set(every[1]) or set(every[0]) | set(every[1]) != set(want_names):
        failures.append(f"stage paths {every} are not a split of {sorted(want_names)}")
    failures += [f"{p}: full_name {n}" for p, n in names.items() if n != want_names[p]]
    if vpp and not any(".layers.2." in p for p in every[0]):
        failures.append("the first stage's second virtual chunk must hold global layer 2")

    # Initialisation equals the one-stage model's layer by layer, under the same keys.
    state = mm.adapter_state_dict(chunks, 0)
    failures += [f"init {k}" for k, v in state.items() if not torch.equal(v, want_state[k])]
    if not state or not set(state) < set(want_state):
        failures.append(f"adapter_state_dict keys {sorted(state)[:3]} are not global")
    for i in range(N):
        got = mm.get_slot_tensors(chunks, i)  # every stage gets the whole model's dict
        if got.keys() != want_slots[i].keys():
            failures.append(f"slot {i} keys differ")
        else:
            failures += [
                f"slot {i} {k}" for k, v in want_slots[i].items() if not torch.equal(got[k], v)
            ]

    # A whole-model dict loads each stage's layers as the one-stage model loaded them.
    full = random_full(want_slots[3])
    mm.set_slot_tensors(chunks, 3, full, rank=RANKS[3], alpha=ALPHAS[3])
    loaded = mm.adapter_state_dict(chunks, 3)
    failures += [f"loaded {k}" for k, v in loaded.items() if not torch.equal(v, want_loaded[k])]
    back = mm.get_slot_tensors(chunks, 3)
    failures += [f"round trip {k}" for k in full if not torch.equal(back[k], full[k])]

    # Refusals are agreed by every stage, and change nothing: a key only the other stage
    # holds is missing, a shape only the last stage's layers refuse.
    last = max(full, key=lambda k: int(k.split(".")[2]))
    for bad, error, match in (
        ({k: v for k, v in full.items() if k != last}, KeyError, "missing"),
        ({**full, last: torch.zeros(1, 1)}, ValueError, "does not fit"),
        (
            {**full, "decoder.layers.9.x.adapter.linear_in.weight": full[last]},
            KeyError,
            "unexpected",
        ),
    ):
        try:
            mm.set_slot_tensors(chunks, 2, bad, rank=RANKS[3], alpha=ALPHAS[3])
            failures.append(f"no {error.__name__} for {match}")
        except error as err:
            if match not in str(err):
                failures.append(f"{error.__name__} {err} does not say {match!r}")
    if mm.get_slot_tensors(chunks, 2).keys() != want_slots[2].keys() or any(
        not torch.equal(v, want_slots[2][k]) for k, v in mm.get_slot_tensors(chunks, 2).items()
    ):
        failures.append("a refused load changed slot 2")
    assert_all_ranks(failures)
