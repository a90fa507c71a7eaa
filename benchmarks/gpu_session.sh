# Issue 14's measurements on the GPU machine, in one call: each step writes its logs and JSON
# under $OUT/session/ (packed into $OUT/session.tgz at the end: the device tool brings back only
# a few files) and prints its key lines; a step that fails or runs out of time does not stop
# the next.
#
#   source .whl/p3/setup-device.sh && bash benchmarks/gpu_session.sh startup verify tests
#   bash benchmarks/gpu_session.sh "peers a,b" "attention"
#
# Steps: startup (pagedgen generate on $MODEL, default the 8B preset, with $BACKEND, default
# flash-attn; twice: cold, then warm), verify (--backend all, timed, twice), tests (pytest -m
# gpu; PYTEST_K selects), "peers W" (peers.py on workloads W with vLLM), attention (decode
# kernels on (a)'s and (c)'s shapes).
set -u
S=${OUT:-/tmp/out}/session
mkdir -p "$S"
timed() {  # timed NAME LIMIT CMD...: run with a time limit, log to $S/NAME.log; prints seconds
  local name=$1 limit=$2 t0=$EPOCHREALTIME rc; shift 2
  timeout "$limit" "$@" > "$S/$name.log" 2>&1; rc=$?
  echo "$name: $(python3 -c "print(f'{$EPOCHREALTIME - $t0:.1f}')") s, exit $rc"
}

for step in "$@"; do
  case $step in
    startup)
      for run in cold warm; do
        timed "startup-$run" 240 pagedgen generate samples/prompts.jsonl \
          --model "${MODEL:-llama-3-8b}" --backend "${BACKEND:-flash-attn}" --json \
          -o "/tmp/startup-$run.jsonl"
        python3 -c "import json, sys; t = open(sys.argv[1]).read(); d = json.loads(t[t.index('{'):])
parts = {k: round(v, 2) for k, v in d['startup_breakdown_s'].items()}
print(sys.argv[2], round(d['startup_s'], 1), parts)" "$S/startup-$run.log" "$run" \
          || tail -3 "$S/startup-$run.log"
      done ;;
    verify)
      for run in cold warm; do
        timed "verify-$run" 400 pagedgen verify --backend all --json "$S/verify-$run.json"
        tail -1 "$S/verify-$run.log"
      done ;;
    tests)
      timed gpu-tests 550 python3 -m pytest -m gpu -q ${PYTEST_K:+-k "$PYTEST_K"}
      tail -3 "$S/gpu-tests.log" ;;
    peers\ *)
      w=${step#peers }
      timed "peers-${w//,/}" 580 python3 benchmarks/peers.py --workloads "$w" \
        --backends flash-attn,flashinfer --peers vllm --repeats 3 \
        --json "$S/h100-peers-vllm-${w//,/}.json"
      grep -E "^│" "$S/peers-${w//,/}.log" | cut -c1-120 ;;
    attention)
      timed attention-a 120 python3 benchmarks/attention_kernels.py --page-sizes 0 \
        --backends flash-attn,flashinfer,triton --heads 32/8 \
        --shapes decode:256x704,decode:64x704 --json "$S/attention-a.json"
      timed attention-c 120 python3 benchmarks/attention_kernels.py --page-sizes 0 \
        --backends flash-attn,flashinfer,triton --heads 16/8 \
        --shapes decode:256x1100,decode:64x1100 --json "$S/attention-c.json"
      grep -h '^{' "$S"/attention-*.log | cut -c1-150 ;;
    *) echo "unknown step '$step'" ;;
  esac
done
tar czf "${OUT:-/tmp/out}/session.tgz" -C "$S" . && echo "logs: session.tgz"
