#!/usr/bin/env bash
# The one GPU check of the ds_fssdp.ops kernels: the GPU tests, then the kernel benchmarks; logs
# and JSON go to $OUT. Run on the device machine (nvidia-h200) from the repository root:
#     bash benchmarks/gpu/run.sh            (device tool: timeout_s 600; about 6-8 minutes)
#     ARMS=schedule bash benchmarks/gpu/run.sh   (only the schedule arms: timeout_s 180)
# Budget: tests at most 270 s (Triton compiles and autotuning dominate), kernel benchmarks at most
# 210 s, schedule arms (benchmarks/gpu/schedule_arms.py: pipelined layer degree 1 vs auto, one copy
# per destination off vs on) at most 60 s (--quick; 150 s alone, full size).
#
# What the machine lacks: its image (/work/.library/device/KINDS.md) has torch, triton, pytest,
# pytest-timeout and packaging, but not deepspeed (nor pydantic, hjson) or ds-fssdp, and it
# cannot reach a registry. ds_fssdp.ops needs none of them, so instead of carrying deepspeed's
# dependency tree as wheels we expose only the ops: a stub package ds_fssdp whose ops subpackage
# is this checkout's ops/ (what `pip install -e .` maps, see setup.py package_dir).
set -uo pipefail
OUT=${OUT:-$(mktemp -d)}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET DS_FSSDP_OPS_BACKEND  # compiled kernels, Triton chosen for CUDA tensors

SHIM=$(mktemp -d)
mkdir -p "$SHIM/ds_fssdp"
printf '"""Stub for the GPU check: only ds_fssdp.ops (benchmarks/gpu/run.sh)."""\n' > "$SHIM/ds_fssdp/__init__.py"
ln -s "$REPO/ops" "$SHIM/ds_fssdp/ops"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONSAFEPATH=1  # `python3 -m pytest` must not put the checkout's own ds_fssdp/ first

python3 - <<'PY' 2>&1 | tee "$OUT/env.txt" || { echo "environment check failed"; exit 2; }
import importlib
for name in ("torch", "triton", "pytest", "pytest_timeout", "packaging"):
    importlib.import_module(name)
import torch, triton
import ds_fssdp.ops as ops
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
print("torch._grouped_mm present:", hasattr(torch, "_grouped_mm"))
print("ds_fssdp.ops from", ops.__file__)
import sys
assert "deepspeed" not in sys.modules, "the stub package must be the ds_fssdp imported here"
PY
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv >> "$OUT/env.txt" 2>&1

if [ "${ARMS:-all}" = schedule ]; then
    timeout 150 python3 benchmarks/gpu/schedule_arms.py --json "$OUT/schedule_arms.json" 2>&1 | tee "$OUT/schedule_arms.log"
    rc=${PIPESTATUS[0]}
    echo "schedule arms: rc=$rc" | tee "$OUT/summary.txt"
    exit $rc
fi

start=$(date +%s)
timeout 270 python3 -m pytest -q -m gpu tests/test_ops_gpu.py -p no:cacheprovider -rfE \
    --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "gpu tests: rc=$tests_rc in $(( $(date +%s) - start )) s" | tee "$OUT/summary.txt"

start=$(date +%s)
timeout 210 python3 benchmarks/ops_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmarks: rc=$bench_rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
grep '^targets:' "$OUT/kernels.log" >> "$OUT/summary.txt"

start=$(date +%s)
timeout 60 python3 benchmarks/gpu/schedule_arms.py --quick --repeats 3 --json "$OUT/schedule_arms.json" 2>&1 \
    | tee "$OUT/schedule_arms.log"
arms_rc=${PIPESTATUS[0]}
echo "schedule arms: rc=$arms_rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
grep -E '^(pipeline|one copy)' "$OUT/schedule_arms.log" >> "$OUT/summary.txt"
exit $(( tests_rc != 0 || bench_rc != 0 || arms_rc != 0 ))
