"""Export an adapter to a Hugging Face PEFT LoRA folder, from a trainer output.

    python scripts/export_peft.py runs/demo/adapters/reverse out/reverse-peft
    python scripts/export_peft.py runs/demo/checkpoints/step_00000100 out/rev --job reverse

SOURCE is an adapter folder the trainer exported (``adapter_config.json`` +
``adapter.safetensors``), or a training checkpoint plus ``--job`` for a job that was still
training when it was saved. Either records the base model's resolved architecture (an
``hf_dir`` run's is its config.json's), the HF model type and the job's dropout. No model is
built: the tensors are already full and layout-independent.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from safetensors.torch import load_file

from megatron_multilora.checkpoint.adapter_files import read_adapter
from megatron_multilora.checkpoint.adapter_folders import FolderFormat, folder_format
from megatron_multilora.checkpoint.peft_format import peft_config, to_peft_tensors, write_peft
from megatron_multilora.models.gpt_config import GPTModelConfig


def from_adapter_folder(folder: Path):
    config, tensors = read_adapter(folder)
    cfg = GPTModelConfig(**config["base_model"])
    return tensors, cfg, config["rank"], config["alpha"], config.get("dropout", 0.0), config


def from_checkpoint(folder: Path, job: str):
    from megatron_multilora.training.checkpoints import (
        CheckpointError,
        check_checkpoint,
        read_training_state,
    )

    try:  # the checks a resume makes: manifest checksums, errors naming the file
        check_checkpoint(folder)
        state = read_training_state(folder)
    except CheckpointError as err:
        raise SystemExit(str(err)) from None
    slots = {s["name"]: s["slot"] for s in state["trainer"]["queue"] if s["status"] == "active"}
    if job not in slots:
        names = ", ".join(sorted(slots)) or "none"
        raise SystemExit(f"job {job!r} was not training in {folder} (training then: {names}); "
                         "finished jobs are exported under <run_dir>/adapters/")
    if job not in state["trainer"].get("adapters", {}):
        raise SystemExit(f"{folder} does not record its jobs' base model (a checkpoint from an "
                         "older version): export the job from a newer checkpoint")
    meta = state["trainer"]["adapters"][job]
    slot = state["slots"][slots[job]]
    tensors = load_file(str(folder / f"slot{slots[job]}.safetensors"))
    params = {k[len("param/"):]: v for k, v in tensors.items() if k.startswith("param/")}
    return (params, GPTModelConfig(**meta["base_model"]), slot["rank"], slot["alpha"],
            meta["dropout"], meta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--job", help="with a training checkpoint: which job's adapter")
    parser.add_argument("--model-type", default=None,
                        help="Hugging Face model_type naming the modules (llama, qwen2, qwen3, "
                             "mixtral, qwen3_moe, olmoe, qwen2_moe); default: the adapter's "
                             "recorded one, else llama")
    parser.add_argument("--base-model", default=None, help="base_model_name_or_path to record "
                        "(default: the adapter's recorded hf_dir)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if folder_format(args.source) is FolderFormat.TRAINING_CHECKPOINT:
        if not args.job:
            parser.error(f"{args.source} is a training checkpoint: name the adapter with --job")
        tensors, cfg, rank, alpha, dropout, meta = from_checkpoint(args.source, args.job)
    else:
        tensors, cfg, rank, alpha, dropout, meta = from_adapter_folder(args.source)
    model_type = args.model_type or meta.get("hf_model_type", "llama")
    base = args.base_model if args.base_model is not None else meta.get("hf_dir", "")
    peft, targets = to_peft_tensors(tensors, cfg, model_type)
    try:
        write_peft(args.out, peft, peft_config(rank, alpha, dropout, targets, base),
                   overwrite=args.overwrite)
    except FileExistsError as err:
        raise SystemExit(f"{err} (use --overwrite)") from None
    print(f"wrote {args.out}: r={rank}, lora_alpha={alpha}, {len(peft)} tensors, targets "
          f"{', '.join(targets)}")
    print(f"load it with: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "
          f"'{args.out}')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
