#!/usr/bin/env bash
# Fetch what the GPU device image lacks into bench/device/wheels/ (git-ignored), for bench/device/check.sh there.
#
#     bench/device/prepare.sh              # idempotent: a wheel already in the folder is not fetched again
#
# Every line of packages.txt becomes one Python 3.12 manylinux x86-64 wheel (pip download --no-deps, binary
# only); DeepSpeed, published as an sdist, is built here into a pure-Python wheel with its ops off (DS_BUILD_OPS=0),
# so they JIT-build on the device against that machine's torch and CUDA. The folder travels with the working tree
# (64 MiB in all, the checkout included), so it must stay under 40 MiB: the script fails if it does not.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WHEELS="${ELSA_DS_WHEELS:-$HERE/wheels}"
LIMIT_MIB=40
PY="${PYTHON:-python3}"
PLATFORMS=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 manylinux_2_39_x86_64; do
    PLATFORMS+=(--platform "$p")
done
mkdir -p "$WHEELS"

have() {  # have NAME VERSION: a wheel of that release is already in the folder
    local norm
    norm="$(echo "$1" | tr 'A-Z-.' 'a-z__')"
    find "$WHEELS" -maxdepth 1 -iname "${norm}-${2}-*.whl" | grep -q .
}

while read -r kind spec _; do
    [[ -z "$kind" || "$kind" == \#* || "$kind" == skip ]] && continue
    name="${spec%%==*}"
    version="${spec##*==}"
    if have "$name" "$version"; then
        echo "cached  $spec"
        continue
    fi
    echo "fetch   $spec ($kind)"
    if [[ "$kind" == wheel ]]; then
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
            --abi abi3 --abi none "${PLATFORMS[@]}" --platform any -d "$WHEELS" "$spec"
    elif [[ "$kind" == sdist ]]; then
        tmp="$(mktemp -d)"
        "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$tmp" "$spec"
        # DeepSpeed's setup.py imports torch: build against this venv's torch, ops off (pure Python wheel)
        DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$tmp/out" "$tmp"/*.tar.gz
        mv "$tmp"/out/*.whl "$WHEELS"/
        rm -rf "$tmp"
    else
        echo "packages.txt: unknown kind '$kind' for $spec" >&2
        exit 2
    fi
    have "$name" "$version" || { echo "no wheel of $spec landed in $WHEELS" >&2; exit 1; }
done < "$HERE/packages.txt"

size_kib="$(du -sk "$WHEELS" | cut -f1)"
echo "wheels: $(find "$WHEELS" -maxdepth 1 -name '*.whl' | wc -l) files, $((size_kib / 1024)) MiB ($size_kib KiB) in $WHEELS"
if (( size_kib > LIMIT_MIB * 1024 )); then
    echo "the wheel folder is over $LIMIT_MIB MiB: it would not travel with the checkout (64 MiB in all)" >&2
    exit 1
fi
