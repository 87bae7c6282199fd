#!/usr/bin/env bash
# The GPU benchmark on a lent H200 (the `device` tool's machine: torch + transformers preinstalled, no
# network). DeepSpeed and its missing needs travel as wheels in benchmarks/gpu/wheels (not committed;
# fetch them here first with `benchmarks/gpu/bench_h200.sh --fetch-wheels`, which needs the package index).
# On the device, from the repo root:   bash benchmarks/gpu/bench_h200.sh   (writes $OUT/bench_h200.json)
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=benchmarks/gpu/wheels

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p "$WHEELS"
  python -m pip wheel -q deepspeed==0.19.8 --no-deps --no-build-isolation -w "$WHEELS"
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$WHEELS" hjson pydantic pydantic-core annotated-types typing-inspection typing_extensions
  ls -la "$WHEELS"
  exit 0
fi

ls "$WHEELS"/deepspeed-*.whl >/dev/null 2>&1 || { echo "error: no DeepSpeed wheel in $WHEELS: run $0 --fetch-wheels where pip works, and carry $WHEELS" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DS_BUILD_OPS=0 RLHF_HOME=/tmp/rlhf-bench-gpu
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
python3 benchmarks/gpu/bench_h200.py --out "${OUT:-/tmp}/bench_h200.json" "$@"
