#!/usr/bin/env bash
# The engine's CUDA check in one command per lent machine (issue 48, item 3), run on the GPU machine
# after ../shared/gpu/README.md's first call (it stages part00 on that machine), with .gpu/p2, .gpu/whl and
# .gpu/setup.sh carried:
#   bash bench/gpu_check.sh tests   # the engine's exactness files in ONE pytest process, to the end
#   bash bench/gpu_check.sh bench   # k3_decode at K3's depth (93 layers), every copy/defer/read-ahead case
#   bash bench/gpu_check.sh openai  # the openai exactness module
# Each phase fits one 10-minute call and prints a verdict line: "gpu_check PHASE: PASS|FAIL ...".
# Logs go to $OUT (the device tool brings them back) or to ./gpu_check_out.
set -uo pipefail
phase=${1:?usage: gpu_check.sh tests|bench|openai}
out=${OUT:-gpu_check_out}; mkdir -p "$out"
# shellcheck disable=SC1091
source .gpu/setup.sh || { echo "gpu_check $phase: FAIL (setup: stage part00 first)"; exit 1; }
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
case $phase in
  tests)
    files=(tests/unit/test_pool.py tests/unit/test_pool_faults.py tests/unit/test_memory.py
           tests/unit/test_pool_cycle.py tests/unit/test_speculate.py tests/unit/test_streamed_moe.py
           tests/unit/test_cuda_copier.py tests/functional/test_prefill_layer_major.py
           tests/functional/test_prefill_batched.py tests/unit/test_exactness_896.py)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" "${files[@]}" 2>&1 | tee "$out/tests.log"
    rc=${PIPESTATUS[0]}
    summary=$(grep -E '[0-9]+ (passed|failed)' "$out/tests.log" | tail -1)
    [[ $rc == 0 ]] && echo "gpu_check tests: PASS ($summary, one process)" \
                   || echo "gpu_check tests: FAIL rc=$rc ($summary)";;
  bench)
    python3 bench/k3_decode.py --layers 93 --experts 8 --top-k 4 --small 2GiB --dtype bfloat16 \
      --rounds "${ROUNDS:-2}" --tokens 6 --cases "${CASES:-resident,pc,pc-expertcopy,pc-defer,pc-ahead}" \
      2>&1 | tee "$out/bench.log"
    rc=${PIPESTATUS[0]}
    # The bar (issue 48): at K3's depth from the page cache, token <= 1.1x (raw read + resident token).
    grep -E '^pc[a-z-]* +host overhead' "$out/bench.log" | sed -E 's/ +host overhead.*token \/ \(raw read \+ resident token\) / bar: /'
    bar=$(grep -E '^pc +host overhead' "$out/bench.log" | sed -E 's/.*resident token\) ([0-9.]+).*/\1/')
    if [[ $rc != 0 || -z $bar ]]; then echo "gpu_check bench: FAIL rc=$rc"
    elif python3 -c "import sys; sys.exit(0 if float('$bar') <= 1.1 else 1)"; then
      echo "gpu_check bench: PASS (pc token / (raw read + resident token) = $bar <= 1.1)"
    else echo "gpu_check bench: FAIL (pc token / (raw read + resident token) = $bar > 1.1)"; fi;;
  openai)
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/functional/test_openai_exactness.py \
      2>&1 | tee "$out/openai.log"
    rc=${PIPESTATUS[0]}
    [[ $rc == 0 ]] && echo "gpu_check openai: PASS" || echo "gpu_check openai: FAIL rc=$rc";;
  *) echo "usage: gpu_check.sh tests|bench|openai"; exit 2;;
esac
