#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the main job: 4 adapters trained at once on a tiny
# frozen GPT with tensor parallelism over 2 CPU processes. Extra arguments go to the job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OMP_NUM_THREADS=1 exec .venv/bin/torchrun --standalone --nproc-per-node 2 scripts/train_demo.py "$@"
