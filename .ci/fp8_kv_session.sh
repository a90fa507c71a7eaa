# Issue 94 part 2 (FP8 KV at the speed of the fastest kernel) on the GPU machine: each step
# prints its key lines and leaves its JSON under $OUT; a step that fails does not stop the next.
# FlashInfer's wheels alone suffice (`stage-wheels.sh flashinfer`: one part):
#
#   source .whl/p1/setup-device.sh && bash .ci/fp8_kv_session.sh tests e2e save-cache
#   bash .ci/fp8_kv_session.sh kernels e2e-triton g
#
# tests: the FP8-KV GPU tests (XQA and the tensor-core decode against eager, CUDA graphs,
# Triton's FP8 kernels, FP8 weights with an FP8 cache; TESTS_LIMIT seconds). kernels: decode
# kernels over FP8 and bf16 caches on workload t's decode shapes. e2e: workload t (512 x 1,000
# / 1,000, FP8 weights and KV) through flashinfer with each FP8 decode kernel (E2E_DECODES,
# default "xqa fa2"; E2E_REPEATS runs, default 2); e2e-triton: the same through triton. long:
# LONG_WORKLOADS (default f) at pagedgen's defaults. g: gpt-oss-120b at pagedgen's defaults
# (G_REPEATS runs, default 1). save-cache: FlashInfer's JIT cache to $OUT/flashinfer-cache.tgz.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
keys() { grep -E '^\{' | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
           if k in ("backend", "system", "batch", "context", "page", "kv_cache_dtype",
                    "decode_kernel", "ms", "GB_s", "output_tokens_per_s", "wall_time_s",
                    "runs_output_tokens_per_s", "max_num_seqs", "decode_step_ms",
                    "startup_breakdown_s", "kernel_compile_at_startup_s", "checksum",
                    "preemptions", "kv_cache_bytes", "kv_peak_tokens_held",
                    "graph_capture_s", "graphs_captured_in_run")})'; }
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)
      timeout "${TESTS_LIMIT:-330}" python3 -m pytest -m gpu -q -s -k fp8 tests/test_gpu_flashinfer.py \
        tests/test_triton.py tests/test_gpu_fp8.py tests/test_gpu_kv_reuse.py 2>&1 \
        | grep -E "passed|failed|PASS|FAIL|Error|fp8|skipped" | tail -25 ;;
    kernels)
      timeout 240 python3 -m benchmarks.attention_kernels --backends flashinfer,triton \
        --kv-cache-dtypes fp8 --flashinfer-decodes xqa,fa2 --iters 30 \
        --shapes decode:512x1000-2000,decode:64x4096,decode:8x8192 \
        --json "$OUT/fp8-kernels.json" 2>&1 | keys
      timeout 120 python3 -m benchmarks.attention_kernels --backends flash-attn,triton \
        --page-sizes 0 --iters 30 --shapes decode:512x1000-2000 \
        --json "$OUT/bf16-kernels.json" 2>&1 | keys ;;
    e2e)  # E2E_DECODES: flashinfer's FP8 decode kernels to run (default "xqa fa2")
      for d in ${E2E_DECODES-xqa fa2}; do
        PAGEDGEN_FLASHINFER_DECODE=$d timeout 250 python3 -m benchmarks.peers --workloads t \
          --backends flashinfer --peers "" --repeats "${E2E_REPEATS:-2}" --quantization fp8 \
          --set kv_cache_dtype=fp8 --json "$OUT/t-flashinfer-$d.json" 2>&1 | keys
      done ;;
    e2e-triton)
      timeout 200 python3 -m benchmarks.peers --workloads t --backends triton --peers "" \
        --repeats 1 --quantization fp8 --set kv_cache_dtype=fp8 \
        --json "$OUT/t-triton.json" 2>&1 | keys ;;
    long)  # workload f (Gemma-3-12B, 8k-30k prompts) at pagedgen's defaults: KV groups
      timeout 300 python3 -m benchmarks.peers --workloads "${LONG_WORKLOADS:-f}" \
        --backends default --peers "" --repeats 1 --json "$OUT/long.json" 2>&1 | keys ;;
    g)  # gpt-oss-120b (workload g) at pagedgen's defaults: start-up phases, throughput
      timeout 300 python3 -m benchmarks.peers --workloads g --backends default --peers "" \
        --repeats "${G_REPEATS:-1}" --json "$OUT/g.json" 2>&1 | keys ;;
    save-cache)
      tar czf "$OUT/flashinfer-cache.tgz" -C /tmp/fiws .cache && ls -la "$OUT" ;;
  esac
done
