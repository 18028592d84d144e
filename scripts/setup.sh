#!/usr/bin/env bash
# Create .venv when missing and install megatron-multilora with its test extras.
# On CPU machines torch==2.13.0 is installed first: an unpinned torch resolves to a
# multi-GB CUDA build there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: $("$PYTHON" --version) is too old; megatron-multilora needs Python >= 3.11" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv"
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: installing torch (CUDA build)"
        .venv/bin/pip install --progress-bar off torch
    else
        echo "setup: installing torch==2.13.0 (CPU build)"
        .venv/bin/pip install --progress-bar off torch==2.13.0
    fi
fi
if ! .venv/bin/python -c 'import megatron_multilora, pytest, peft, trl, datasets, tinker, tinker_cookbook, uvicorn' 2>/dev/null \
        || [ pyproject.toml -nt .venv/.installed ]; then
    echo "setup: installing megatron-multilora and its dependencies (a few minutes the first time)"
    .venv/bin/pip install --progress-bar off -q -e ".[test]"
    # tinker-cookbook (a test runs its supervised loop against the service) also asks for
    # tml-renderers>=0.4.1, which it imports only for Inkling models and PyPI lacks here;
    # pip's note about that missing requirement is shown only if the install itself fails.
    out=$(.venv/bin/pip install --progress-bar off -q --no-deps tinker-cookbook==0.6.1 2>&1) \
        || { echo "$out" >&2; exit 1; }
    touch .venv/.installed
fi
echo "setup: ready ($(.venv/bin/python -W ignore -c 'import torch, megatron.core as m; print(f"torch {torch.__version__}, megatron-core {m.__version__}")'))"
