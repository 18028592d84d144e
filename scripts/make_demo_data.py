"""Write the demo tasks' train/eval JSONL files (see megatron_multilora.data.demo_tasks).

    python scripts/make_demo_data.py --out-dir data/demo [--n-train 512] [--n-eval 64] [--seed 0]
"""

from __future__ import annotations

import argparse

from megatron_multilora.data.demo_tasks import write_demo_datasets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", required=True, help="directory to write the files into")
    parser.add_argument("--n-train", type=int, default=512, help="train examples per task")
    parser.add_argument("--n-eval", type=int, default=64, help="eval examples per task")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_demo_datasets(args.out_dir, n_train=args.n_train, n_eval=args.n_eval,
                                seed=args.seed)
    for task, split_paths in paths.items():
        print(f"{task}: train {split_paths['train']} ({args.n_train} records), "
              f"eval {split_paths['eval']} ({args.n_eval} records)")


if __name__ == "__main__":
    main()
