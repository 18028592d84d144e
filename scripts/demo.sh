#!/usr/bin/env bash
# The main job: set up (scripts/setup.sh), write the demo datasets and tiny base model if
# missing, then train 4 adapters on 4 demo tasks at once with the default recipe config on 2
# CPU processes; adapters are exported in the project's format and as PEFT folders.
# Extra arguments are Hydra overrides, e.g. `bash scripts/demo.sh trainer.steps_per_job=20`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -f data/demo/sort.eval.jsonl ] || [ ! -f data/demo/tiny-llama/config.json ]; then
    .venv/bin/python scripts/make_demo_data.py --out-dir data/demo
fi
OMP_NUM_THREADS=1 exec .venv/bin/torchrun --standalone --nproc-per-node 2 --local-ranks-filter 0 \
    recipes/multi_lora_finetune.py "$@"
