#!/usr/bin/env bash
# The rollout and update throughput benchmark (bench_h200.py) on a lent GPU machine, which has torch and
# transformers but no network: DeepSpeed, Prefect, pydantic and the rest travel in .wheelhouse/, packed
# here by `make wheelhouse` (after `make install`).
#   on the GPU machine, with .wheelhouse/ carried:   bash benchmarks/gpu/bench_h200.sh [bench_h200.py options]
#   here, the same steps on the CPU:         bash benchmarks/gpu/bench_h200.sh --dry-run   (CI runs it)
# Writes ${OUT:-/tmp}/bench_h200.json. benchmarks/gpu/device_check.sh runs it among the other GPU checks.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
if [[ "${1:-}" == "--dry-run" ]]; then
  shift
  exec "${PYTHON:-python3}" benchmarks/gpu/bench_h200.py --dry-run --out "$out/bench_h200.json" "$@"
fi
[ -f .wheelhouse/env.sh ] || { echo "bench_h200.sh: no .wheelhouse/env.sh here: run 'make wheelhouse' where pip works, and carry .wheelhouse/" >&2; exit 2; }
source .wheelhouse/env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
python3 benchmarks/gpu/bench_h200.py --out "$out/bench_h200.json" "$@"
