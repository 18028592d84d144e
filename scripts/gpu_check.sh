#!/usr/bin/env bash
# The GPU checks, as one command for a lent GPU machine (one H200, 15 minutes of device time
# for everything, start-up included; it reaches no package registry and gets the working tree
# without .venv). Stages run in order of value, each under its own time limit inside one
# budget (GPU_CHECK_BUDGET seconds, default 390: with the machine's start-up the whole call
# stays under 9 minutes, leaving time for one rerun):
#
#   install      the wheels of .whl/ (scripts/gpu_wheels.sh) into a --target folder, no index
#   env          GPU, driver, torch, CUDA, capability, versions
#   tests        tests/gpu: the bf16 grouped GEMM, a bf16 MultiLoRALinear against the fp32
#                reference (both GEMMs on the kernel, asserted), the bf16 step against fp32
#                (dense, MoE), the step vs a plain loop, optimizer and RNG resume on the GPU
#                (CUDA graphs too: a replay against the eager pass and step)
#   recipe-dense the recipe for 5 steps per job in bf16 on the tiny dense model
#   recipe-graphs the same with trainer.cuda_graphs=true
#   bench-graphs python -m benchmarks --device cuda --only graphs: rows 1c, 8a-8c and 9 eager
#                and with CUDA graphs, side by side (rows 15)
#   recipe-moe   the recipe on the tiny MoE (built from its config)
#   bench        python -m benchmarks --device cuda, every section's rows written as it completes
#
# Results land in ${OUT:-benchmarks/gpu}/ as each stage finishes (10 files): gpu_check.md
# (the report: one row per stage, and what one GPU cannot check), env.txt, tests.log,
# recipe.log, bench-graphs.log, gpu-only-graphs.md and .json, bench.log, and the benchmark's
# gpu.md and gpu.json. Exit status 0 when every stage that ran passed.
#
#   bash scripts/gpu_wheels.sh            # here, once (needs PyPI): .whl/, a few MB
#   bash scripts/gpu_check.sh --dry-run   # here: every stage's command; .whl/ checked
#   bash scripts/gpu_check.sh             # on the GPU machine (the device tool: carry .whl)
#
# GPU_CHECK_STAGES="env tests" runs only those stages (e.g. to rehearse the report here with
# PYTHON=.venv/bin/python, where install cannot run: the wheels are for Python 3.12).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
RESULTS=${OUT:-$REPO/benchmarks/gpu}
WHEELS=${GPU_WHEELS:-$REPO/.whl}
SITE=${GPU_SITE:-${TMPDIR:-/tmp}/gpu_check_site}
WORK=${TMPDIR:-/tmp}/gpu_check_work
BUDGET=${GPU_CHECK_BUDGET:-390}
PYTHON=${PYTHON:-python3}
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") DRY=0 ;;
    *) echo "usage: bash scripts/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac

ALL_STAGES=(install env tests recipe-dense recipe-graphs bench-graphs recipe-moe bench)
read -r -a STAGES <<< "${GPU_CHECK_STAGES:-${ALL_STAGES[*]}}"
declare -A LIMIT=([install]=90 [env]=60 [tests]=200 [recipe-dense]=90 [recipe-graphs]=90
                  [bench-graphs]=150 [recipe-moe]=90 [bench]=0)
declare -A CMD
CMD[install]="\"$PYTHON\" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
--upgrade --target \"$SITE\" \"$WHEELS\"/*.whl"
CMD[env]="\"$PYTHON\" scripts/gpu_machine.py env > \"$RESULTS/env.txt\" 2>&1"
CMD[tests]="\"$PYTHON\" -m pytest -q -rs tests/gpu > \"$RESULTS/tests.log\" 2>&1"
recipe() {  # NAME OVERRIDES...: the recipe's command for 5 steps per job in bf16 on one GPU
    echo "\"$PYTHON\" -m torch.distributed.run --standalone --nproc-per-node 1 \
recipes/multi_lora_finetune.py data_dir=$WORK/data run_dir=$WORK/run-$1 \
trainer.steps_per_job=5 trainer.precision=bf16 trainer.log_interval=1 logging.wandb_mode=disabled \
logging.plots=false checkpoint.resume=never ${*:2} >> \"$RESULTS/recipe.log\" 2>&1"
}
CMD[recipe-dense]="\"$PYTHON\" scripts/make_demo_data.py --out-dir $WORK/data \
>> \"$RESULTS/recipe.log\" 2>&1 && $(recipe dense)"
CMD[recipe-graphs]="\"$PYTHON\" scripts/make_demo_data.py --out-dir $WORK/data \
>> \"$RESULTS/recipe.log\" 2>&1 && $(recipe graphs trainer.cuda_graphs=true adapters.3.dropout=0)"
CMD[bench-graphs]="\"$PYTHON\" -m benchmarks --device cuda --only graphs --out-dir \"$RESULTS\" \
> \"$RESULTS/bench-graphs.log\" 2>&1"
CMD[recipe-moe]=$(recipe moe hf_dir=null model=tiny_moe)
CMD[bench]="\"$PYTHON\" -m benchmarks --device cuda --skip-tp --skip-pp --out-dir \"$RESULTS\" \
> \"$RESULTS/bench.log\" 2>&1"
declare -A LOG=([tests]=tests.log [recipe-dense]=recipe.log [recipe-graphs]=recipe.log
                [recipe-moe]=recipe.log [bench-graphs]=bench-graphs.log [bench]=bench.log
                [env]=env.txt)
for stage in "${STAGES[@]}"; do
    if [ -z "${LIMIT[$stage]+x}" ]; then
        echo "gpu_check: unknown stage '$stage' in GPU_CHECK_STAGES (stages: ${ALL_STAGES[*]})" >&2
        exit 2
    fi
done

if [ "$DRY" = 1 ]; then
    echo "gpu_check --dry-run: results would go to $RESULTS; stages within a ${BUDGET} s budget:"
    for stage in "${STAGES[@]}"; do
        limit=${LIMIT[$stage]}
        echo "  [$stage, limit $([ "$limit" = 0 ] && echo "the rest of the budget" || echo "$limit s")]"
        echo "    ${CMD[$stage]}"
    done
    checker=$([ -x .venv/bin/python ] && echo .venv/bin/python || echo "$PYTHON")
    "$checker" scripts/gpu_machine.py check-wheels "$WHEELS"
    exit $?
fi

mkdir -p "$RESULTS" "$WORK"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
REPORT=$RESULTS/gpu_check.md
deadline=$(( $(date +%s) + BUDGET ))
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no git)")
# A GPU machine's copy of .git can be older than the tree it gets: say when they differ.
[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit + uncommitted changes"
{
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $commit)"
    echo
    echo "Not checked here (one GPU): NCCL between ranks (TP, SP, EP, PP and data parallelism"
    echo "over several GPUs), Transformer Engine (not installable on this machine: its PyTorch"
    echo "extension is built from source against torch), multi-GPU benchmark rows (6, 7)."
    echo
    echo "| stage | result | time | limit |"
    echo "|---|---|---|---|"
} > "$REPORT"

failed=0
for stage in "${STAGES[@]}"; do
    left=$(( deadline - $(date +%s) ))
    limit=${LIMIT[$stage]}
    if [ "$limit" = 0 ] || [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ "${install_failed:-0}" = 1 ] && [ "$stage" != env ]; then
        echo "| $stage | not run: the install failed | - | - |" >> "$REPORT"
        continue
    fi
    if [ "$limit" -lt 20 ]; then
        echo "| $stage | not run: the ${BUDGET} s budget is spent | - | - |" >> "$REPORT"
        continue
    fi
    if [ "$stage" = install ] && ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "| install | FAIL: no wheels in $WHEELS (run scripts/gpu_wheels.sh before, carry .whl) | - | - |" >> "$REPORT"
        install_failed=1 failed=1
        continue
    fi
    echo "gpu_check: $stage (limit $limit s)"
    log=${LOG[$stage]:-}
    seen=$([ -n "$log" ] && [ -f "$RESULTS/$log" ] && wc -l < "$RESULTS/$log" || echo 0)
    start=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "${CMD[$stage]}"
    rc=$?
    took=$(( $(date +%s) - start ))
    new_lines() { [ -n "$log" ] && tail -n +$(( seen + 1 )) "$RESULTS/$log" 2>/dev/null; }
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        result="TIMEOUT: stopped at its $limit s limit${log:+ (see $log)}"
    elif [ "$stage" = tests ]; then
        result=$("$PYTHON" scripts/gpu_machine.py pytest-result "$RESULTS/tests.log" "$rc")
    elif [ "$rc" -ne 0 ]; then
        last=$(new_lines | grep -E "Error|error:|FAILED|Traceback" | tail -n 1 | cut -c1-200)
        result="FAIL (exit $rc)${last:+: $last}${log:+ (see $log)}"
    else
        case $stage in
            env) result="pass: $(head -n 3 "$RESULTS/env.txt" | tr '\n' ';')" ;;
            recipe-*) result="pass: $(new_lines | grep -c "done after 5 steps") jobs done after 5 steps" ;;
            bench) result="pass: every section (gpu.md)" ;;
            bench-graphs) result="pass: rows 15 (gpu-only-graphs.md)" ;;
            *) result=pass ;;
        esac
    fi
    result=${result//|//}  # a table cell
    case $result in pass*) ;; *) failed=1; [ "$stage" = install ] && install_failed=1 ;; esac
    echo "| $stage | $result | $took s | $limit s |" >> "$REPORT"
done
echo "gpu_check: report in $REPORT"
cat "$REPORT"
exit $failed
