#!/usr/bin/env bash
# Build .whl/: wheels of what the lent GPU machine's image lacks (CPython 3.12, manylinux
# x86_64; it reaches no package registry), for scripts/gpu_check.sh. Run it here, where PyPI
# is reachable: the pins come from scripts/gpu_machine.py (`pins`), binary wheels are
# downloaded, a package published only as source (antlr4-python3-runtime 4.9.3) is built into
# a wheel, and the folder is checked complete (`check-wheels`) before it replaces .whl/, so a
# failed build leaves any earlier .whl/ as it was. .whl/ is git-ignored; the device tool's
# `carry` takes it along (a few MB).
#
#   bash scripts/gpu_wheels.sh            # GPU_WHEELS=<folder> for another destination
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
dest=${GPU_WHEELS:-.whl}
if ! "$PYTHON" -c 'import packaging' 2>/dev/null; then
    echo "gpu_wheels: $PYTHON has no 'packaging' module; run scripts/setup.sh first" >&2
    exit 1
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu_wheels.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
for pin in $("$PYTHON" scripts/gpu_machine.py pins); do
    echo "gpu_wheels: $pin"
    if ! "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps \
            --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
            -d "$tmp/wheels" "$pin" 2>"$tmp/download.log"; then
        # No wheel published: build one from the source distribution (pure Python here).
        echo "gpu_wheels: no binary wheel of $pin; building it from source"
        "$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps -w "$tmp/wheels" "$pin"
    fi
done
"$PYTHON" scripts/gpu_machine.py check-wheels "$tmp/wheels"
rm -rf "$dest.old"
[ -e "$dest" ] && mv "$dest" "$dest.old"
mv "$tmp/wheels" "$dest"
rm -rf "$dest.old"
echo "gpu_wheels: $dest ready ($(du -sh "$dest" | cut -f1))"
