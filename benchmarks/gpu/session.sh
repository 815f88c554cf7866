#!/usr/bin/env bash
# One device session's prepared run: the lent GPU comes for about 15 minutes in all, start
# included, so every stage runs under its own limit and writes one log to $OUT (the device
# tool brings back at most 8 files). Stages, in the order they run (STAGES chooses):
#
#   profile  Llama-3.1-8B single-stream decode under JAX's profiler: ops by time a token
#   dslice   the same decode with XLA's dynamic-slice fusion (the stacked weights' slices)
#   cmdbuf   the same decode with XLA's command buffers over the layer loop (WHILE)
#   tests    the gpu-marked tests alone, at the whole device's memory (interrupted, not
#            killed, at its limit, so pytest still prints what failed)
#   peer     Llama-3.1-8B single stream and TTFT beside transformers, one run
#   batch    Llama-3.1-8B ShareGPT-shaped and random batches (jllm alone)
#
# The default runs the first four (about 8 minutes at their limits: one call of the device
# tool with a 540 s limit); `STAGES="peer batch"` is a second call if time is left. Each
# bench stage starts an engine (the 8B: ~45 s, mostly compiling; a later stage of the same
# XLA flags loads the compiled steps from the cache), dslice and cmdbuf compile anew.
#
#   bash benchmarks/gpu/session.sh                       # on the GPU machine
#   STAGES="tests profile" bash benchmarks/gpu/session.sh
#   DRY=1 bash benchmarks/gpu/session.sh                 # a tiny config on any device
#
# Carry .whl/ (gguf, flax where the machine's is older) and .tok/ (the tests' tokenizer):
# docs/gpu.md says how to make them. Seconds per stage: TESTS_S, PEER_S, BATCH_S, PROFILE_S,
# VARIANT_S.
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/gpu/logs}"
PY="${PYTHON:-python3}"
STAGES="${STAGES:-profile dslice cmdbuf tests}"
MODEL="${MODEL:-llama-3.1-8b}"
mkdir -p "$OUT"
source benchmarks/gpu/env.sh
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
dry=()
[ -n "${DRY:-}" ] && dry=(--dry-run)

"$PY" -c "import jax, flax, transformers; print('JAX', jax.__version__, 'flax', flax.__version__, \
'transformers', transformers.__version__, jax.devices())" 2>&1 | tee "$OUT/session.log"

bench() {  # bench NAME SECONDS ARGS...: one bench.py run, its log in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$PY" benchmarks/gpu/bench.py --model "$MODEL" "${dry[@]}" "$@" \
    >"$OUT/$name.log" 2>&1
  echo "$name: exit $? at $(elapsed)" | tee -a "$OUT/session.log"
  grep -E "^\||^profile|^$MODEL|^tiny" "$OUT/$name.log" | head -60
}

for stage in $STAGES; do
  case $stage in
    tests)
      [ -n "${DRY:-}" ] && continue
      timeout -s INT "${TESTS_S:-180}" "$PY" -m pytest -q -m gpu -p no:cacheprovider --tb=short \
        -rfE --durations=10 tests/pallas_kernels/test_ragged_paged_attention_gpu.py \
        tests/pallas_kernels/test_ragged_paged_mla.py tests/pallas_kernels/test_gated_delta_rule.py \
        tests/pallas_kernels/test_batch_invariant_kernels.py tests/models/test_attention_backends.py \
        >"$OUT/tests.log" 2>&1
      echo "tests: exit $? at $(elapsed)" | tee -a "$OUT/session.log"
      tail -25 "$OUT/tests.log"
      ;;
    peer) bench peer "${PEER_S:-120}" --workloads single ttft --hf-requests 1 ;;
    batch) bench batch "${BATCH_S:-120}" --skip-hf --workloads sharegpt random --num-prompts 256 ;;
    profile) bench profile "${PROFILE_S:-90}" --skip-hf --workloads single --profile ;;
    cmdbuf)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL" \
        bench cmdbuf "${VARIANT_S:-90}" --skip-hf --workloads single
      ;;
    dslice)
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" \
        bench dslice "${VARIANT_S:-90}" --skip-hf --workloads single
      ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "session: done at $(elapsed)" | tee -a "$OUT/session.log"
