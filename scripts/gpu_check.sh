#!/usr/bin/env bash
# The GPU check: everything CI cannot run, on one NVIDIA GPU, in about 8 minutes, ending with
# one summary table (docs/results/gpu.md keeps the latest one, with the card and the date).
#
#   scripts/gpu_check.sh [OUT]          # OUT: logs, run directories, summary (default $OUT or
#                                       # scratch/gpu_check)
#
# Steps (each under its own timeout, all under GPU_CHECK_BUDGET_S, default 540 s: a step that
# would start with less than 30 s left is skipped; a failed, timed-out or skipped step is a row
# marked so, and the script goes on):
#   1. pytest -m gpu tests/test_gpu.py (CUDA placement, offload, weight sync, a GRPO step on
#      CUDA from a loaded directory);
#   2. the GRPO main job for 150 steps, then 50 steps at trainer.max_staleness=1 (tis);
#   3. the same with actor.engine=megatron for 20 steps;
#   4. the ~100M Qwen2 preset (Qwen2's tokenizer) for 8 steps;
#   5. "your own model": scripts/own_model_example.py writes a warm-started model directory,
#      JSONL data and a reward file; GRPO then trains from model.path for 100 steps;
#   6. the agent workflow (multi-turn episodes with a calculator tool), smoke preset, 5 steps,
#      on the default rollout engine; then the same on rollout.engine=vllm (head dimension 64:
#      model.num_attention_heads=2), a row marked skipped where vLLM is not installed (the
#      project's GPU machines have none, ../shared/gpu/README.md);
#   7. benchmarks/grpo_vs_trl.py: ours vs TRL's GRPOTrainer on the same GPU, same fp32 model.
# Peak GPU memory per step is sampled with nvidia-smi every 0.5 s.
#
# On the project's GPU machines m2flow is installed offline first (../shared/gpu/README.md):
# set GPU_CHECK_INSTALL=1 to run that install here (wheels in .whl/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-scratch/gpu_check}}
mkdir -p "$OUT"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
unset PYTHONDONTWRITEBYTECODE  # else every Ray worker recompiles what it imports
PY=${PYTHON:-python3}

if [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  timeout 180 "$PY" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl \
    && timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation \
      --ignore-requires-python -e . > "$OUT/install.log" 2>&1 \
    || { echo "install failed: $OUT/install.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
"$PY" -c "import torch, transformers; print(torch.__version__, transformers.__version__)" \
  >> "$OUT/gpu.txt" 2>&1

# step NAME TIMEOUT_S COMMAND...: runs COMMAND, its log in $OUT/NAME.log, its peak GPU memory
# (MiB, nvidia-smi) in $OUT/NAME.mem, its exit status and wall time in $OUT/NAME.status.
BUDGET=${GPU_CHECK_BUDGET_S:-540}
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 30 ]; then
    skip "$name" "${left}s of the ${BUDGET}s budget left"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (timeout ${limit}s)"
  (while true; do
     nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1
     sleep 0.5
   done) > "$OUT/$name.memlog" &
  local sampler=$! t0=$SECONDS
  timeout --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  kill "$sampler" 2>/dev/null
  sort -n "$OUT/$name.memlog" | tail -1 > "$OUT/$name.mem"
  echo "$rc $((SECONDS - t0))" > "$OUT/$name.status"
  echo "   exit $rc after $((SECONDS - t0)) s; tail:"
  tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
}

# skip NAME REASON: a row marked skipped, REASON in $OUT/NAME.log (the summary's note).
skip() {
  echo "== $1 skipped: $2"
  echo "skipped 0" > "$OUT/$1.status"
  echo "skipped: $2" > "$OUT/$1.log"
  rm -f "$OUT/$1.mem"
}

run() { "$PY" -m m2flow.run.cli run "$@"; }

step gpu_tests 150 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_gpu.py
step grpo 120 run workflows/grpo.py trainer.steps=150 trainer.eval_every=50 \
  trainer.save_every=150 "trainer.run_dir=$OUT/grpo"
step grpo_async 60 run workflows/grpo.py trainer.steps=50 trainer.eval_every=50 \
  trainer.save_every=50 trainer.max_staleness=1 actor.off_policy.correction=tis \
  "trainer.run_dir=$OUT/grpo_async"
step megatron 100 run workflows/grpo.py trainer.steps=20 trainer.eval_every=20 \
  trainer.save_every=20 actor.engine=megatron "trainer.run_dir=$OUT/megatron"
step qwen2_100m 100 run workflows/grpo.py -c workflows/presets/qwen2_100m.yaml \
  trainer.steps=8 trainer.eval_every=8 trainer.save_every=8 "trainer.run_dir=$OUT/qwen2_100m"
step own_model_prepare 60 "$PY" scripts/own_model_example.py "$OUT/own" --quiet
step own_model 100 run workflows/grpo.py trainer.steps=100 trainer.eval_every=50 \
  trainer.save_every=100 "model.path=$OUT/own/model" "data.train_files=$OUT/own/train.jsonl" \
  "data.val_files=$OUT/own/val.jsonl" "reward.function=$OUT/own/reward.py:compute_score" \
  "trainer.run_dir=$OUT/own/run"
step agent 90 run workflows/agent.py -c smoke trainer.steps=5 "trainer.run_dir=$OUT/agent"
if "$PY" -c "import vllm" > /dev/null 2>&1; then
  step agent_vllm 150 run workflows/agent.py -c smoke trainer.steps=5 rollout.engine=vllm \
    model.num_attention_heads=2 "trainer.run_dir=$OUT/agent_vllm"
else
  skip agent_vllm "no vLLM in this environment (import vllm failed)"
fi
step trl 150 "$PY" benchmarks/grpo_vs_trl.py --plan none --repeats 1 --steps 10 --warmup 3 \
  --work "$OUT/trl_work" --out "$OUT/grpo_vs_trl.json" model.dtype=float32

"$PY" scripts/gpu_check_summary.py "$OUT" | tee "$OUT/summary.md"
