"""DPO and GRPO against TRL's own loss computations (TRL 1.16: ``DPOTrainer._compute_loss``
and ``GRPOTrainer._compute_loss``, each on its own forward of our adapter exported to PEFT
and loaded under transformers + peft): the same loss and the same gradient of every adapter
factor, on the same batch."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora.checkpoint.peft_format import export_peft
from megatron_multilora.data.datasets import Example, tokenize_pair
from megatron_multilora.data.tokenizer import HFTokenizer
from megatron_multilora.layers.lifecycle import slot_parameters
from megatron_multilora.models.hf_import import load_hf_model
from megatron_multilora.models.tiny_hf import byte_level_tokenizer, write_tiny_llama
from megatron_multilora.training.objectives.dpo import DPO, with_nll_scale, with_references
from megatron_multilora.training.objectives.grpo import GRPO
from megatron_multilora.training.objectives.rollouts import advantages
from megatron_multilora.training.objectives.simpo import SimPO, marked
from megatron_multilora.training.step.grad_sync import SlotGradSync
from megatron_multilora.training.step.micro_batches import MicroBatcher
from megatron_multilora.training.step.objective_tools import StepTools
from megatron_multilora.training.step.reference import target_logprobs
from megatron_multilora.training.step.schedule import per_slot_results
from megatron_multilora.training.step.slot_adamw import SlotAdamW

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

SLOT, RANK, ALPHA = 1, 4, 8.0
# Row-parallel targets only: each of our factors is one PEFT factor (o_proj, down_proj), so
# gradients compare tensor by tensor.
TARGETS = ["linear_proj", "linear_fc2"]
REL = 1e-5

PAIRS = [
    {"prompt": "abc=", "chosen": "cba", "rejected": "abc"},
    {"prompt": "hello=", "chosen": "olleh", "rejected": "hello there"},
    {"prompt": "xy=", "chosen": "yx", "rejected": "x"},
]


@pytest.fixture()
def setup(tmp_path: Path):
    base = write_tiny_llama(tmp_path / "base", hidden_size=64, num_layers=2, seed=3)
    mm.init_parallel()
    model, cfg = load_hf_model(str(base))
    model.config.calculate_per_token_loss = True
    mm.apply_multi_lora(model, 2, RANK, ALPHA, target_modules=TARGETS)
    mm.init_adapter_slot(model, SLOT, RANK, ALPHA)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # an adapter that has trained a little: both factors non-zero
        for layer in mm.multi_lora_modules(model):
            for factor in (layer.adapters[SLOT].linear_in, layer.adapters[SLOT].linear_out):
                factor.weight.copy_(0.1 * torch.randn(factor.weight.shape, generator=gen))
            layer.adapters.mask_rank(SLOT)
    export_peft(model, SLOT, tmp_path / "peft", cfg, "llama", str(base))
    yield model, cfg, base, tmp_path
    mm.destroy_parallel()
    mm.init_parallel(seed=1234)  # the unit tests' world of one, as conftest made it


def peft_model(base: Path, folder: Path):
    import peft
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(str(base), torch_dtype=torch.float32)
    return peft.PeftModel.from_pretrained(hf, str(folder), is_trainable=True).eval()


def ours(model, cfg, examples_of_slot: list, objective) -> tuple[float, dict[str, torch.Tensor]]:
    """Our loss of the slot's examples by ``objective`` and the slot's gradients, in PEFT's
    names and layout (exported the way the adapter is)."""
    sync = SlotGradSync(SlotAdamW.of([model]).rows)
    sync.zero_grad([SLOT])
    batcher = MicroBatcher(model, 2, 4096, 1, 0)
    slot_examples = [[], examples_of_slot]
    mbs = batcher.ready(slot_examples)
    units = sum(mb.loss_units_per_slot() for mb in mbs)
    loss = float(per_slot_results(model, mbs, units, objectives=[None, objective])[SLOT, 0])
    return loss, _as_peft(model, cfg)


def _as_peft(model, cfg) -> dict[str, torch.Tensor]:
    """Our slot's factors' gradients, exported through a scratch slot as PEFT tensors."""
    import tempfile

    from safetensors.torch import load_file

    params = slot_parameters(model, SLOT)
    grads = [p.main_grad.clone() for p in params]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.copy_(g)
    with tempfile.TemporaryDirectory() as tmp:
        export_peft(model, SLOT, Path(tmp) / "g", cfg, "llama", "")
        tensors = load_file(str(Path(tmp) / "g" / "adapter_model.safetensors"))
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    return tensors


def peft_grads(wrapped) -> dict[str, torch.Tensor]:
    return {
        name.replace(".default", ""): p.grad.detach().clone()
        for name, p in wrapped.named_parameters()
        if "lora_" in name and ".default." in name
    }


def close(ours_grads: dict, theirs: dict) -> float:
    """The largest relative difference (by norm) over the factors; also checks names."""
    assert sorted(ours_grads) == sorted(theirs)
    worst = 0.0
    for name, g in ours_grads.items():
        assert g.norm() > 0, f"{name}: no gradient"
        worst = max(worst, float((g - theirs[name]).norm() / theirs[name].norm()))
    return worst


def padded(rows: list[list[int]], left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        at = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, at], mask[i, at] = torch.tensor(r), 1
    return ids, mask


# TRL 1.16's sigmoid loss has no label smoothing (test_objectives.py checks ours by hand).
@pytest.mark.parametrize(
    "loss_type,rpo_alpha",
    [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.7)],
    ids=["sigmoid", "ipo", "rpo"],
)
def test_dpo_matches_trl(setup, loss_type, rpo_alpha):
    """``rpo``: DPO plus the chosen answers' NLL (TRL's ``loss_type=["sigmoid", "sft"]``
    with ``loss_weights=[1, rpo_alpha]``, the token mean over the batch's chosen answers)."""
    model, cfg, base, tmp = setup
    beta = 0.5
    tok = HFTokenizer(byte_level_tokenizer())
    pairs = [tokenize_pair(r, tok, 64) for r in PAIRS]
    tools = StepTools(model, MicroBatcher(model, 2, 4096, 1, 0), tok, 0, 64, lambda *a: None)
    pairs = with_nll_scale(with_references(pairs, SLOT, tools), rpo_alpha)
    loss, grads = ours(model, cfg, pairs, DPO(beta, loss_type, 0.0, rpo_alpha))

    from trl import DPOConfig, DPOTrainer

    wrapped = peft_model(base, tmp / "peft")
    trainer = DPOTrainer(
        model=wrapped,
        args=DPOConfig(
            output_dir=str(tmp / "trl"),
            beta=beta,
            loss_type=[loss_type, "sft"] if rpo_alpha else [loss_type],
            loss_weights=[1.0, rpo_alpha] if rpo_alpha else None,
            report_to=[],
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=len(PAIRS),
        ),
        train_dataset=datasets.Dataset.from_list(PAIRS),
        processing_class=byte_level_tokenizer(),
    )
    # TRL keeps a copy of an adapter it is given as the reference ("ref"); ours is the base
    # (the adapter off), TRL's reference for a new adapter: drop the copy.
    assert "ref" in wrapped.peft_config
    wrapped.delete_adapter("ref")
    wrapped.set_adapter("default")
    rows = [list(c.tokens) for c, _ in pairs] + [list(r.tokens) for _, r in pairs]
    masks = [(0,) + c.loss_mask for c, _ in pairs] + [(0,) + r.loss_mask for _, r in pairs]
    ids, attention = padded(rows)
    completion = torch.zeros_like(ids)
    for i, m in enumerate(masks):
        completion[i, : len(m)] = torch.tensor(m)
    theirs = trainer._compute_loss(
        wrapped,
        {"input_ids": ids, "attention_mask": attention, "completion_mask": completion},
        False,
    )
    theirs.backward()
    assert loss == pytest.approx(float(theirs), rel=REL)
    assert close(grads, peft_grads(wrapped)) <= REL


@pytest.mark.parametrize(
    "aggregation,loss_type,kl", [("token_mean", "bnpo", 0.0), ("sequence_mean", "grpo", 0.05)]
)
def test_grpo_matches_trl(setup, aggregation, loss_type, kl):
    model, cfg, base, tmp = setup
    tok = HFTokenizer(byte_level_tokenizer())
    G = 4
    prompts = [[tok.bos_id] + tok.encode(p) for p in ("ab=", "hello=")]
    completions = [tok.encode(c) for c in ("ba", "ab", "b", "xyz", "olleh", "hel", "o", "lo")]
    completions = [c + [tok.eos_id] if i % 3 else c for i, c in enumerate(completions)]
    rewards = [1.0, 0.0, 0.5, 0.0, 1.0, 0.2, 0.0, 0.3]
    adv = advantages(rewards, G, scale=True)
    rows = [(prompts[i // G], c) for i, c in enumerate(completions)]
    plain = [Example(tuple(p + c), (False,) * (len(p) - 1) + (True,) * len(c)) for p, c in rows]
    batcher = MicroBatcher(model, 2, 4096, 1, 0)
    now = target_logprobs(model, [[], plain], batcher, adapters=True)[SLOT]
    ref = target_logprobs(model, [[], plain], batcher)[SLOT]
    noise = torch.Generator().manual_seed(1)
    examples, old_rows = [], []
    for (p, c), e, lp, rp, a in zip(rows, plain, now, ref, adv):
        head = len(p) - 1
        # sampled log-probs off the current ones, so ratios differ from 1 and some clip
        old = [v + 0.3 * float(torch.randn((), generator=noise)) for v in lp[head:]]
        old_rows.append(old)
        n = len(c)
        examples.append(
            dataclasses.replace(
                e,
                values={
                    "logprobs": (0.0,) * head + tuple(old),
                    "advantages": (0.0,) * head + (a,) * n,
                    "weights": (0.0,) * head
                    + (1.0 if aggregation == "token_mean" else 1.0 / n,) * n,
                    "ref_logprobs": tuple(rp),
                },
                units=None if aggregation == "token_mean" else 1,
            )
        )
    loss, grads = ours(model, cfg, examples, GRPO(0.2, 0.28, kl))

    from trl import GRPOConfig, GRPOTrainer

    wrapped = peft_model(base, tmp / "peft")
    trainer = GRPOTrainer(
        model=wrapped,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(
            output_dir=str(tmp / "trl"),
            beta=kl,
            epsilon=0.2,
            epsilon_high=0.28,
            loss_type=loss_type,
            num_generations=G,
            per_device_train_batch_size=G,
            report_to=[],
            use_cpu=True,
            temperature=1.0,
            bf16=False,
        ),
        train_dataset=datasets.Dataset.from_list([{"prompt": "ab="}] * G),
        processing_class=byte_level_tokenizer(),
    )
    prompt_ids, prompt_mask = padded([p for p, _ in rows], left=True)
    completion_ids, completion_mask = padded([c for _, c in rows])
    width = completion_ids.size(1)
    old = torch.zeros(len(rows), width)
    for i, o in enumerate(old_rows):
        old[i, : len(o)] = torch.tensor(o)
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(adv, dtype=torch.float32),
        "old_per_token_logps": old,
    }
    if kl:
        with torch.no_grad(), wrapped.disable_adapter():  # TRL's reference: the adapter off
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                wrapped,
                torch.cat([prompt_ids, completion_ids], 1),
                torch.cat([prompt_mask, completion_mask], 1),
                width,
            )[0]
    theirs = trainer._compute_loss(wrapped, inputs)
    theirs.backward()
    assert loss == pytest.approx(float(theirs), rel=REL)
    assert close(grads, peft_grads(wrapped)) <= REL


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_simpo_matches_trl(setup, label_smoothing):
    """SimPO against TRL's ``CPOTrainer.cpo_loss`` with ``loss_type="simpo"`` (its pure
    SimPO loss, cpo_alpha 0) on each answer's mean log-prob from transformers + peft's own
    forward of our exported adapter."""
    model, cfg, base, tmp = setup
    beta, gamma = 2.0, 0.8
    tok = HFTokenizer(byte_level_tokenizer())
    pairs = marked([tokenize_pair(r, tok, 64) for r in PAIRS])
    loss, grads = ours(model, cfg, pairs, SimPO(beta, gamma, label_smoothing))

    from trl.experimental.cpo import CPOTrainer

    wrapped = peft_model(base, tmp / "peft")

    def mean_logprob(example: Example) -> torch.Tensor:
        ids = torch.tensor([example.tokens])
        logprobs = wrapped(input_ids=ids).logits[0, :-1].log_softmax(-1)
        per_token = logprobs.gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(example.loss_mask, dtype=torch.float32)
        return (per_token * mask).sum() / mask.sum()

    chosen = torch.stack([mean_logprob(c) for c, _ in pairs])
    rejected = torch.stack([mean_logprob(r) for _, r in pairs])
    settings = type(
        "Settings",
        (),
        dict(
            alpha=0.0,
            beta=beta,
            simpo_gamma=gamma,
            label_smoothing=label_smoothing,
            loss_type="simpo",
            accelerator=type("A", (), {"device": "cpu"}),
        ),
    )
    losses, _, _ = CPOTrainer.cpo_loss(settings, chosen, rejected)
    theirs = losses.mean()
    theirs.backward()
    assert loss == pytest.approx(float(theirs), rel=REL)
    assert close(grads, peft_grads(wrapped)) <= REL
