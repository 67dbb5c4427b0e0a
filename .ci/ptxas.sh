#!/usr/bin/env bash
# Assembles every crates/cuda/kernels/*.ptx (and the test and example kernels,
# tests/support/*.ptx, examples/*.ptx, integrations/*/kernels/*.ptx) with ptxas for
# sm_70 and sm_90 and fails on any error, any warning, any register spill or local memory
# use, or a kernel over its register budget (REGISTER_BUDGET below). Prints each kernel's
# registers, spills and stack (ptxas -v).
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
files=("$ROOT"/crates/cuda/kernels/*.ptx "$ROOT"/tests/support/*.ptx "$ROOT"/examples/*.ptx
    "$ROOT"/integrations/*/kernels/*.ptx)
if [[ ${#files[@]} -eq 0 ]]; then
    echo "error: no crates/cuda/kernels/*.ptx found" >&2
    exit 1
fi

# Registers a kernel may use at most: 32 keeps dvx_batched_copy at full occupancy (2048
# threads per multiprocessor: 8 blocks of 256 threads, 64K registers).
declare -A REGISTER_BUDGET=([dvx_batched_copy]=32)

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for f in "${files[@]}"; do
    for arch in sm_70 sm_90; do
        name="$(basename "$f" .ptx)"
        log="$out/$name.$arch.log"
        if "$PTXAS_BIN" -arch="$arch" -O3 -v --warn-on-spills --warn-on-local-memory-usage \
            --warning-as-error -o "$out/$name.$arch.cubin" "$f" >"$log" 2>&1; then
            echo "ok    $arch  ${f#"$ROOT"/}"
        else
            cat "$log" >&2
            echo "FAIL  $arch  ${f#"$ROOT"/}" >&2
            status=1
            continue
        fi
        # "Compiling entry function 'k' for 'sm_90'", then "N bytes stack frame, N bytes
        # spill stores, N bytes spill loads", then "Used N registers"
        while read -r kernel regs stack spills; do
            budget="${REGISTER_BUDGET[$kernel]:-}"
            note=""
            if [[ -n "$budget" && "$regs" -gt "$budget" ]]; then
                note="  OVER BUDGET ($budget)"
                status=1
            fi
            if [[ "$spills" != 0 || "$stack" != 0 ]]; then
                note="$note  SPILLS/STACK"
                status=1
            fi
            printf '        %-26s %3s registers, stack %s, spills %s%s\n' \
                "$kernel" "$regs" "$stack" "$spills" "$note"
        done < <(awk '
            /Compiling entry function/ { match($0, /function .[^ ]+. for/); k = substr($0, RSTART + 10, RLENGTH - 15) }
            /bytes stack frame/ && k != "" { st = $1; sp = $5 + $9 }
            /Used [0-9]+ registers/ && k != "" { match($0, /Used [0-9]+/); print k, substr($0, RSTART + 5, RLENGTH - 5), st, sp; k = "" }
        ' "$log")
    done
done
exit $status
