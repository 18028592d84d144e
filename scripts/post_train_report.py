"""What the post-training demo achieved, from its runs' metrics: each GRPO job's reward curve
and held-out exact match before (its starting adapter, the warmup run's) and after, each DPO
job's held-out preference accuracy and margin over its evaluations.

    python scripts/post_train_report.py runs/post-train   # reads <run>-warmup too
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_multilora.training.report.metrics import read_metrics

BARS = " .:-=+*#%@"


def curve(values: list[float]) -> str:
    """A one-line chart of ``values`` between 0 and their max."""
    top = max(values, default=0.0) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1)))] for v in values)


def final_accuracy(run_dir: Path, adapter: str, task: str) -> float | None:
    finals = [r for r in read_metrics(run_dir / "metrics.jsonl")
              if r["kind"] == "eval" and "base" in r["adapters"]]
    return finals[-1]["adapters"].get(adapter, {}).get(f"accuracy_on_{task}") if finals else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    records = read_metrics(args.run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval" and "base" not in r["adapters"]]
    names = sorted({n for r in train for n in r["adapters"]})
    for name in names:
        rewards = [r["adapters"][name]["reward_mean"] for r in train
                   if "reward_mean" in r["adapters"].get(name, {})]
        if rewards:
            start = final_accuracy(Path(f"{args.run_dir}-warmup"), "sort_words", "sort_words")
            end = final_accuracy(args.run_dir, name, name)
            print(f"{name} (GRPO): reward mean by logged step |{curve(rewards)}| "
                  f"{rewards[0]:.2f} -> {rewards[-1]:.2f}")
            if start is not None and end is not None:
                print(f"{name}: held-out exact match {start:.2f} (its starting adapter) -> "
                      f"{end:.2f} after GRPO ({end - start:+.2f})")
        accuracy = [(r["step"], r["adapters"][name]) for r in evals
                    if "preference_accuracy" in r["adapters"].get(name, {})]
        if accuracy:
            steps = ", ".join(f"step {s}: {m['preference_accuracy']:.2f} (margin {m['margin']:.2f})"
                              for s, m in accuracy)
            print(f"{name} (DPO): held-out preference accuracy {steps}")


if __name__ == "__main__":
    main()
