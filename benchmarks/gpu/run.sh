#!/usr/bin/env bash
# The GPU run: the GPU tests, then the benchmark against transformers; the table comes last
# and the logs land in $OUT (default benchmarks/gpu/logs).
#
#   bash benchmarks/gpu/run.sh                        # on a CUDA GPU: tests + Llama-3.1-8B
#   bash benchmarks/gpu/run.sh --model llama-3.2-1b   # other arguments go to bench.py
#   bash benchmarks/gpu/run.sh --dry-run              # a tiny config on any device (the CPU)
#   SKIP_TESTS=1 bash benchmarks/gpu/run.sh ...       # the benchmark alone
#
# Wheels of packages the machine lacks can sit in .whl/, the tests' tokenizer in .tok/ (env.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/gpu/logs}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
source benchmarks/gpu/env.sh
"$PY" -c "import jax, flax; print('JAX', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  2>&1 | tee "$OUT/devices.log" || exit 1

status=0
if [ -z "${SKIP_TESTS:-}" ] && [[ " $* " != *" --dry-run "* ]]; then
  "$PY" -m pytest -q -m gpu -p no:cacheprovider -rA \
    tests/pallas_kernels/test_ragged_paged_attention_gpu.py \
    tests/pallas_kernels/test_ragged_paged_mla.py tests/pallas_kernels/test_gated_delta_rule.py \
    tests/pallas_kernels/test_batch_invariant_kernels.py \
    tests/models/test_attention_backends.py 2>&1 | tee "$OUT/tests.log"
  status=${PIPESTATUS[0]}
fi
"$PY" benchmarks/gpu/bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || echo "GPU tests failed (exit $status): $OUT/tests.log"
exit $((status || bench))
