#!/usr/bin/env bash
# The checks that need a CUDA device, in one run, for a lent GPU machine whose time is
# short (docs/development.md): the engine installed without its dependencies (the
# machine's image has torch and the rest; nothing can be fetched there), then each check
# under its own time limit, its output kept in $OUT (or /tmp/gpu-checks):
#   host-cpu  tools/bench_gpu_host_cpu.py: the host CPU of a GPU step, per thread
#   memory    tools/bench_memory_snapshot.py at N=1 on the GPU (the 100 MB MLP, CIFAR)
#   tests     tests/gpu and the OCT recipe's CUDA tests
# Usage: tools/gpu_checks.sh [CHECK ...]   (default: all three)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
    || { echo "gpu_checks: the install failed:"; tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
status=0
check() {  # name, time limit in seconds, command...
    local name=$1 limit=$2; shift 2
    echo "== $name ($(date +%T))"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "== $name: exit status $rc"; status=1; }
}
for name in "${@:-host-cpu memory tests}"; do
  for one in $name; do
    case $one in
    host-cpu) check host-cpu 200 python3 tools/bench_gpu_host_cpu.py --reps 2 --ops "$OUT/ops.txt" \
                  --json "$OUT/host-cpu.json" ;;
    memory)   check memory 200 python3 tools/bench_memory_snapshot.py --workloads mlp100,cifar \
                  --procs 1 --every 1 --reps 2 --sweep '' --json "$OUT/memory.json" ;;
    tests)    check tests 240 python3 -m pytest -n 4 --dist loadfile -m cuda -q \
                  tests/gpu tests/recipes/test_oct.py ;;
    *) echo "gpu_checks: unknown check $one (host-cpu, memory, tests)"; exit 2 ;;
    esac
  done
done
exit $status
