#!/usr/bin/env bash
# The prepared GPU check: everything a lent GPU machine (one GPU, no network, minutes of time) should
# run, in one command of at most 8 minutes, each step under its own time limit, its results written to
# OUT_DIR as it goes (a step that fails or runs out of time leaves the others' files):
#
#   env.txt         the GPU, driver, torch / transformers / DeepSpeed / Prefect versions, the commit
#   gpu_tests.txt   the tests marked gpu (GPU_TESTS below): compiled static-cache decode = eager tokens
#                   and its speed; the update's memory estimate against torch's CUDA peak
#   demo.txt        the demo preset through the real flow on CUDA (`rlhf demo`), then `rlhf status`
#   quickstart.txt  verl's quickstart scale through the real flow (benchmarks/gpu/bench_iteration.py:
#                   256 prompts, <= 256 response tokens, Qwen2.5-0.5B's shape and vocabulary, hf rollout
#                   with the static decode): seconds by stage, tokens/s, peak memory against the estimate
#   quickstart.json the same numbers; quickstart.md its tables in Markdown, for docs/benchmarks.md
#   summary.md      one row per step: its result and seconds
#
# Here, where pip works, once after `make install`:  make wheelhouse   (writes .wheelhouse/, ~45 MB)
# On the GPU machine, from the checkout's root, .wheelhouse/ beside it:   bash benchmarks/gpu/device_check.sh OUT_DIR
# Here, the same steps on the CPU at tiny shapes (CI runs it):      bash benchmarks/gpu/device_check.sh --dry-run OUT_DIR
# A copy of the checkout without .git names its commit with COMMIT=<hash>.
set -uo pipefail
cd "$(dirname "$0")/../.."
dry=0
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
out=${1:?usage: device_check.sh [--dry-run] OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /tmp/rlhf-device-check.XXXX)
GPU_TESTS="tests/rlhf_core/training/test_memory.py tests/rlhf_core/rollout/test_hf_static_decode.py"
# tests/benchmarks/test_gpu_dry_runs.py checks that every test marked gpu lives in one of these files

if (( dry )); then
  py=${PYTHON:-python3}
  declare -A limit=([env]=60 [gpu_tests]=120 [demo]=240 [status]=60 [quickstart]=300)
  demo_args=(--iterations 1 actor_rollout_ref.model.warm_start.enable=false data.train_batch_size=4
             data.max_val_samples=4 data.max_response_length=8 actor_rollout_ref.actor.ppo_mini_batch_size=4
             trainer.val_before_train=false trainer.test_freq=-1 trainer.device=cpu)
  quickstart_args=(--dry-run)
  accelerator=cpu
  export RLHF_HOME=$work/home PREFECT_HOME=$work/home/prefect
  mkdir -p "$PREFECT_HOME"
else
  [ -f .wheelhouse/env.sh ] || { echo "device_check: no .wheelhouse/env.sh here: run 'make wheelhouse' where pip works, and carry .wheelhouse/" >&2; exit 2; }
  source .wheelhouse/env.sh
  py=python3
  # 8 minutes in all. The quickstart's first iteration builds both engines and compiles the decode
  # step of the model it loads; the second compiles it again for the trainer's module it borrows (a
  # warm compile cache); the third is the steady one
  declare -A limit=([env]=20 [gpu_tests]=120 [demo]=80 [status]=20 [quickstart]=240)
  demo_args=(--iterations 3)
  quickstart_args=(--layers 24 --prompts 256 --max-response 256 --iterations 2)
  accelerator=cuda  # the suite's conftest pins DeepSpeed to the CPU unless told otherwise
fi
export PYTHONUNBUFFERED=1 PY=$py RUNS=$work/runs
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown: no .git here, pass COMMIT=<hash>')}

printf '# device check at %s, %s (%s)\n\n| step | result | seconds | output |\n|---|---|---|---|\n' \
  "$commit" "$(date -u '+%Y-%m-%d %H:%M UTC')" "$( ((dry)) && echo 'dry run, CPU' || echo GPU)" > "$out/summary.md"

# step NAME FILE CMD...: CMD under timeout ${limit[NAME]} s (SIGTERM, then SIGKILL 20 s later), its
# output appended to OUT_DIR/FILE, a row in summary.md
step() {
  local name=$1 file=$2 started=$SECONDS rc=0 result
  shift 2
  echo "== $name: $* (limit ${limit[$name]} s)" >> "$out/$file"
  timeout --kill-after=20 "${limit[$name]}" "$@" >> "$out/$file" 2>&1 || rc=$?
  case $rc in 0) result=ok ;; 124|137) result="timed out" ;; *) result="failed ($rc)" ;; esac
  echo "| $name | $result | $((SECONDS - started)) | $file |" >> "$out/summary.md"
}

step env env.txt bash -c 'echo "commit '"$commit"'"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  "$PY" -c "import sys, torch, transformers, deepspeed, prefect; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.cuda.is_available(), \"transformers\", transformers.__version__, \"deepspeed\", deepspeed.__version__, \"prefect\", prefect.__version__)"'
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
step gpu_tests gpu_tests.txt env DS_ACCELERATOR=$accelerator "$py" -m pytest -m gpu -p no:randomly -p no:cacheprovider \
  -q -s -n 0 $GPU_TESTS
step demo demo.txt "$py" -m rlhf_cli.main demo trainer.runs_root="$work/runs" "${demo_args[@]}"
step status demo.txt bash -c 'run=$(ls -d "$RUNS"/*/ | head -1) && "$PY" -m rlhf_cli.main status "$run" &&
  "$PY" -m rlhf_cli.main query "$run" "select iteration, count(*) as responses, avg(response_length) as length from rollouts group by iteration order by iteration"'
step quickstart quickstart.txt "$py" benchmarks/gpu/bench_iteration.py "${quickstart_args[@]}" \
  --out "$out/quickstart.json" --markdown "$out/quickstart.md" actor_rollout_ref.rollout.hf_decode=static \
  actor_rollout_ref.rollout.generation_batch_tokens=262144
echo "device check: $out ($SECONDS s)" | tee -a "$out/summary.md"
rm -rf "$work"
