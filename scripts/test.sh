#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the whole test suite in tiers: the single-process tests;
# the numerics tests again on MKL's other code paths (MKL_CBWR=AVX2, and the other CPU
# vendor's: tests/cpu_paths.py); the recipe; every multi-process test in torchrun launches of 2
# and 4 processes. Every tier runs even when another failed. A table of the tiers ends the
# output, then the failed tests' names; the exit status is 1 if any tier failed or ran no test.
# Extra arguments go to every pytest run.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1

PY=.venv/bin/python
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
# Grouped GEMMs, LoRA layers, slot routing, the step and the frozen linears: where results
# depend on how MKL rounds.
NUMERICS=(tests/unit/test_grouped_mm.py tests/unit/test_multi_lora_linear.py
          tests/unit/test_moe.py tests/unit/test_slot_layout_route.py
          tests/unit/test_step_schedule.py tests/unit/test_less_work.py
          tests/unit/test_slot_optimizer.py tests/unit/test_packed_linear.py
          tests/unit/test_packed_attention.py tests/unit/test_loss_rows.py
          tests/unit/test_fused_rows.py tests/unit/test_objectives.py
          tests/unit/test_mixed_alone_main_widths.py)
n=0

record() {  # record NAME EXIT_STATUS SECONDS REPORT NOTE: one row of the final table
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >> "$reports/tiers.tsv"
}

tier() {  # tier NAME COMMAND...: run one tier's pytest command with a JUnit report added
    local name=$1 start=$SECONDS rc=0
    shift
    n=$((n + 1))
    echo
    echo "test: tier $n, $name"
    "$@" --junitxml="$reports/$n.xml" || rc=$?
    record "$name" "$rc" $((SECONDS - start)) "$n.xml" ""
}

fingerprint() {  # fingerprint [ENV ARGUMENT...]: MKL's GEMM bits under that environment (env(1))
    env "$@" "$PY" -W ignore -c 'from tests.cpu_paths import gemm_fingerprint as f; print(f())'
}

numerics_on() {  # numerics_on NAME ENV ARGUMENT...: the numerics tests on another MKL code path
    local name=$1
    shift
    if [ "$(fingerprint "$@")" = "$here" ]; then  # it must really be another path
        record "$name" 1 0 "" "FAILED: $* did not change MKL's results here"
        return
    fi
    echo "test: $*: $(env "$@" "$PY" -W ignore -m tests.cpu_paths)"
    tier "$name" env "$@" "$PY" -m pytest -n 2 "${NUMERICS[@]}" "${ARGS[@]}"
}

ARGS=("$@")
echo "test: on $("$PY" -W ignore -m tests.cpu_paths)"
here=$(fingerprint)

tier "units and benchmark smoke tests" "$PY" -m pytest -n 2 tests/unit tests/bench "${ARGS[@]}"

if [ -z "${MKL_CBWR:-}" ]; then
    numerics_on "numerics, MKL_CBWR=AVX2" MKL_CBWR=AVX2
else  # run under a branch already: the other tier is MKL's default
    numerics_on "numerics, MKL_CBWR unset" -u MKL_CBWR
fi
# MKL asks whether the CPU is an Intel one before it picks its kernels; a preloaded answer
# the other way runs the other vendor's path (tests/mkl_vendor.c).
intel=$("$PY" -m tests.cpu_paths --intel)
other=$([ "$intel" = 1 ] && echo "AMD's" || echo "Intel's")
shim=.venv/mkl_vendor_$((1 - intel)).so
if cc -shared -fPIC -O2 -DINTEL_CPU=$((1 - intel)) -o "$shim" tests/mkl_vendor.c; then
    numerics_on "numerics, $other MKL path" LD_PRELOAD="$PWD/$shim"
else
    record "numerics, $other MKL path" 0 0 "" "not run: no C compiler (cc) to build tests/mkl_vendor.c"
fi

# Two files at a time: the launches wait on start-ups, kills and timeouts as much as they
# compute, and a file's module fixtures (a running service) are made once. The longest files
# first (tests/recipe/conftest.py orders them; xdist's own reorder, most tests first, would
# leave the long few-test files for the end and one worker idle while the other runs them).
tier "recipe, in process and from the CLI" \
    "$PY" -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests/recipe "${ARGS[@]}"
for world in 2 4; do
    tier "multi-process, torchrun x $world (gloo)" env OMP_NUM_THREADS=1 \
        .venv/bin/torchrun --standalone --nproc-per-node "$world" --local-ranks-filter 0 \
        -m pytest tests/distributed "${ARGS[@]}"
done

echo
"$PY" -m tests.tier_table "$reports"
