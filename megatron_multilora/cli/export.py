"""``mmlora export``: an adapter as a Hugging Face PEFT LoRA folder (peft and vLLM load it).

    mmlora export runs/demo/adapters/reverse out/reverse-peft
    mmlora export runs/demo/checkpoints/step_00000100 out/rev --job reverse

SOURCE is an adapter folder the trainer exported (``adapter_config.json`` +
``adapter.safetensors``), or a training checkpoint plus ``--job`` for a job that was still
training when it was saved. Either records the base model's resolved architecture (an
``hf_dir`` run's is its config.json's), the HF model type and the job's dropout. No model is
built: the tensors are already full and layout-independent.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_multilora.checkpoint.prompt_format import load_hint
from megatron_multilora.cli.command import CommandError, Commands


def export(args: argparse.Namespace) -> int:
    # Imported here: the serve commands stay torch-free.
    from megatron_multilora.checkpoint.adapter_files import read_adapter
    from megatron_multilora.checkpoint.adapter_folders import FolderFormat, folder_format
    from megatron_multilora.checkpoint.peft_format import peft_config, to_peft_tensors, write_peft
    from megatron_multilora.models.gpt_config import GPTModelConfig
    from megatron_multilora.training.checkpoints import CheckpointError, checkpoint_adapter

    try:
        kind = folder_format(args.source)
        if kind is FolderFormat.TRAINING_CHECKPOINT:
            if not args.job:
                raise CommandError(
                    f"{args.source} is a training checkpoint: name the adapter with --job"
                )
            tensors, meta = checkpoint_adapter(args.source, args.job)
        else:
            meta, tensors = read_adapter(args.source)
    except (CheckpointError, OSError, ValueError) as err:
        raise CommandError(str(err)) from None
    model_type = args.model_type or meta.get("hf_model_type", "llama")
    base = args.base_model if args.base_model is not None else meta.get("hf_dir", "")
    rank, alpha, dropout = meta["rank"], meta["alpha"], meta.get("dropout", 0.0)
    try:
        peft, targets = to_peft_tensors(tensors, GPTModelConfig(**meta["base_model"]), model_type)
        write_peft(
            args.out,
            peft,
            peft_config(rank, alpha, dropout, targets, base),
            overwrite=args.overwrite,
        )
    except FileExistsError as err:
        raise CommandError(f"{err} (use --overwrite)") from None
    except ValueError as err:
        raise CommandError(f"{args.source}: {err}") from None
    print(
        f"wrote {args.out}: r={rank}, lora_alpha={alpha}, {len(peft)} tensors, targets "
        f"{', '.join(targets)}"
    )
    print(load_hint(base or "BASE", str(args.out)))
    return 0


def add_commands(commands: Commands) -> None:
    sub = commands.add("export", export, "write an adapter as a Hugging Face PEFT folder")
    sub.add_argument("source", type=Path, help="an adapter folder, or a training checkpoint")
    sub.add_argument("out", type=Path, help="the PEFT folder to write")
    sub.add_argument("--job", help="with a training checkpoint: which job's adapter")
    sub.add_argument(
        "--model-type",
        default=None,
        help="Hugging Face model_type naming the modules (llama, qwen2, qwen3, "
        "mixtral, qwen3_moe, olmoe, qwen2_moe); default: the adapter's "
        "recorded one, else llama",
    )
    sub.add_argument(
        "--base-model",
        default=None,
        help="base_model_name_or_path to record (default: the adapter's recorded hf_dir)",
    )
    sub.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
