#!/usr/bin/env bash
# Why: a lent GPU comes for minutes, once, with no network; every check that needs one
# (issue 53's CUDA points) runs here in one call, each step under its own time limit
# within one deadline, so a slow or failing step costs its own result only.
# On the device, after the staging calls (config/gpu/stage.sh), from the repo root:
#   bash config/gpu/run_checks.sh [SECONDS [STEP...]]   (deadline, default 540; steps: the
#   functions below, default: llama8b_mixed llama8b_shared kernel parity ...)
# Writes $OUT/run.log and $OUT/results.tgz (bench reports, test reports, timings),
# refreshed after every step, so a call cut short still returns what was done.
set -u
deadline=$(($(date +%s) + ${1:-540}))
out=${OUT:-/tmp/gpu-out}
res=/tmp/gpu-results
mkdir -p "$out" "$res"
exec > >(tee -a "$out/run.log") 2>&1
export PYTHONUNBUFFERED=1

pack() { tar -czf "$out/results.tgz" -C "$res" . 2>/dev/null; }

# step NAME LIMIT CMD...: runs CMD for at most LIMIT seconds and never past the deadline.
step() {
  local name=$1 limit=$2 left rc start
  shift 2
  left=$((deadline - $(date +%s)))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    echo "=== $name: skipped, the deadline is near"
    return 1
  fi
  start=$(date +%s)
  echo "=== $name (limit ${limit}s, $(date +%T))"
  timeout -k 5 "$limit" "$@"
  rc=$?
  echo "=== $name: rc=$rc after $(($(date +%s) - start))s"
  echo "$name rc=$rc seconds=$(($(date +%s) - start))" >>"$res/steps.txt"
  pack
  return $rc
}

# shellcheck source=config/gpu/install.sh
source config/gpu/install.sh || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv \
  | tee "$res/gpu.txt"
python3 -c 'import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.device_info())' \
  | tee -a "$res/gpu.txt"

pytest_args=(-p no:cacheprovider -o addopts= -o "filterwarnings=ignore::DeprecationWarning" -q -n 0 -ra)
parity_tests=(-k "(mixed_batches and mlx) or chunked_prefill or smollm2"
  tests/engine/test_parity.py tests/engine/test_parity_smollm2.py)

# bench LABEL MODEL WORKLOAD LIMIT [ARGS...]: one batchd bench run, its report in $res/LABEL.
bench() {
  local label=$1 model=$2 workload=$3 limit=$4
  shift 4
  step "bench-$label" "$limit" batchd bench --model "$model" --workload "$workload" \
    --out "$res/$label" "$@"
}

kernel() {
  step kernel 150 python3 -m pytest "${pytest_args[@]}" --junitxml="$res/kernel.xml" \
    tests/engine/forward/test_cuda_paged.py && return
  echo "the paged kernel failed its checks: the benches below measure the gather path"
  export BATCHD_CUDA_PAGED_KERNEL=0
  echo "benches with BATCHD_CUDA_PAGED_KERNEL=0" >>"$res/steps.txt"
}
attention() { step attention 60 python3 -m batchd.daemon.bench.gpu.attention --json "$res/attention.json"; }
# On a GPU "auto" is the mlx backend too: one backend's cases, both architectures. The
# tests' conftest sets MLX_ENABLE_TF32=0 (float32 products in float32); parity_tf32 runs
# them with MLX's default TF32 products, parity_gather with the gather path.
parity() { step parity 120 python3 -m pytest "${pytest_args[@]}" --junitxml="$res/parity.xml" "${parity_tests[@]}"; }
parity_tf32() {
  MLX_ENABLE_TF32=1 step parity-tf32 120 python3 -m pytest "${pytest_args[@]}" \
    --junitxml="$res/parity-tf32.xml" "${parity_tests[@]}"
}
parity_gather() {
  BATCHD_CUDA_PAGED_KERNEL=0 step parity-gather 120 python3 -m pytest "${pytest_args[@]}" \
    --junitxml="$res/parity-gather.xml" "${parity_tests[@]}"
}
# Prefill chunks padded to buckets (batchd.engine.forward.prefill_buckets), in parity.
parity_bucketed() {
  step parity-bucketed 90 python3 -m pytest "${pytest_args[@]}" --junitxml="$res/parity-bucketed.xml" \
    -k bucketed tests/engine/test_parity.py
}
probe() { step probe 60 python3 -m batchd.daemon.bench.gpu.shape_probe; }
llama8b_mixed() { bench bench-llama8b-mixed bench-llama8b mixed 200 --max-num-seqs 64; }
llama8b_shared() {
  bench bench-llama8b-shared-prefix bench-llama8b shared-prefix 100 --max-num-seqs 64
}
# The 8B's mixed with decode attention by gathers, and each sampler with async scheduling.
llama8b_gather() {
  BATCHD_CUDA_PAGED_KERNEL=0 bench bench-llama8b-mixed-gather bench-llama8b mixed 200 \
    --max-num-seqs 64
}
llama8b_backends() { bench bench-llama8b-backends bench-llama8b backends 300 --max-num-seqs 64; }
smollm2_mixed() { bench smollm2-mixed smollm2 mixed 100; }
smollm2_shared() { bench smollm2-shared-prefix smollm2 shared-prefix 80; }
smollm2_quick() { bench smollm2-mixed-quick smollm2 mixed 100 --quick; }
# smollm2_at DIR FLAG: SmolLM2 written to DIR by make-model with FLAG, once.
smollm2_at() { [[ -f $1/config.json ]] || batchd make-model "$1" --model smollm2 "$2"; }
# SmolLM2 with its GGUF's 4-bit weights kept (MLX's quantized products build per row tile).
q4=/tmp/smollm2-q4
smollm2_q4() {
  smollm2_at "$q4" --keep-quantized && bench smollm2-q4-mixed-quick "$q4" mixed 100 --quick
}
# SmolLM2 written dense (what the preset's conversion does on CUDA too).
dense=/tmp/smollm2-dense
smollm2_dense() {
  smollm2_at "$dense" --no-keep-quantized && bench smollm2-dense-mixed "$dense" mixed 150
}
smollm2_dense_shared() {
  smollm2_at "$dense" --no-keep-quantized &&
    bench smollm2-dense-shared-prefix "$dense" shared-prefix 120
}
# Where an 8B-shaped step's time goes (8 of its layers), synchronous and async scheduling.
step_probe() { step step-probe 150 python3 -m batchd.daemon.bench.gpu.step_probe; }
step_probe_async() {
  step step-probe-async 100 python3 -m batchd.daemon.bench.gpu.step_probe --async-scheduling
}

steps=("${@:2}")
# The next questions first: the 8B bench with prefill buckets, then the checks and the rest.
((${#steps[@]})) || steps=(llama8b_mixed llama8b_shared kernel parity parity_bucketed
  smollm2_mixed smollm2_shared step_probe llama8b_gather llama8b_backends attention probe
  smollm2_q4 step_probe_async parity_tf32 parity_gather)
for name in "${steps[@]}"; do "$name"; done
echo "=== done ($(date +%T)), $((deadline - $(date +%s)))s before the deadline"
cat "$res/steps.txt"
