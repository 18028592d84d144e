"""What the sections time, built with the package's own builders: the GPT with adapter slots
(``build_gpt_model``, ``apply_multi_lora``), random examples packed as the trainer packs them,
and its training step (``SlotStep``) over jobs started by ``start_job``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_multilora as mm
from benchmarks.settings import REPO, Settings
from megatron_multilora.data.datasets import Example
from megatron_multilora.training.checks import validate
from megatron_multilora.training.config import AdapterJob, RunConfig, load_run_config
from megatron_multilora.training.runtime import start_job
from megatron_multilora.training.step.micro_batches import MicroBatch, pack_micro_batches
from megatron_multilora.training.step.schedule import per_slot_losses
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer
from megatron_multilora.training.step.slot_step import SlotStep


def layer_config(s: Settings) -> TransformerConfig:
    return TransformerConfig(
        num_layers=1,
        hidden_size=s.layer_hidden,
        num_attention_heads=1,
        params_dtype=s.torch_dtype,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bf16=s.dtype == "bf16",
    )


def fwd_bwd(
    fn: Callable[[], object],
    leaves: list[torch.Tensor],
    grad: torch.Tensor,
    params: list[torch.nn.Parameter],
) -> Callable[[], None]:
    """One layer step: clear gradients, forward, backward with a fixed output gradient."""

    def step() -> None:
        for t in leaves + params:
            t.grad = None
        out = fn()
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    return step


def model_config(kind: str, s: Settings) -> mm.GPTModelConfig:
    """conf/model/tiny_{kind}.yaml with hidden size and depth from the settings (FFN widths
    scaled with the hidden size)."""
    from omegaconf import OmegaConf

    fields = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"tiny_{kind}.yaml"))
    scale = s.model_hidden / fields["hidden_size"]
    for key in ("ffn_hidden_size", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if fields.get(key):
            fields[key] = int(fields[key] * scale)
    fields.update(hidden_size=s.model_hidden, num_layers=s.model_layers)
    return mm.GPTModelConfig(**fields)


def build_model(
    cfg: mm.GPTModelConfig,
    s: Settings,
    slots: int | None,
    sequence_parallel: bool = False,
    fully_sharded: bool = False,
) -> torch.nn.Module:
    """The GPT with ``slots`` adapter slots (recipe defaults: A xavier, B zero), or the frozen
    base alone when ``slots`` is None. Same base weights on every call."""
    torch.manual_seed(0)
    model = mm.build_gpt_model(
        cfg,
        sequence_parallel=sequence_parallel,
        params_dtype=s.torch_dtype,
        calculate_per_token_loss=True,
    )  # as the recipe's
    if slots is not None:
        kwargs = {"fully_sharded": True} if fully_sharded else {}
        return mm.apply_multi_lora(model, slots, s.rank, s.alpha, seed=0, **kwargs)
    model.requires_grad_(False)
    # Backward must still run through the frozen layers (as it does to reach the adapters):
    # the embedding output requires grad, so every layer's input gradient is computed.
    model.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_())
    return model


def random_examples(count: int, length: int, vocab: int, gen: torch.Generator) -> list[Example]:
    """Examples of ``length`` random tokens, the second half counting in the loss
    (a prompt and its completion)."""
    out = []
    for _ in range(count):
        tokens = tuple(torch.randint(0, vocab, (length,), generator=gen).tolist())
        out.append(Example(tokens, tuple(i >= length // 2 for i in range(length - 1))))
    return out


def pack_one(
    slot_examples: list[list[Example]], device: torch.device, pad_multiple: int = 1
) -> MicroBatch:
    """All examples in one adapter-major micro-batch, on the device."""
    (mb,) = pack_micro_batches(
        slot_examples, one_batch_budget(slot_examples, pad_multiple), pad_multiple
    )
    return mb.to(device)


def one_batch_budget(slot_examples: list[list[Example]], pad_multiple: int = 1) -> int:
    """A token budget that packs all of ``slot_examples`` into one micro-batch."""
    return sum(len(ex.tokens) - 1 for exs in slot_examples for ex in exs) + pad_multiple


def slot_and_single_examples(
    s: Settings, vocab: int
) -> tuple[list[list[Example]], list[list[Example]]]:
    """The same examples for N slots (``examples_per_slot`` each) and all in one slot."""
    gen = torch.Generator().manual_seed(0)
    per_slot = [
        random_examples(s.examples_per_slot, s.example_tokens, vocab, gen) for _ in range(s.slots)
    ]
    return per_slot, [[ex for exs in per_slot for ex in exs]]


def slot_and_single_batches(
    s: Settings, vocab: int, device: torch.device, pad_multiple: int = 1
) -> tuple[MicroBatch, MicroBatch]:
    """The same tokens packed for N slots (``examples_per_slot`` each) and for one slot."""
    per_slot, single = slot_and_single_examples(s, vocab)
    return pack_one(per_slot, device, pad_multiple), pack_one(single, device, pad_multiple)


def model_step(model: torch.nn.Module, mb: MicroBatch) -> None:
    """Forward+backward of one packed micro-batch through the recipe's schedule, each
    adapter's loss normalised by its own loss tokens."""
    per_slot_losses([model], [mb], mb.loss_units_per_slot())


@dataclasses.dataclass
class TimedModelStep:
    """What a model row times: gradients reset, then :func:`model_step` on ``mb`` (the model
    and micro-batch kept for variants of the same work, e.g. under CUDA graphs)."""

    model: torch.nn.Module
    mb: MicroBatch

    def __call__(self) -> None:
        self.model.zero_grad(set_to_none=True)
        model_step(self.model, self.mb)


def timed_model_step(model: torch.nn.Module, mb: MicroBatch) -> TimedModelStep:
    return TimedModelStep(model, mb)


def make_job(j: int, s: Settings) -> AdapterJob:
    return AdapterJob(
        name=f"job{j}",
        dataset="(random tokens)",
        rank=s.rank,
        alpha=s.alpha,
        lr=1e-4,
        schedule="constant",
        max_steps=s.job_steps,
    )


Packed = tuple[list[list[Example]], list[MicroBatch]]  # one step's examples, micro-batches


def start_jobs(
    model: torch.nn.Module, s: Settings, cfg: mm.GPTModelConfig, steps: int, slots: int
) -> dict[int, SlotOptimizer]:
    """Job j of :func:`make_job` in slot j, as the trainer starts a job: its optimizer by slot."""
    return {j: start_job(model, j, make_job(j, s), steps, cfg) for j in range(slots)}


def training_step(
    model: torch.nn.Module,
    slots: int,
    batches: list[list[list[Example]]],
    device: torch.device,
    cuda_graphs: bool = False,
) -> tuple[SlotStep, list[Packed]]:
    """The recipe's step for ``model`` and each step's (examples, micro-batches), packed
    beforehand (as a data loader would: only training is timed; on the device, or on the host
    under CUDA graphs, which copy each micro-batch in as one tensor)."""
    budget = max(one_batch_budget(examples) for examples in batches)
    train = SlotStep([model], slots, budget, pad_multiple=1, pad_id=0, cuda_graphs=cuda_graphs)
    place = torch.device("cpu") if cuda_graphs else device
    return train, [
        (examples, [mb.to(place) for mb in train.batcher.ready(examples)]) for examples in batches
    ]


def recipe_run(
    overrides: list[str], check_files: bool = True, config_name: str = "config"
) -> RunConfig:
    """The run the recipe trains with ``--config-name config_name`` and ``overrides``: conf/
    composed by Hydra, then checked as the recipe checks it (``check_files``: its datasets too;
    its run_dir is never written)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        run = load_run_config(compose(config_name, overrides=overrides))
    validate(run, check_files)
    return run
