#!/usr/bin/env bash
# Assembles every kernels/*.ptx (and the test and example kernels, tests/support/*.ptx, examples/*.ptx) with ptxas for sm_70 and sm_90 and fails on any error.
#
# Uses `ptxas` from PATH (or $PTXAS) when present; otherwise installs the pinned
# nvidia-cuda-nvcc-cu12 wheel (which ships ptxas, no GPU or driver needed) into a venv
# under .ci/.venv and uses nvidia/cuda_nvcc/bin/ptxas from its site-packages.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NVCC_WHEEL="nvidia-cuda-nvcc-cu12==12.9.86"
VENV="${DEVARROW_PTXAS_VENV:-$ROOT/.ci/.venv}"

find_ptxas() {
    if [[ -n "${PTXAS:-}" && -x "${PTXAS}" ]]; then
        echo "$PTXAS"
        return
    fi
    if command -v ptxas >/dev/null 2>&1; then
        command -v ptxas
        return
    fi
    local candidate
    for candidate in "$VENV"/lib/python3*/site-packages/nvidia/cuda_nvcc/bin/ptxas; do
        if [[ -x "$candidate" ]]; then
            echo "$candidate"
            return
        fi
    done
}

PTXAS_BIN="$(find_ptxas || true)"
if [[ -z "$PTXAS_BIN" ]]; then
    echo "ptxas not found; installing $NVCC_WHEEL into $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$NVCC_WHEEL"
    PTXAS_BIN="$(find_ptxas || true)"
fi
if [[ -z "$PTXAS_BIN" ]]; then
    echo "error: ptxas is still not available" >&2
    exit 1
fi
echo "using $PTXAS_BIN ($("$PTXAS_BIN" --version | tail -n 1))"

shopt -s nullglob
files=("$ROOT"/kernels/*.ptx "$ROOT"/tests/support/*.ptx "$ROOT"/examples/*.ptx)
if [[ ${#files[@]} -eq 0 ]]; then
    echo "error: no kernels/*.ptx found" >&2
    exit 1
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for f in "${files[@]}"; do
    for arch in sm_70 sm_90; do
        name="$(basename "$f" .ptx)"
        if "$PTXAS_BIN" -arch="$arch" -O3 --warn-on-spills -o "$out/$name.$arch.cubin" "$f"; then
            echo "ok    $arch  ${f#"$ROOT"/}"
        else
            echo "FAIL  $arch  ${f#"$ROOT"/}" >&2
            status=1
        fi
    done
done
exit $status
