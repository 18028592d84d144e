#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the whole test suite: single-process tests, then every
# multi-process test in one torchrun launch. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

run_pytest() {
    # pytest exits 5 when it collected no test: a suite that ran nothing has failed.
    local rc=0
    "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then echo "test: no tests were collected by: $*" >&2; fi
    return "$rc"
}

echo "test: single-process tests (units and the benchmark smoke tests, two at a time)"
run_pytest .venv/bin/python -m pytest -n 2 tests/unit tests/bench "$@"
# Two files at a time: the launches wait on start-ups, kills and timeouts as much as they
# compute, and a file's module fixtures (a running service) are made once.
echo "test: the recipe in process and from the CLI (two files at a time)"
run_pytest .venv/bin/python -m pytest -n 2 --dist loadfile tests/recipe "$@"
for world in 2 4; do
    echo "test: multi-process tests (torchrun, $world processes, gloo)"
    OMP_NUM_THREADS=1 run_pytest .venv/bin/torchrun --standalone --nproc-per-node "$world" \
        --local-ranks-filter 0 -m pytest tests/distributed "$@"
done
