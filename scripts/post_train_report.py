"""What the post-training demo achieved, from its runs' metrics: each GRPO job's reward curve
and each DPO job's held-out preference accuracy (over its evaluations, and the base's and its
adapter's in the final table); for the jobs that start from a warmup adapter, held-out exact match before (the warmup run's) and after.

    python scripts/post_train_report.py runs/post-train   # reads <run>-warmup too
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_multilora.training.report.metrics import read_metrics

BARS = " .:-=+*#%@"
# The demo's jobs that start from a warmup adapter (conf/jobs/post3.yaml), by that adapter.
STARTS = {"capitalize_rl": "capitalize", "prefer_reversed": "reverse_words"}


def curve(values: list[float]) -> str:
    """A one-line chart of ``values`` between 0 and their max."""
    top = max(values, default=0.0) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1)))] for v in values)


def final(run_dir: Path, adapter: str, task: str, what: str = "accuracy") -> float | None:
    """``adapter``'s ``what`` (accuracy, loss or an objective's metric) on ``task`` in the
    run's final table."""
    finals = [
        r
        for r in read_metrics(run_dir / "metrics.jsonl")
        if r["kind"] == "eval" and "base" in r["adapters"]
    ]
    return finals[-1]["adapters"].get(adapter, {}).get(f"{what}_on_{task}") if finals else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args()
    records = read_metrics(args.run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval" and "base" not in r["adapters"]]
    names = sorted({n for r in train for n in r["adapters"]})
    for name in names:
        rewards = [
            r["adapters"][name]["reward_mean"]
            for r in train
            if "reward_mean" in r["adapters"].get(name, {})
        ]
        if rewards:
            print(
                f"{name} (GRPO): reward mean by logged step |{curve(rewards)}| "
                f"{rewards[0]:.2f} -> {rewards[-1]:.2f}"
            )
        accuracy = [
            (r["step"], r["adapters"][name])
            for r in evals
            if "preference_accuracy" in r["adapters"].get(name, {})
        ]
        if accuracy:
            steps = ", ".join(
                f"step {s}: {m['preference_accuracy']:.2f} (margin {m['margin']:.2f})"
                for s, m in accuracy
            )
            print(f"{name} (DPO): held-out preference accuracy {steps}")
        held_out = [
            final(args.run_dir, adapter, name, what)
            for adapter in ("base", name)
            for what in ("loss", "preference_accuracy")
        ]
        if None not in held_out:
            print(
                f"{name} (DPO): held-out DPO loss {held_out[0]:.3f} (base) -> {held_out[2]:.3f}; "
                f"held-out preference accuracy {held_out[1]:.2f} (base) -> {held_out[3]:.2f}"
            )
        start, end = (
            final(folder, adapter, task)
            for folder, adapter, task in (
                (Path(f"{args.run_dir}-warmup"), STARTS.get(name), STARTS.get(name)),
                (args.run_dir, name, name),
            )
        )
        if start is not None and end is not None:
            print(
                f"{name}: held-out exact match {start:.2f} (its starting adapter) -> "
                f"{end:.2f} ({end - start:+.2f})"
            )


if __name__ == "__main__":
    main()
