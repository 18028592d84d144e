"""Write what the main job trains on: the demo tasks' train/eval JSONL files (see
megatron_multilora.data.demo_tasks), each task's preference pairs and prompts for DPO and
GRPO jobs (<task>.pairs.*.jsonl, <task>.prompts.*.jsonl) and, for the letter tasks, the tiny
random base model, a Hugging Face Llama folder with a byte-level tokenizer (see
megatron_multilora.models.tiny_hf).

    python scripts/make_demo_data.py --out-dir data/demo [--n-train 512] [--n-eval 64] [--seed 0]
    python scripts/make_demo_data.py --out-dir data/demo-words --tasks words   # SmolLM2 demo
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_multilora.data.demo_tasks import TASK_SETS, write_post_training_datasets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", required=True, help="directory to write the files into")
    parser.add_argument("--n-train", type=int, default=512, help="train examples per task")
    parser.add_argument("--n-eval", type=int, default=64, help="eval examples per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tasks",
        choices=sorted(TASK_SETS),
        default="letters",
        help="letters: for the tiny byte-level model; words: for SmolLM2",
    )
    parser.add_argument(
        "--no-base-model",
        action="store_true",
        help="skip the tiny base model (<out-dir>/tiny-llama; letters only)",
    )
    args = parser.parse_args()
    paths = write_post_training_datasets(
        args.out_dir, n_train=args.n_train, n_eval=args.n_eval, seed=args.seed, task_set=args.tasks
    )
    for task, _split_paths in paths.items():
        print(
            f"{task}: {args.n_train} train and {args.n_eval} eval records each as completions "
            f"({task}.{{train,eval}}.jsonl), pairs ({task}.pairs.*) and prompts "
            f"({task}.prompts.*) in {args.out_dir}"
        )
    if args.tasks == "letters" and not args.no_base_model:
        from megatron_multilora.models.tiny_hf import write_tiny_llama

        folder = write_tiny_llama(Path(args.out_dir) / "tiny-llama", seed=args.seed)
        print(f"base model: {folder} (random tiny Llama, byte-level tokenizer)")


if __name__ == "__main__":
    main()
