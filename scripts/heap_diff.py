"""What grew between two tracemalloc snapshots of the training service (``MMLORA_HEAP_SNAPSHOTS``,
``megatron_multilora/api/heap.py``): the allocation sites whose live bytes grew most.

    python scripts/heap_diff.py RUN/heap/minute-5.tracemalloc RUN/heap/minute-30.tracemalloc
"""

from __future__ import annotations

import argparse
import tracemalloc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    before = tracemalloc.Snapshot.load(args.before)
    after = tracemalloc.Snapshot.load(args.after)
    total = sum(s.size for s in after.statistics("filename")) - sum(
        s.size for s in before.statistics("filename")
    )
    print(f"Python heap: {total / 2**20:+.1f} MiB between the snapshots")
    for stat in after.compare_to(before, "traceback")[: args.top]:
        where = " < ".join(  # the allocation, then its callers
            f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(stat.traceback[-3:])
        )
        print(f"{stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+8d} blocks  {where}")


if __name__ == "__main__":
    main()
