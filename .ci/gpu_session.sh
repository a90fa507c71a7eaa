# Measurements on the GPU machine in one call: runs the named steps of .ci/gpu_steps.yaml (what
# each measures, its time limit, its command, its report), each logged under $OUT/session/ and
# packed into $OUT/session.tgz at the end (the device tool brings back only a few files); a step
# that fails or runs out of time does not stop the next. Settings come from the environment
# (each step's `about` names them).
#
#   source .whl/p3/setup-device.sh && bash .ci/gpu_session.sh tests verify
#   WORKLOADS=t PEERS_ARGS="--quantization fp8 --set kv_cache_dtype=fp8" bash .ci/gpu_session.sh peers
#   bash .ci/gpu_session.sh list        # the steps and what they measure
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STEPS=${GPU_STEPS:-$HERE/gpu_steps.yaml}  # another steps file: the tests'
export OUT=${OUT:-/tmp/out}
export S=$OUT/session
export FA4_CACHE=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/$(whoami)/flash_attention_cute_dsl_cache}
mkdir -p "$S"

step_fields() {  # step_fields STEP: its fields as shell assignments (run, limit, gpus,
  # report, reads), read from the steps file in one pass
  python3 - "$STEPS" "$1" <<'PY'
import shlex, sys, yaml
steps, name = yaml.safe_load(open(sys.argv[1])), sys.argv[2]
if name not in steps:
    sys.exit(f"unknown step '{name}' (steps: {', '.join(steps)})")
step = {"limit": 300, "gpus": 1, "report": "", "reads": "", **steps[name]}
print("; ".join(f"{k}={shlex.quote(str(step[k]))}"
                for k in ("run", "limit", "gpus", "report", "reads")))
PY
}

list_steps() {
  python3 - "$STEPS" <<'PY'
import sys, yaml
for name, step in yaml.safe_load(open(sys.argv[1])).items():
    print(f"{name:18} {' '.join(str(step['about']).split())}")
PY
}

caches() {  # how many kernels FA4's disk cache and FlashInfer's JIT cache hold
  echo "FA4 $(find "$FA4_CACHE" -name '*.o' 2>/dev/null | wc -l) kernels," \
    "FlashInfer $(find /tmp/fiws/.cache -name '*.so' 2>/dev/null | wc -l) modules"
}

run_step() {  # run_step NAME: its command under its time limit, then its report
  local name=$1 fields run limit gpus have report reads t0=$SECONDS rc
  fields=$(step_fields "$name") || return 1
  eval "$fields"
  have=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  if [ "$have" -lt "$gpus" ]; then
    echo "== $name: skipped (needs $gpus GPU(s), this machine has $have)"
    return 0
  fi
  echo "== $name ($(caches))"
  timeout "$limit" bash -c "$run" > "$S/$name.log" 2>&1
  rc=$?
  echo "$name: $((SECONDS - t0)) s, exit $rc$([ $rc = 124 ] && echo " (its limit, $limit s)")"
  if [ -n "$report" ]; then
    # shellcheck disable=SC2086  # the file list splits on spaces, its variables expand here
    python3 -m benchmarks.session_report "$report" $(eval echo "$reads")
  else
    grep -v '^\s*$' "$S/$name.log" | tail -"${TAIL:-15}" | cut -c1-250
  fi
}

[ $# -gt 0 ] || set -- list
for step in "$@"; do
  if [ "$step" = list ]; then list_steps; else run_step "$step"; fi
done
[ "$*" = list ] || { tar czf "$OUT/session.tgz" -C "$S" . && echo "logs: session.tgz"; }
