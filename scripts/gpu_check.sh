#!/usr/bin/env bash
# GPU checks in one command (under 10 minutes on one GPU): the tests that take CUDA-only paths
# (tests/gpu: bf16 grouped GEMM vs the per-slot loop, TE spec vs local spec when TE is
# installed, the step on CUDA vs a plain loop), the recipe for a few steps on the GPU in bf16,
# and `scripts/bench.py --device cuda`. Everything it measures lands in benchmarks/:
# gpu_check.md (what ran, versions, pass/fail) and bench.py's gpu.md / gpu.json.
#
#   bash scripts/gpu_check.sh            # with .venv (scripts/setup.sh) or PYTHON=<python with torch+CUDA>
#
# On a machine that cannot reach a package index, put wheels of the missing packages
# (megatron-core, hydra-core, omegaconf, antlr4-python3-runtime, ...) in wheels/ first:
#   pip download -d wheels --no-deps megatron-core==0.16.1 hydra-core omegaconf antlr4-python3-runtime
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
OUT=benchmarks/gpu_check.md
mkdir -p benchmarks

if ! "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "gpu_check: $PYTHON sees no CUDA GPU; run this on a GPU machine" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import megatron.core, hydra, megatron_multilora' 2>/dev/null; then
    if [ -d wheels ]; then
        echo "gpu_check: installing megatron-multilora from wheels/ (no index)"
        "$PYTHON" -m pip install -q --no-index --find-links wheels --no-build-isolation -e .
    else
        echo "gpu_check: megatron-core/hydra/megatron_multilora are not importable by $PYTHON;" \
             "run scripts/setup.sh, or put their wheels in wheels/ (see this script's header)" >&2
        exit 1
    fi
fi

status=0
step() {  # step NAME COMMAND...: run, time, record pass/fail in the report
    local name=$1; shift
    local start rc=0
    start=$(date +%s)
    echo "gpu_check: $name"
    "$@" 2>&1 | tee "/tmp/gpu_check_$name.log" || rc=${PIPESTATUS[0]}
    echo "| $name | $([ "$rc" -eq 0 ] && echo pass || echo "FAIL (exit $rc)") | $(( $(date +%s) - start )) s |" >> "$OUT"
    [ "$rc" -eq 0 ] || status=1
}

{
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo
    "$PYTHON" - <<'EOF'
import torch
try:
    import transformer_engine as te
    te_version = te.__version__
except ImportError:
    te_version = "not installed (TE tests skip)"
import megatron.core as mc
print(f"- GPU: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})")
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, megatron-core {mc.__version__}, "
      f"transformer-engine {te_version}")
EOF
    echo
    echo "| check | result | time |"
    echo "|---|---|---|"
} > "$OUT"

step tests "$PYTHON" -m pytest -q -rs tests/gpu
data=$(mktemp -d)
step recipe bash -c "\"$PYTHON\" scripts/make_demo_data.py --out-dir '$data' >/dev/null &&
    \"$PYTHON\" -m torch.distributed.run --standalone --nproc-per-node 1 recipes/multi_lora_finetune.py \
        data_dir='$data' run_dir='$data/run' trainer.steps_per_job=5 trainer.precision=bf16 \
        logging.wandb_mode=disabled logging.plots=false trainer.log_interval=1"
step bench "$PYTHON" scripts/bench.py --device cuda --skip-tp --skip-pp

echo "gpu_check: report in $OUT (bench tables in benchmarks/gpu.md)"
cat "$OUT"
exit $status
