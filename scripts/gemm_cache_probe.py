"""The memory oneDNN's and ideep's GEMM primitive caches keep when every call has a new row
count, as a training service's micro-batches do (rows 17, benchmarks/README.md): the frozen
fp32 GEMMs of SmolLM2-135M's layers on packed weights (``ops/packed_linear.py``), each cache
setting in a fresh process (both read their capacity once), side by side.

    python scripts/gemm_cache_probe.py [--shapes 400]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import subprocess
import sys

# (out, in) of SmolLM2-135M's frozen linears: fused QKV, attention out, fused gate/up, down
WEIGHTS = ((960, 576), (576, 576), (3072, 576), (576, 1536))
SETTINGS = {
    "defaults (1,024 each)": {},
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY=256": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"},
    "both 256 (mmlora api's)": {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256",
        "LRU_CACHE_CAPACITY": "256",
    },
}


def _rss_mib() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what stays is held, not freed-and-kept
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _child(shapes: int) -> None:
    import torch

    torch.set_num_threads(1)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    packs = [(reorder(torch.randn(out, inp)), inp) for out, inp in WEIGHTS]
    start = _rss_mib()
    for rows in random.Random(0).sample(range(1, 2049), shapes):
        for packed, inp in packs:
            torch.ops.mkldnn._linear_pointwise(torch.randn(rows, inp), packed, None, "none", [], "")
    print(f"{_rss_mib() - start:.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=int, default=400, help="distinct row counts")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.shapes)
    print(f"{args.shapes} row counts x {len(WEIGHTS)} weights, MiB held after the calls:")
    for name, env in SETTINGS.items():
        held = subprocess.run(
            [sys.executable, __file__, "--child", "--shapes", str(args.shapes)],
            env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        print(f"  {name:40s} {held:>6s}")


if __name__ == "__main__":
    main()
