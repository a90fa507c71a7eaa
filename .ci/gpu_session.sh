# Issue 14's measurements on the GPU machine, in one call: each step writes its logs and JSON
# under $OUT/session/ (packed into $OUT/session.tgz at the end: the device tool brings back only
# a few files) and prints its key lines; a step that fails or runs out of time does not stop
# the next.
#
#   source .whl/p3/setup-device.sh && bash .ci/gpu_session.sh startup verify tests
#   bash .ci/gpu_session.sh "peers a,b" "attention"
#
# Steps: startup (pagedgen generate on $MODEL, default the 8B preset, with $BACKEND, default
# flash-attn; twice: cold, then warm), verify (--backend all, timed, twice), tests (pytest -m
# gpu; PYTEST_K selects, TESTS_FILES: these files only, TESTS_LIMIT seconds; TESTS_FILES_<GPU>
# and PYTEST_K_<GPU> where CUDA_VISIBLE_DEVICES=<GPU>), "peers W"
# (peers.py on workloads W with vLLM),
# attention (decode kernels on (a)'s and (c)'s shapes), tiles (FA4 decode tiles and page sizes
# on (a)-(c)'s decode shapes), profile and profile-c ((a)'s and (c)'s decode under
# torch.profiler), imports (startup under python -X importtime), save-caches (FlashInfer's and
# FA4's kernel caches to $OUT, in pieces), load-caches (those pieces, carried as .whl/caches).
# verify takes VERIFY_LIMIT (seconds per run, default 400) and VERIFY_RUNS (default "cold
# warm"); peers takes PEERS_BACKENDS, PEERS_PEERS (empty: none), FA4_TILES, PEERS_TAG,
# PEERS_LIMIT, PEERS_REPEATS, PEERS_QUANT (fp8: both systems quantize), PEERS_CASCADE_OFF
# (set: each backend also without cascade decode), PEERS_MIXED_CASCADE_OFF (set: also without
# it in steps that carry prefills), PEERS_MIXED_OFF (set: also with steps
# that carry prefills launched after the last step's tokens), PEERS_MIXED_EAGER (set: also
# with those steps eager, not in piecewise CUDA graphs), PEERS_GROUPING_OFF (set: also
# admitting requests in input order), PEERS_SET (one --set KEY=VALUE: an engine override for
# both systems' runs) from the environment.
# fp8-tiles (issue 32): each FP8 GEMM tile at FP8_TILES_M (FP8_TMA_TILES: more TMA tiles,
# fp8_gemm.py's --tma-tiles), and the MMA instructions of each.
# fp8 (issue 32): the FP8 GEMM benchmark, verify -q fp8 and the 8B preset's decode steps at
# batch 1, 64 and 256 under torch.profiler with FP8 weights, against the FP8 roofline.
# mixed (issue 34): benchmarks.mixed_steps on $MIXED_WORKLOAD (default s; MIXED_SYNC_OFF: the
# async run alone; MIXED_RUNS: async runs, the last reported).
# moe (issue 35): the MoE preset's decode steps under torch.profiler against its roofline;
# moe-layers (issue 59): one MoE layer's kernels, pagedgen's and vLLM's, bf16 and FP8;
# verify-models: `verify --model-only` of $VERIFY_MODELS through every backend.
# structured (issue 33): benchmarks.structured, 1,024 lines with ten JSON schemas against the
# same lines unconstrained, and vLLM on both (SmolLM2's tokenizer from .whl/smollm2-tok when
# carried; STRUCT_REPEATS, STRUCT_LIMIT, STRUCT_NO_VLLM, STRUCT_MIXED_OFF,
# STRUCT_POOL: structured.py's --pool-variants, STRUCT_SCHED_OFF: --mask-fill-schedule-off,
# STRUCT_TIMELINE: --timeline FIRST:STEPS, STRUCT_SET: one --set KEY=VALUE).
# tp-close (issue 62's last items: two-GPU tests, verify -tp 2, MoE by width and -ep);
# plans (issue 59: benchmarks/kernel_plans.py for this GPU kind, presets dealt over its GPUs;
# PLANS_MODELS, PLANS_QUANT, PLANS_TP, PLANS_LIMIT); first-runs (FIRST_WORKLOADS on empty
# kernel caches, twice, and vLLM; PEERS_QUANT, PEERS_BACKENDS, PEERS_PEERS, PEERS_LIMIT,
# PEERS_VLLM_WEIGHTS (default "dummy,normal": peers.py's --vllm-weights).
# tp, tp-runs, tp-vllm, tp-more, tp-new, tp-tests (issue 62, two GPUs; TP_BACKEND, default auto): the
# push all-reduce's tests and latency, 8B at tp 1 and 2 (profile, decode at batch 1 and 64,
# workload a, each all-reduce kind), vLLM at tp 2,
# 70B / FP8 / Qwen3-30B-A3B (also expert parallel) under tp 2 and -dp 2; tp-new: Qwen3.5-9B
# and gpt-oss-20b at tp 1 and 2 (and -ep); the two-GPU tests and verify -tp 2.
# stop (issue 58): workload a with and without a stop string, pagedgen on GPU 0, vLLM on 1.
# pair (issues 59-61, two GPUs or more): PAIR_RUNS (WORKLOAD:QUANT[:WEIGHTS] ...) through
# pagedgen on GPU 0 on empty kernel caches while vLLM runs them on GPU 1 (WEIGHTS, else
# PEERS_VLLM_WEIGHTS, "+" for ",": normal gives its first run on pagedgen's weight
# distribution), on four GPUs two pairs at once (runs dealt out); PAIR_AFTER: steps then on
# GPU 0 (GPU:STEP on another pair's pagedgen GPU). verify: VERIFY_MODEL (default tiny).
# quad (four GPUs): QUAD_RUNS' MoE plans measured afresh (GPUs 0-2 at once) and merged, then
# each run's first and second run on its GPU; vLLM on QUAD_VLLM on GPU 3; QUAD_AFTER: GPU:STEP
# pairs then. profile-models: PROFILE_MODELS' decode steps (PROFILE_BATCHES; PROFILE_QUANT: fp8
# weights) against the floor.
# run-kernels (issues 59-61, two GPUs): each of RUNK_RUNS (WORKLOAD:QUANT ...) whole and profiled
# in pagedgen (GPU 0) and vLLM (GPU 1) at once, kernel groups side by side (RUNK_LIMIT,
# RUNK_AFTER: steps then on GPU 0); vllm-only: vLLM alone on VLLM_WORKLOADS.
# gdn-kernels (issue 60): benchmarks/gdn_kernels.py, the decode kernel per launch shape.
# moe-align (issue 60): the MoE slot sort's ways alone, at decode and small-prefill counts.
# gdn (issue 60): the gated-delta GPU tests, a Qwen3.5 preset's decode against its floor, and
# workload h (GDN_MODEL, GDN_WORKLOADS, GDN_LIMIT, BACKEND); carry .whl/gdn (fla-core, einops:
# `.ci/stage_extra_wheels.sh` stages it and vLLM with its CuTe DSL) and source
# `.whl/gdn/setup-device.sh` after the last p part.
set -u
S=${OUT:-/tmp/out}/session
mkdir -p "$S"
FA4_CACHE=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/$(whoami)/flash_attention_cute_dsl_cache}
caches() {  # how many kernels FA4's disk cache holds, and FlashInfer's JIT modules
  echo "FA4 $(find "$FA4_CACHE" -name '*.o' 2>/dev/null | wc -l) kernels," \
    "FlashInfer $(find /tmp/fiws/.cache -name '*.so' 2>/dev/null | wc -l) modules" \
    "($(du -sm /tmp/fiws/.cache 2>/dev/null | cut -f1) MB)"
}
timed() {  # timed NAME LIMIT CMD...: run with a time limit, log to $S/NAME.log; prints seconds
  local name=$1 limit=$2 t0=$EPOCHREALTIME rc; shift 2
  timeout "$limit" "$@" > "$S/$name.log" 2>&1; rc=$?
  echo "$name: $(python3 -c "print(f'{$EPOCHREALTIME - $t0:.1f}')") s, exit $rc"
}
pin_cores() {  # pin_cores GPU: this shell and what it starts keep to GPU's share of the
  # host's cores (cores / GPUs, in order), as on a machine of its own; nothing without taskset
  local gpus per
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l); per=$(( $(nproc) / (gpus > 0 ? gpus : 1) ))
  [ "$per" -ge 2 ] && command -v taskset > /dev/null || return 0
  taskset -cp "$(($1 * per))-$(($1 * per + per - 1))" "$BASHPID" > /dev/null
}
VLLM_WEIGHTS=${PEERS_VLLM_WEIGHTS:-dummy,normal}  # peers.py's --vllm-weights for vLLM's rows
run_parts() {  # run_parts WORKLOAD:QUANT[:WEIGHTS]: sets w, q and vw (vLLM's weight sets:
  # WEIGHTS with + for a comma, else VLLM_WEIGHTS)
  IFS=: read -r w q vw <<< "$1"
  vw=${vw//+/,}; vw=${vw:-$VLLM_WEIGHTS}
}
vllm_run() {  # vllm_run WORKLOAD:QUANT[:WEIGHTS] GPU: vLLM cold (its own process, empty
  # caches), twice for each weight set
  local w q vw; run_parts "$1"
  timed "vllm-$w-$q" "${PAIR_LIMIT:-330}" env CUDA_VISIBLE_DEVICES=$2 \
    TRITON_CACHE_DIR="/tmp/fresh-vllm-$w-$q/triton" XDG_CACHE_HOME="/tmp/fresh-vllm-$w-$q/xdg" \
    python3 -m benchmarks.peers --workloads "$w" --backends "" --peers vllm --repeats 2 \
    --vllm-weights "$vw" \
    $([ "$q" = fp8 ] && echo "--quantization fp8") --json "$S/vllm-$w-$q.json"
}
fresh_caches() {  # fresh_caches NAME: the env of a fresh machine's empty kernel caches
  echo TRITON_CACHE_DIR="/tmp/fresh-$1/triton" XDG_CACHE_HOME="/tmp/fresh-$1/xdg" \
    FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="/tmp/fresh-$1/fa4"
}
first_run() {  # first_run WORKLOAD:QUANT[:WEIGHTS] GPU: pagedgen at its defaults on empty
  # kernel caches (a fresh machine's first run, plans only as shipped), then a second run in
  # that process
  local w q vw; run_parts "$1"
  timed "first-$w-$q" "${PAIR_LIMIT:-330}" env CUDA_VISIBLE_DEVICES=$2 $(fresh_caches "$w-$q") \
    python3 -m benchmarks.peers --workloads "$w" --backends default --peers "" \
    --repeats 2 $([ "$q" = fp8 ] && echo "--quantization fp8") --json "$S/first-$w-$q.json"
}
profile_model() {  # profile_model MODEL LIMIT BATCHES: decode steps under torch.profiler
  # against the model's floor, and the decode kernels by group ($BACKEND, default triton;
  # $PROFILE_QUANT: its weights' format, in the run's name)
  local m=$1 run=profile-$1${PROFILE_QUANT:+-$PROFILE_QUANT}
  timed "$run" "$2" pagedgen profile --model "$m" --backend "${BACKEND:-triton}" \
    --batch-sizes "$3" --prompt-len 1024 --output-len 24 --output-dir "/tmp/$run" \
    ${PROFILE_QUANT:+-q "$PROFILE_QUANT"}
  cp "/tmp/$run/profile.json" "$S/$run.json" 2>/dev/null
  python3 - "$S/$run.json" <<'PY' || tail -5 "$S/$run.log"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    for b in r["batches"]:
        print("batch", b["batch"], "prefill tok/s", round(b["prefill_tok_s"]), "step ms",
              round(b["step_ms_p50"], 3), "floor ms", round(b.get("decode_roofline_ms", 0), 3),
              "of floor", round(b.get("decode_roofline_fraction", 0), 2))
    print({g: round(v) for g, v in r["phases"]["decode"]["groups_us"].items() if v})
    print({k: round(v, 3) for k, v in r.get("roofline", {}).items() if isinstance(v, float)})
PY
}
pair_report() {  # pair_report WORKLOAD:QUANT...: each run's pagedgen and vLLM rows, and ratios
  python3 - "$S" "$@" <<'PY'
import json, sys
from pathlib import Path
for run in sys.argv[2:]:
    w, q = run.split(":")[:2]
    rows = {}
    for who in ("first", "vllm"):
        f = Path(sys.argv[1]) / f"{who}-{w}-{q}.json"
        rows[who] = json.loads(f.read_text())["rows"] if f.exists() else []
    for r in rows["first"] + rows["vllm"]:
        print(w, q, r["system"], "runs tok/s", [round(x) for x in r.get("runs_output_tokens_per_s", [])],
              "start-up", round(r.get("startup_s") or r.get("load_time_s") or 0, 1),
              "prefill tok/s", round(r.get("prefill_tokens_per_s") or 0), r.get("kernel_plans", ""),
              "distinct tokens", r.get("distinct_tokens_mid"), r.get("distinct_tokens_all"))
        for line in r.get("kernel_lines", []):  # what vLLM says it chose
            print("   vLLM:", line[:200])
        for i, d in enumerate(r.get("runs_detail", [])):  # where the first run loses
            print(f"   run {i + 1}", {k: round(v, 3) if isinstance(v, float) else v
                                      for k, v in d.items()})
        if "startup_breakdown_s" in r:
            print("   start-up phases", {k: round(v, 1) for k, v in r["startup_breakdown_s"].items()})
        if "runs_kernels_compiled" in r:  # Triton kernels made inside each run (jit_monitor)
            print("   kernels made in each run", r["runs_kernels_compiled"],
                  [round(x, 1) for x in r["runs_kernel_compile_s"]], "s; slowest in the first:",
                  r.get("first_run_slowest_compiles", ""))
            for name, t in r.get("first_run_compiles_s", {}).items():
                print(f"     {t:6.2f} s  {name[:180]}")
    if rows["first"] and rows["vllm"]:
        ours, peer = rows["first"][0], rows["vllm"][0]
        print(w, q, "pagedgen / vLLM: median", round(ours["output_tokens_per_s"] / peer["output_tokens_per_s"], 3),
              "first runs", round(ours["runs_output_tokens_per_s"][0] / peer["runs_output_tokens_per_s"][0], 3))
PY
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
    imports)
      # the startup step under python -X importtime: where "imports and input" goes
      for run in cold warm; do
        timed "imports-$run" 240 python3 -X importtime -m pagedgen.cli.main generate \
          samples/prompts.jsonl --model "${MODEL:-llama-3-8b}" --backend "${BACKEND:-flash-attn}" \
          --json -o "/tmp/imports-$run.jsonl"
        python3 - "$S/imports-$run.log" "$run" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
top, nested = [], []
for m in re.finditer(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", text):
    row = (int(m[2]) / 1e6, m[4])
    (top if len(m[3]) == 1 else nested).append(row)
d = json.loads(text[text.index("\n{") + 1:text.rindex("}") + 1])
print(sys.argv[2], "startup", round(d["startup_s"], 2),
      {k: round(v, 2) for k, v in d["startup_breakdown_s"].items()})
print("  top-level imports (s):", [(round(t, 2), n) for t, n in sorted(top, reverse=True)[:12]])
print("  heaviest nested:", [(round(t, 2), n) for t, n in sorted(nested, reverse=True)[:10]])
PY
      done ;;
    verify)
      # each row's seconds are in the JSON (and the tables); the kernel caches' sizes say how
      # much each run compiled
      for run in ${VERIFY_RUNS:-cold warm}; do
        echo "before $run: $(caches)"
        timed "verify-$run" "${VERIFY_LIMIT:-400}" pagedgen verify --backend all \
          --model "${VERIFY_MODEL:-tiny}" --json "$S/verify-$run.json"
        tail -1 "$S/verify-$run.log"
        python3 -c "import json, sys
for b in json.load(open(sys.argv[1]))['backends']:
    rows = sorted(b['rows'], key=lambda r: -r['seconds'])
    print(b['backend'], round(sum(r['seconds'] for r in rows)), 's in tasks:',
          [(r['group'], round(r['seconds'])) for r in rows[:4]])" "$S/verify-$run.json" \
          2>/dev/null
      done
      echo "after: $(caches)" ;;
    save-caches)
      # FlashInfer's JIT cache and FA4's kernel cache for the next machine, in pieces of 15 MiB
      # (a file over 16 MiB does not come back; at most 8 files do, the session folder's logs
      # included: run it with few other steps). Here: copy the pieces to .whl/caches/ and carry
      # that folder alone, before the last part: load-caches unpacks it.
      o=${OUT:-/tmp/out}
      tar czf - -C /tmp/fiws .cache | split -b 15m - "$o/fi-cache.tgz."
      tar czf - -C "$FA4_CACHE" . | split -b 15m - "$o/fa4-cache.tgz."
      echo "$(caches); saved: $(cd "$o" && du -shc ./*-cache.tgz.* | tail -1 | cut -f1) in" \
        "$(ls "$o" | grep -c -- '-cache.tgz.') pieces" ;;
    load-caches)
      # the pieces save-caches wrote, carried as .whl/caches: FlashInfer's cache into /tmp/fiws
      # (the last part's setup then keeps it) and FA4's into its cache folder
      mkdir -p /tmp/fiws "$FA4_CACHE"
      ls .whl/caches/fi-cache.tgz.* > /dev/null 2>&1 \
        && cat .whl/caches/fi-cache.tgz.* | tar xzf - -C /tmp/fiws
      ls .whl/caches/fa4-cache.tgz.* > /dev/null 2>&1 \
        && cat .whl/caches/fa4-cache.tgz.* | tar xzf - -C "$FA4_CACHE"
      echo "loaded: $(caches)" ;;
    fp8)
      timed fp8-gemm 200 python3 -m benchmarks.fp8_gemm --json "$S/fp8-gemm.json"
      grep -E "^│" "$S/fp8-gemm.log" | cut -c1-250
      timed fp8-verify 300 pagedgen verify --backend flash-attn -q fp8 -o "$S/fp8-verify.json"
      grep -E "fp8|PASS|FAIL" "$S/fp8-verify.log" | cut -c1-200
      for q in fp8 none; do
        timed "fp8-profile-$q" 200 pagedgen profile --model llama-3-8b --backend flash-attn \
          --batch-sizes 1,64,256 --prompt-len 512 --output-len 24 \
          $([ "$q" = fp8 ] && echo "-q fp8") \
          --output-dir "$S/profile-$q"
        python3 - "$S/profile-$q/profile.json" "$q" <<'PY' || tail -3 "$S/fp8-profile-$q.log"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    for b in r["batches"]:
        print(sys.argv[2], "batch", b["batch"], "step ms", round(b["step_ms_p50"], 3),
              "roofline ms", round(b.get("decode_roofline_ms", 0), 3),
              "of roofline", round(b.get("decode_roofline_fraction", 0), 2))
    print(sys.argv[2], {k: round(v, 2) if isinstance(v, float) else v
                        for k, v in r.get("roofline", {}).items()})
PY
      done ;;
    fp8-tiles)
      # every FP8 GEMM kernel and tile at FP8_TILES_M (default decode's and prefill's M), the
      # fastest of each kind against bf16 and the plan's choice, and the MMA instructions
      timed fp8-tiles 400 python3 -m benchmarks.fp8_gemm --every-tile \
        --m "${FP8_TILES_M:-1,16,64,128,256,1024,8192}" --tma-tiles "${FP8_TMA_TILES:-}" \
        --json "$S/fp8-tiles.json"
      python3 - "$S/fp8-tiles.json" <<'PY' || tail -5 "$S/fp8-tiles.log"
import json, sys
d = json.load(open(sys.argv[1]))
for name, mma in d["meta"].get("mma", {}).items():
    print(name, "|", mma)
for r in d["rows"]:
    kinds = {k[:-3]: v for k, v in r.items() if k.endswith("_us") and "/" not in k}
    tiles = sorted((v, k[:-3]) for k, v in r.items() if k.endswith("_us") and "/" in k)
    print("M", r["M"], {k: round(v, 1) for k, v in kinds.items()}, "plan", r["plan"],
          f"{r['plan_weight_TBps']:.2f} TB/s;", "fastest tiles",
          [(t, round(v, 1)) for v, t in tiles[:4]])
PY
      ;;
    mixed)
      # issue 34: where workload $MIXED_WORKLOAD's (default s) steps go, by kind and size, with
      # their kernels and host time; MIXED_SET: engine overrides (e.g. mixed_step_graphs=true)
      w=${MIXED_WORKLOAD:-s}
      timed "mixed-steps-$w" "${MIXED_LIMIT:-400}" python3 -m benchmarks.mixed_steps \
        --workload "$w" ${MIXED_SET:+--set "$MIXED_SET"} ${MIXED_SYNC_OFF:+--sync-off} --async-runs "${MIXED_RUNS:-1}" \
        --json "$S/mixed-steps-$w.json"
      python3 - "$S/mixed-steps-$w.json" <<'PY' || tail -5 "$S/mixed-steps-$w.log"
import json, sys
d = json.load(open(sys.argv[1]))
s, a = d.get("synchronous", {}), d["asynchronous"]
for b in s.get("buckets", []):
    print("prefill tokens", b["prefill_tokens"], b["steps"], "steps", round(b["mean_ms"], 1), "ms")
p = s.get("profiled", {})
for kind in ("mixed", "decode"):
    if kind in p:
        print(kind, "GPU ms/step", round(p[kind]["gpu_ms_per_step"], 2), "wall",
              round(p["wall_ms_per_step"][kind], 2))
for b in a.get("step_calls", []):
    print("async: prefill tokens", b["prefill_tokens"], b["steps"], "steps,", round(b["total_s"], 2),
          "s,", round(b["mean_ms"], 1), "ms a call")
w = a["profiled_window"]
print("async wall", round(a["wall_s"], 2), "s; window", w.get("steps"), "steps, GPU span",
      round(w.get("gpu_span_ms", 0)), "ms, busy", w.get("gpu_busy_fraction"), "; step call ms",
      w.get("step_call_ms"))
for kind, k in w.get("by_kind", {}).items():
    n = max(1, k["steps"])
    print(" ", kind, k["steps"], "steps; per step ms: busy", round(k["busy_ms"] / n, 2),
          "idle before", round(k["idle_before_ms"] / n, 2), "idle inside",
          round(k["idle_inside_ms"] / n, 2))
    print("   ms a step by group", {g: round(v, 2) for g, v in k.get("groups_ms", {}).items()})
    print("   top", [(n_, round(v, 2)) for n_, v in k.get("top_ms", [])])
PY
      ;;
    moe)
      # issue 35: the MoE preset's decode steps at batch 1, 64, 256 under torch.profiler
      # against the active-parameter roofline ($MOE_MODEL, default qwen3-30b-a3b)
      m=${MOE_MODEL:-qwen3-30b-a3b}
      timed "moe-profile-$m" "${MOE_LIMIT:-300}" pagedgen profile --model "$m" \
        --backend flash-attn --batch-sizes 1,64,256 --prompt-len 512 --output-len 24 \
        --output-dir "$S/profile-$m"
      python3 - "$S/profile-$m/profile.json" <<'PY' || tail -5 "$S/moe-profile-$m.log"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    for b in r["batches"]:
        print("batch", b["batch"], "step ms", round(b["step_ms_p50"], 3),
              "roofline ms", round(b.get("decode_roofline_ms", 0), 3),
              "of roofline", round(b.get("decode_roofline_fraction", 0), 2))
    print({g: round(v) for g, v in r["phases"]["decode"]["groups_us"].items() if v})
    print({k: round(v, 3) for k, v in r.get("roofline", {}).items() if isinstance(v, float)})
PY
      ;;
    moe-layers)  # issue 59: one MoE layer's kernels alone at each token count, pagedgen's
      # against vLLM's Triton experts in bf16 and FP8 (benchmarks/moe_kernels.py; vLLM in a
      # process of its own), each against the weight-read floor
      timed moe-layers "${MOE_LIMIT:-400}" python3 -m benchmarks.moe_kernels \
        --json "$S/moe-layers.json"
      python3 - "$S/moe-layers.json" <<'PY' || tail -5 "$S/moe-layers.log"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["shape"], r["tokens"], "bf16 ms", round(r["total"], 3), "vLLM", round(r.get("vllm", 0), 3),
          "fp8 ms", round(r["fp8"], 3), "vLLM", round(r.get("vllm_fp8", 0), 3),
          "floors", round(r["roofline_ms"], 3), round(r["fp8_roofline_ms"], 3), r["tiles"], r["fp8_mode"],
          {k: round(r[k], 4) for k in ("align", "align_torch", "slot_sum", "slot_sum_torch") if k in r})
print("vLLM:", d["vllm"]) if d["vllm"] else None
PY
      ;;
    long-kernels)  # issue 60: the long-prompt workloads' kernels (k, l): FA4's paged prefill
      # at head size 256 by tile (pagedgen's default, FA4's own) on a chunk after 0-13.6k
      # cached tokens, and at 128; decode at 256 by tile; the convolution by tile
      a="python3 -m benchmarks.attention_kernels --backends flash-attn --page-sizes 64 --iters 5"
      timed attn-256 "${LONG_LIMIT:-120}" $a --head-dim 256 --heads 16/2,16/4 \
        --fa4-prefill-tiles default,fa4 --fa4-decode-tiles fa4,64x64 \
        --shapes prefill:1x16384-30000,decode:32x8192-30000 --json "$S/attn-256.json"
      timed attn-128 60 $a --heads 32/8 --fa4-prefill-tiles fa4,128x64 \
        --shapes prefill:1x16384-30000 --json "$S/attn-128.json"
      grep -hE '^\{' "$S"/attn-256.log "$S"/attn-128.log | cut -c1-260
      timed conv-tiles 120 python3 -m benchmarks.gdn_kernels --conv --json "$S/conv-tiles.json"
      grep -E '^\{' "$S/conv-tiles.log" | grep -v "decode 256" | cut -c1-200 ;;
    moe-align)  # issue 60: the slot sort's ways alone (benchmarks/moe_kernels.py --align)
      timed moe-align "${MOE_LIMIT:-150}" python3 -m benchmarks.moe_kernels --align \
        --json "$S/moe-align.json"
      grep -E '^\{' "$S/moe-align.log" | cut -c1-300 ;;
    verify-models)
      # model-level verify rows of the presets in $VERIFY_MODELS through every backend
      for m in ${VERIFY_MODELS:-gemma-3-12b phi-4}; do
        timed "verify-$m" "${VERIFY_LIMIT:-280}" pagedgen verify --backend all --model "$m" \
          --model-only --json "$S/verify-$m.json"
        grep -E "PASS|FAIL|skipped|passed|failed" "$S/verify-$m.log" | cut -c1-160 | tail -14
      done ;;
    structured)
      tok=""; [ -d .whl/smollm2-tok ] && tok="--tokenizer .whl/smollm2-tok"
      timed structured "${STRUCT_LIMIT:-560}" python3 -m benchmarks.structured $tok \
        --repeats "${STRUCT_REPEATS:-1}" ${STRUCT_NO_VLLM:+--no-vllm} \
        ${STRUCT_MIXED_OFF:+--mixed-ahead-off} ${STRUCT_SCHED_OFF:+--mask-fill-schedule-off} \
        ${STRUCT_POOL:+--pool-variants "$STRUCT_POOL"} ${STRUCT_TIMELINE:+--timeline "$STRUCT_TIMELINE"} \
        ${STRUCT_SET:+--set "$STRUCT_SET"} \
        --json "$S/h100-structured.json"
      grep -E "tok/s, |^pagedgen:|^vLLM|^timeline" "$S/structured.log" | cut -c1-400 ;;
    tests)  # TESTS_FILES_<GPU> / PYTEST_K_<GPU>: this GPU's own (PAIR_AFTER's GPU:tests)
      g=${CUDA_VISIBLE_DEVICES:-x}; g=${g//,/_}; files=TESTS_FILES_$g; k=PYTEST_K_$g
      files=${!files:-${TESTS_FILES:-}}; k=${!k:-${PYTEST_K:-}}
      log=gpu-tests${CUDA_VISIBLE_DEVICES:+-$g}
      timed "$log" "${TESTS_LIMIT:-550}" python3 -m pytest $files -m gpu -v \
        --durations=6 ${k:+-k "$k"}
      grep -E "PASSED|FAILED|ERROR" "$S/$log.log" | sed -E 's/ +\[ *[0-9]+%\]//' | cut -c1-150
      tail -12 "$S/$log.log" | grep -vE "PASSED|FAILED" ;;
    peers\ *)
      w=${step#peers }
      tag=${w//,/}${PEERS_TAG:-}
      timed "peers-$tag" "${PEERS_LIMIT:-580}" python3 -m benchmarks.peers --workloads "$w" \
        --backends "${PEERS_BACKENDS:-flash-attn,flashinfer}" --peers "${PEERS_PEERS-vllm}" \
        --repeats "${PEERS_REPEATS:-3}" --fa4-decode-tiles "${FA4_TILES:-}" \
        ${PEERS_QUANT:+--quantization "$PEERS_QUANT"} ${PEERS_CASCADE_OFF:+--cascade-off} \
        ${PEERS_MIXED_CASCADE_OFF:+--mixed-cascade-off} \
        ${PEERS_MIXED_OFF:+--mixed-ahead-off} ${PEERS_MIXED_EAGER:+--mixed-eager} \
        ${PEERS_GROUPING_OFF:+--prefix-grouping-off} ${PEERS_SET:+--set "$PEERS_SET"} \
        --json "$S/h100-peers-$tag.json"
      grep -E "^│" "$S/peers-$tag.log" | cut -c1-150
      python3 - "$S/h100-peers-$tag.json" <<'PY' 2>/dev/null
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["workload"], r["system"], round(r["output_tokens_per_s"]), "tok/s",
          {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k.startswith(
              ("vs ", "cascade", "decode_kv", "steps", "decode_step", "mixed_graph", "wall"))})
PY
      ;;
    tiles)
      # FA4 decode tiles x page sizes against flashinfer and triton, on (a)/(b)'s and (c)'s
      # decode shapes with varied context lengths
      for h in "32/8 decode:256x129-1280,decode:64x2049-2176" "16/8 decode:256x100-2048,decode:64x100-2048"; do
        heads=${h% *} shapes=${h#* } n=${heads//\//-}
        timed "tiles-fa-$n" 200 python3 -m benchmarks.attention_kernels --backends flash-attn \
          --page-sizes 128,64 --fa4-decode-tiles fa4,64x128,64x64,128x64 --heads "$heads" \
          --shapes "$shapes" --json "$S/tiles-fa-$n.json"
        timed "tiles-ref-$n" 120 python3 -m benchmarks.attention_kernels \
          --backends flashinfer,triton --page-sizes 0 --heads "$heads" --shapes "$shapes" \
          --json "$S/tiles-ref-$n.json"
      done
      python3 -c "import json, glob
for f in sorted(glob.glob('$S/tiles-*.json')):
    for r in json.load(open(f)):
        print(r['heads'], r['batch'], r['context'], r['backend'], r['page'],
              r.get('fa4_decode_tile', '-'), f\"{r['ms']:.4f} ms {r['GB_s']:.0f} GB/s\",
              f\"{r['checksum']:.5f}\")" ;;
    profile|profile-c)
      # a decode step under torch.profiler at the workload's batch and mean decode context:
      # (a) Llama-3-8B at 256 x 704 (576 prompt + 128); profile-c: (c) Qwen3-0.6B at 256 and
      # 64 x 1100 (562 prompt + 281 output on average, long ones last)
      if [ "$step" = profile ]; then
        name=profile-a args=(--model llama-3-8b --batch-sizes 256 --prompt-len 704)
      else
        name=profile-c args=(--model qwen3-0.6b --batch-sizes 64,256 --prompt-len 1100)
      fi
      timed "$name" 240 pagedgen profile --backend flash-attn "${args[@]}" --output-len 16 \
        --measured-steps 8 --output-dir "$S/$name"
      rm -f "$S/$name"/trace-*.json
      python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
for r in d['results']:
    for b in r['batches']:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in b.items()})
    for ph, v in r['phases'].items():
        g = {k: round(us / 1000, 2) for k, us in sorted(v['groups_us'].items(), key=lambda x: -x[1])}
        t = v.get('gpu_time_us', v.get('cpu_time_us', 0))
        print(ph, round(t / 1000, 2), 'ms:', g)" "$S/$name/profile.json" \
        || tail -5 "$S/$name.log" ;;
    tp)  # issue 62: the push all-reduce's tests and latency; 8B tp 2 profiled with each kind
      timed tp-push-tests 240 python3 -m pytest -m gpu -q tests/test_gpu_tensor_parallel.py \
        -k "push or triton-graphs"
      tail -2 "$S/tp-push-tests.log"
      timed ar-latency 150 python3 -m benchmarks.all_reduce_latency --json "$S/ar-latency.json"
      grep -h "all-reduce" "$S/ar-latency.log"
      for kind in push one-shot; do
        timed "tp-profile-$kind" 150 python3 -m benchmarks.tensor_parallel --backend \
          "${TP_BACKEND:-auto}" --runs llama-3-8b:2 --batches 1,64 --skip decode,generate \
          --all-reduce "$kind" --dir "/tmp/tp-prof-$kind" --json "$S/tp-profile-$kind.json"
        grep -h "llama-3-8b" "$S/tp-profile-$kind.log" | cut -c1-300
      done ;;
    tp-runs)  # 8B at tp 1 and 2 as generate runs (decode b1/b64, workload a): push (fused and
      # not) against PyTorch's one-shot
      timed tp-8b 330 python3 -m benchmarks.tensor_parallel --backend "${TP_BACKEND:-auto}" \
        --runs llama-3-8b:1,llama-3-8b:2 --batches 1,64 --skip profile --json "$S/tp-8b.json"
      timed tp-oneshot 150 python3 -m benchmarks.tensor_parallel --backend "${TP_BACKEND:-auto}" \
        --runs llama-3-8b:2 --batches 1,64 --skip profile,generate --all-reduce one-shot \
        --dir /tmp/tp-bench-oneshot --json "$S/tp-oneshot.json"
      timed tp-unfused 150 python3 -m benchmarks.tensor_parallel --backend "${TP_BACKEND:-auto}" \
        --runs llama-3-8b:2 --batches 1,64 --skip profile,generate --unfused \
        --dir /tmp/tp-bench-unfused --json "$S/tp-unfused.json"
      grep -h "llama-3-8b" "$S"/tp-8b.log "$S"/tp-oneshot.log "$S"/tp-unfused.log | cut -c1-200 ;;
    tp-vllm)  # vLLM at tp 2 (TP_SAFE) on the same requests
      timed tp-vllm 580 python3 -m benchmarks.tensor_parallel --runs llama-3-8b:2 \
        --batches 1,64 --skip profile,decode,generate --vllm --json "$S/tp-vllm.json"
      grep -h "vLLM\|skipped" "$S/tp-vllm.log" | cut -c1-300 ;;
    tp-more)  # 70B at tp 2, FP8 under tp, MoE under tp, -dp 2 against one GPU
      timed tp-70b 300 python3 -m benchmarks.tensor_parallel --backend "${TP_BACKEND:-auto}" \
        --runs llama-3-70b:2 --batches 1 --skip profile --json "$S/tp-70b.json"
      timed tp-fp8 240 python3 -m benchmarks.tensor_parallel --backend "${TP_BACKEND:-auto}" \
        --runs llama-3-8b:1,llama-3-8b:2 --batches 1 --skip profile --quantization fp8 \
        --dir /tmp/tp-bench-fp8 --json "$S/tp-fp8.json"
      timed tp-moe 300 python3 -m benchmarks.tensor_parallel --backend "${TP_BACKEND:-auto}" \
        --runs qwen3-30b-a3b:1,qwen3-30b-a3b:2 --batches 1 --workload m --skip profile \
        --json "$S/tp-moe.json"
      timed tp-moe-ep 300 python3 -m benchmarks.tensor_parallel --backend "${TP_BACKEND:-auto}" \
        --runs qwen3-30b-a3b:2 --batches 1 --workload m --skip profile --expert-parallel \
        --dir /tmp/tp-bench-ep --json "$S/tp-moe-ep.json"
      timed dp 300 python3 -m benchmarks.replicas --workload a --backend "${TP_BACKEND:-auto}" \
        --replicas 2 --no-ray --repeat 4 --json "$S/dp.json"
      grep -h "llama-3\|qwen3\|tok/s" "$S"/tp-70b.log "$S"/tp-fp8.log "$S"/tp-moe.log "$S"/tp-moe-ep.log \
        "$S"/dp.log | cut -c1-200 ;;
    tp-new)  # this stop's untried two-GPU paths: a hybrid model and gpt-oss (MXFP4) at tp 1
      # and 2, gpt-oss with expert parallel (carry .whl/gdn for the hybrid's prefill kernels)
      timed tp-hybrid 300 python3 -m benchmarks.tensor_parallel --backend triton \
        --runs qwen3.5-9b:1,qwen3.5-9b:2 --batches 1,64 --workload h --skip profile \
        --dir /tmp/tp-bench-hybrid --json "$S/tp-hybrid.json"
      timed tp-oss 300 python3 -m benchmarks.tensor_parallel --backend triton \
        --runs gpt-oss-20b:1,gpt-oss-20b:2 --batches 1,64 --workload o --skip profile \
        --dir /tmp/tp-bench-oss --json "$S/tp-oss.json"
      timed tp-oss-ep 200 python3 -m benchmarks.tensor_parallel --backend triton \
        --runs gpt-oss-20b:2 --batches 1,64 --workload o --skip profile --expert-parallel \
        --dir /tmp/tp-bench-oss-ep --json "$S/tp-oss-ep.json"
      grep -h "qwen3.5\|gpt-oss" "$S"/tp-hybrid.log "$S"/tp-oss.log "$S"/tp-oss-ep.log \
        | cut -c1-200 ;;
    tp-tests)  # the two-GPU tests and verify -tp 2 (and FP8 under tp, in its own folder)
      timed tp-fp8 240 python3 -m benchmarks.tensor_parallel --backend "${TP_BACKEND:-auto}" \
        --runs llama-3-8b:1,llama-3-8b:2 --batches 1 --skip profile --quantization fp8 \
        --dir /tmp/tp-bench-fp8 --json "$S/tp-fp8.json"
      grep -h "llama-3" "$S"/tp-fp8.log | cut -c1-200
      timed tp-pytest 300 python3 -m pytest -m gpu -q tests/test_gpu_tensor_parallel.py
      timed gpu-misc 200 python3 -m pytest -m gpu -q tests/test_gpu_structured.py \
        tests/test_gpu_logprobs.py tests/test_gpu_backends.py
      tail -2 "$S/gpu-misc.log"
      timed tp-verify 240 pagedgen verify --backend "${VERIFY_BACKEND:-flash-attn}" -tp 2 \
        --model-only --json "$S/tp-verify.json"
      tail -3 "$S/tp-pytest.log"; grep -h "PASS\|FAIL\|tensor parallel" "$S/tp-verify.log" ;;
    stop)  # issue 58: workload a with a stop string that never matches, vLLM on GPU 1
      CUDA_VISIBLE_DEVICES=1 timeout 560 python3 -m benchmarks.stop_strings --gpu \
        --system vllm --json "$S/stop-vllm.json" > "$S/stop-vllm.log" 2>&1 &
      timed stop-pagedgen 300 env CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.stop_strings --gpu \
        --system pagedgen --json "$S/stop-pagedgen.json"
      wait
      grep -h '^{' "$S"/stop-*.log | cut -c1-250 ;;
    attention)
      timed attention-a 120 python3 -m benchmarks.attention_kernels --page-sizes 0 \
        --backends flash-attn,flashinfer,triton --heads 32/8 \
        --shapes decode:256x704,decode:64x704 --json "$S/attention-a.json"
      timed attention-c 120 python3 -m benchmarks.attention_kernels --page-sizes 0 \
        --backends flash-attn,flashinfer,triton --heads 16/8 \
        --shapes decode:256x1100,decode:64x1100 --json "$S/attention-c.json"
      grep -h '^{' "$S"/attention-*.log | cut -c1-150 ;;
    gdn-kernels)  # issue 60: the delta rule's decode kernel per launch shape (its state floor)
      timed gdn-kernels 120 python3 -m benchmarks.gdn_kernels --json "$S/gdn-kernels.json"
      python3 - "$S/gdn-kernels.json" <<'PY' || tail -5 "$S/gdn-kernels.log"
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for key in sorted({(r["seqs"], r["state"]) for r in rows}):
    mine = [r for r in rows if (r["seqs"], r["state"]) == key]
    best, used = min(mine, key=lambda r: r["us"]), [r for r in mine if r["used"]][0]
    print(key, "used", used["block_v"], used["warps"], used["us"], "us; best", best["block_v"],
          best["warps"], best["us"], "us; floor", best["floor_us"])
PY
      ;;
    gdn-conv)  # issue 60: the causal convolution's kernels per tile at a decode and a prefill
      timed gdn-conv "${GDN_CONV_LIMIT:-120}" python3 -m benchmarks.gdn_kernels --conv \
        --json "$S/gdn-conv.json"
      python3 - "$S/gdn-conv.json" <<'PY' || tail -5 "$S/gdn-conv.log"
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
for step in dict.fromkeys(r["step"] for r in rows):
    mine = [r for r in rows if r["step"] == step]
    best, used = min(mine, key=lambda r: r["conv_kernel_us"]), [r for r in mine if r["used"]]
    print(step, "conv_triton", mine[0]["conv_triton_us"], "us; used tile",
          used and used[0]["conv_kernel_us"], "us; best", best["tokens"], best["channels"],
          best["warps"], best["conv_kernel_us"], "us; floor", best["floor_us"])
PY
      ;;
    gdn-prefill)  # issue 60: the chunked prefill, fla's kernel against FlashInfer's (vLLM's)
      timed gdn-prefill "${GDN_PREFILL_LIMIT:-150}" python3 -m benchmarks.gdn_kernels --prefill \
        --json "$S/gdn-prefill.json"
      cut -c1-300 "$S/gdn-prefill.log" | tail -8 ;;
    gdn)
      # issue 60: the gated-delta GPU tests; $GDN_MODEL's (default qwen3.5-9b) decode steps at
      # batch 1 and 256 under torch.profiler against the weight-plus-state floor; workloads
      # $GDN_WORKLOADS (default h) through pagedgen alone (PEERS_PEERS: vllm to add the peer)
      timed gdn-tests "${GDN_TESTS_LIMIT:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/test_gpu_gated_delta.py
      tail -4 "$S/gdn-tests.log"
      profile_model "${GDN_MODEL:-qwen3.5-9b}" "${GDN_LIMIT:-300}" 1,256
      [ "${PEERS_LIMIT:-300}" = 0 ] && continue  # PEERS_LIMIT=0: no workloads
      timed gdn-peers "${PEERS_LIMIT:-300}" python3 -m benchmarks.peers \
        --workloads "${GDN_WORKLOADS:-h}" --backends "${BACKEND:-triton}" \
        --peers "${PEERS_PEERS-}" --repeats 1 --json "$S/gdn-peers.json"
      grep -E "^│|^\|" "$S/gdn-peers.log" | cut -c1-200 | tail -8 ;;
    oss)
      # issue 61: MXFP4 experts and sinks in the triton kernels on the GPU, then gpt-oss-20b
      # (MXFP4 dummy experts) profiled and workload o (PEERS_PEERS: vllm for the peer)
      timed oss-tests "${OSS_TESTS_LIMIT:-300}" python3 -m pytest -v -p no:cacheprovider \
        tests/test_gpu_moe.py tests/test_triton.py tests/test_gpu_backends.py \
        tests/test_gpt_oss.py -k "mxfp4 or sinks or past_two or triton or grouped_gemm"
      grep -E "FAILED|ERROR|passed|failed" "$S/oss-tests.log" | tail -5
      BACKEND=triton profile_model gpt-oss-20b "${OSS_LIMIT:-240}" 1,64
      [ "${PEERS_LIMIT:-300}" = 0 ] && continue
      timed oss-peers "${PEERS_LIMIT:-300}" python3 -m benchmarks.peers --workloads o \
        --backends triton --peers "${PEERS_PEERS-}" --repeats 1 --json "$S/oss-peers.json"
      grep -E "^│|^\|" "$S/oss-peers.log" | cut -c1-200 | tail -8 ;;
    tp-close)  # issue 62's last items on HEAD: the two-GPU tests of every backend, verify
      # -tp 2, Qwen3-30B-A3B at tp 2 with its experts split by width and whole (-ep)
      timed tp-pytest "${TP_TESTS_LIMIT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/test_gpu_tensor_parallel.py
      grep -E "passed|failed|FAILED|ERROR" "$S/tp-pytest.log" | tail -6
      timed tp-verify 90 pagedgen verify --backend "${VERIFY_BACKEND:-flash-attn}" -tp 2 \
        --model-only --json "$S/tp-verify.json"
      grep -h "PASS\|FAIL\|tensor parallel" "$S/tp-verify.log" | head -8
      for split in ${TP_SPLITS:-width ep}; do
        timed "tp-moe-$split" "${TP_MOE_LIMIT:-200}" python3 -m benchmarks.tensor_parallel \
          --backend auto --runs qwen3-30b-a3b:2 --batches 1 --workload m --skip profile \
          $([ $split = ep ] && echo --expert-parallel) --dir "/tmp/tp-moe-$split" \
          --json "$S/tp-moe-$split.json"
        grep -h "qwen3" "$S/tp-moe-$split.log" | cut -c1-200
      done ;;
    plans)  # issue 59: the kernel plans shipped for this GPU kind (benchmarks/kernel_plans.py):
      # its runs (PLANS_MODELS, PLANS_QUANT; default every MoE preset and the dense FP8 ones)
      # dealt over this host's GPUs, one preset a process (one that does not fit is skipped),
      # at tensor-parallel sizes PLANS_TP (default 1), all within PLANS_LIMIT s (default 520);
      # merged into runtime/plans/<gpu>.json, which comes back in $OUT
      gpus=$(nvidia-smi -L | wc -l); end=$((SECONDS + ${PLANS_LIMIT:-520}))
      mapfile -t runs < <(python3 -m benchmarks.kernel_plans --list \
        ${PLANS_MODELS:+--models "$PLANS_MODELS"} --quantizations "${PLANS_QUANT:-none,fp8}")
      for g in $(seq 0 $((gpus - 1))); do
        for i in "${!runs[@]}"; do
          [ $((i % gpus)) = "$g" ] || continue
          left=$((end - SECONDS)); [ $left -gt 20 ] || break
          m=${runs[$i]%%:*}; q=${runs[$i]#*:}
          timeout $left env CUDA_VISIBLE_DEVICES=$g python3 -m benchmarks.kernel_plans \
            --models "$m" --quantizations "$q" --tp "${PLANS_TP:-1}" --out "$S/plans-$g.json" \
            > "$S/plans-$g-$m-$q.log" 2>&1
          echo "GPU $g $m $q: exit $? at $SECONDS s:" \
            "$(grep -v '^ *$' "$S/plans-$g-$m-$q.log" | tail -1 | cut -c1-180)"
        done &
      done
      wait
      compgen -G "$S/plans-[0-9]*.json" > /dev/null \
        && python3 -m benchmarks.kernel_plans --merge "$S"/plans-[0-9]*.json
      cp runtime/plans/*.json "${OUT:-/tmp/out}/" ;;
    first-runs)  # issues 59-61: each of $FIRST_WORKLOADS through pagedgen at its default
      # backend on empty kernel caches (plans only as shipped: a fresh machine's first run,
      # then a second), and vLLM (PEERS_PEERS, default vllm) on the same requests;
      # PEERS_QUANT=fp8: both in FP8. PEERS_LIMIT (default 540 s a workload): vLLM's cold
      # start alone takes 150-200 s on a fresh machine
      q=${PEERS_QUANT:-bf16}
      for w in ${FIRST_WORKLOADS:-m}; do
        timed "first-$w-$q" "${PEERS_LIMIT:-540}" env $(fresh_caches "$w-$q") \
          python3 -m benchmarks.peers --workloads "$w" \
          --backends "${PEERS_BACKENDS:-default}" --peers "${PEERS_PEERS-vllm}" --repeats 2 \
          --vllm-weights "$VLLM_WEIGHTS" \
          $([ -n "${PEERS_QUANT-}" ] && echo "--quantization $PEERS_QUANT") \
          --json "$S/first-$w-$q.json"
        python3 - "$S/first-$w-$q.json" <<'PY' || tail -5 "$S/first-$w-$q.log"
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["workload"], r["system"], r.get("backend", ""), "runs tok/s",
          [round(x) for x in r.get("runs_output_tokens_per_s", [])],
          "start-up", round(r.get("startup_s") or r.get("load_time_s") or 0, 1),
          r.get("kernel_plans", ""), {k: round(v, 2) for k, v in r.items() if k.startswith("vs ")},
          r.get("runs_kernels_compiled", ""), r.get("first_run_slowest_compiles", ""),
          "distinct tokens (mid, all)", r.get("distinct_tokens_mid"), r.get("distinct_tokens_all"))
    for name, t in r.get("first_run_compiles_s", {}).items():
        print(f"     {t:6.2f} s  {name[:180]}")
PY
      done ;;
    pair)  # issues 59-61 on two GPUs: each WORKLOAD:QUANT of $PAIR_RUNS (quant bf16 or fp8)
      # through pagedgen on GPU 0 at its default backend on empty kernel caches (a fresh
      # machine's first run, then a second in the same process) while vLLM (cold, its own
      # process) runs the same requests on GPU 1, one after another; then $PAIR_AFTER's steps
      # on GPU 0; PAIR_LIMIT: seconds a run (default 330)
      # with four GPUs or more, run i goes to pair i mod (GPUs / 2): pagedgen on GPU 2p, vLLM
      # on 2p + 1, the pairs at once; PAIR_AFTER's GPU:STEP on that even GPU (a bare STEP: 0);
      # each GPU's processes keep to its share of the cores (a shared host slowed vLLM's runs)
      runs=(${PAIR_RUNS:-m:bf16})
      pairs=$(( $(nvidia-smi -L | wc -l) / 2 )); [ "$pairs" -ge 1 ] || pairs=1
      for p in $(seq 0 $((pairs - 1))); do
        (
          mine=(); for i in "${!runs[@]}"; do [ $((i % pairs)) = "$p" ] && mine+=("${runs[$i]}"); done
          (
            pin_cores $((2 * p + 1))
            for r in "${mine[@]}"; do vllm_run "$r" $((2 * p + 1)); done
          ) > "$S/pair-vllm-$p.txt" &
          pin_cores $((2 * p))
          for r in "${mine[@]}"; do first_run "$r" $((2 * p)); done
          for a in ${PAIR_AFTER:-}; do
            [[ $a == *:* ]] || a=0:$a
            [ "${a%%:*}" = $((2 * p)) ] && CUDA_VISIBLE_DEVICES=${a%%:*} bash "$0" "${a#*:}"
          done
          wait
          cat "$S/pair-vllm-$p.txt"
        ) > "$S/pair-$p.txt" 2>&1 &
      done
      wait
      cat "$S"/pair-[0-9]*.txt
      pair_report "${runs[@]}" ;;
    quad)  # issues 59-61 on four GPUs: each WORKLOAD:QUANT of $QUAD_RUNS (at most three,
      # default "o:bf16 m:fp8 m:bf16") has its MoE plans measured afresh on a GPU of its own
      # (GPUs 0-2 at once, each merged into the shipped file as it ends: a change to the
      # kernels or the candidates), then its first and second run there on empty kernel
      # caches, then $QUAD_AFTER's GPU:STEP pairs on theirs; vLLM runs each of $QUAD_VLLM (the
      # first two runs) on GPU 3 meanwhile, one after another
      runs=(${QUAD_RUNS:-o:bf16 m:fp8 m:bf16})
      peer=${QUAD_VLLM:-${runs[*]:0:2}}
      (
        for r in $peer; do vllm_run "$r" 3; done
        for a in ${QUAD_AFTER:-}; do  # GPU:STEP
          [ "${a%%:*}" = 3 ] && CUDA_VISIBLE_DEVICES=3 bash "$0" "${a#*:}"
        done
      ) > "$S/quad-vllm.txt" 2>&1 &
      for i in "${!runs[@]}"; do
        (
          r=${runs[$i]}; run_parts "$r"
          model=$(python3 -c "from benchmarks.workloads import WORKLOADS; print(WORKLOADS['$w'].profile)")
          timed "plans-$w-$q" "${PLANS_LIMIT:-300}" env CUDA_VISIBLE_DEVICES=$i python3 -m \
            benchmarks.kernel_plans --models "$model" --quantizations "${q/bf16/none}" --tp 1 \
            --out "$S/plans-$w-$q.json"
          flock /tmp/plans.lock python3 -m benchmarks.kernel_plans --merge "$S/plans-$w-$q.json" \
            || python3 -m benchmarks.kernel_plans --merge "$S/plans-$w-$q.json"  # no flock
          first_run "$r" "$i"
          for a in ${QUAD_AFTER:-}; do  # GPU:STEP
            [ "${a%%:*}" = "$i" ] && CUDA_VISIBLE_DEVICES=$i bash "$0" "${a#*:}"
          done
        ) > "$S/quad-$i.txt" 2>&1 &
      done
      wait
      cat "$S"/quad-*.txt
      cp runtime/plans/*.json "${OUT:-/tmp/out}/"
      pair_report "${runs[@]}" ;;
    run-kernels)  # issues 59-61: each run of $RUNK_RUNS (WORKLOAD:QUANT, default m:bf16; quant
      # bf16 or fp8) whole under torch.profiler, pagedgen on GPU 0 and vLLM on GPU 1 at once:
      # GPU time by kernel group and the heaviest kernels side by side
      # (benchmarks/run_kernels.py); then $RUNK_AFTER's steps on GPU 0; RUNK_LIMIT a run;
      # RUNK_TOP: the heaviest kernels listed (default 20)
      # RUNK_SYSTEMS=pagedgen: pagedgen alone, on the GPU this step was given (a PAIR_AFTER);
      # vLLM's weights: the run's third part or the last of PEERS_VLLM_WEIGHTS
      runs=${RUNK_RUNS:-m:bf16}
      mine=0; [ "${RUNK_SYSTEMS:-}" = pagedgen ] && mine=${CUDA_VISIBLE_DEVICES:-0}
      if [ "${RUNK_SYSTEMS:-}" != pagedgen ]; then
        for r in $runs; do
          run_parts "$r"
          timed "runk-vllm-$w-$q" "${RUNK_LIMIT:-500}" env CUDA_VISIBLE_DEVICES=1 python3 -m \
            benchmarks.run_kernels --workload "$w" --top "${RUNK_TOP:-20}" \
            $([ "$q" = fp8 ] && echo "--quantization fp8") --vllm-weights "${vw##*,}" \
            --systems vllm --json "$S/runk-vllm-$w-$q.json"
        done > "$S/runk-vllm.txt" &
      fi
      for r in $runs; do
        run_parts "$r"
        timed "runk-pagedgen-$w-$q" "${RUNK_LIMIT:-500}" env CUDA_VISIBLE_DEVICES=$mine python3 -m \
          benchmarks.run_kernels --workload "$w" --top "${RUNK_TOP:-20}" \
          $([ "$q" = fp8 ] && echo "--quantization fp8") \
          --systems pagedgen --json "$S/runk-pagedgen-$w-$q.json"
      done
      for s in ${RUNK_AFTER:-}; do CUDA_VISIBLE_DEVICES=0 bash "$0" "$s"; done
      wait
      cat "$S/runk-vllm.txt" 2>/dev/null
      for r in $runs; do
        run_parts "$r"
        echo "== run-kernels $w $q"
        python3 - "$S/runk-pagedgen-$w-$q.json" "$S/runk-vllm-$w-$q.json" <<'PY'
import json, os, sys
from benchmarks.run_kernels import side_by_side
rows = [r for f in sys.argv[1:] if os.path.exists(f) for r in json.load(open(f))["rows"]]
print("\n".join(side_by_side(rows)))
for r in rows:
    for line in r.get("kernel_lines", []):
        print("  vLLM:", line[:200])
PY
      done ;;
    profile-models)  # each of $PROFILE_MODELS (default gpt-oss-20b) at batch 1, 64 and 256
      for m in ${PROFILE_MODELS:-gpt-oss-20b}; do
        profile_model "$m" "${PROFILE_LIMIT:-200}" "${PROFILE_BATCHES:-1,64,256}"
      done ;;
    vllm-only)  # vLLM alone on each of $VLLM_WORKLOADS (default h), a failure's cause kept;
      # PEERS_VLLM_WEIGHTS as in first-runs
      for w in ${VLLM_WORKLOADS:-h}; do
        timed "vllm-only-$w" "${PEERS_LIMIT:-400}" python3 -m benchmarks.peers --workloads "$w" \
          --backends "" --peers vllm --repeats 2 \
          --vllm-weights "$VLLM_WEIGHTS" --json "$S/vllm-only-$w.json"
        grep -E "^│|^\||skipped|Error|error" "$S/vllm-only-$w.log" | cut -c1-240 | tail -12
      done ;;
    *) echo "unknown step '$step'" ;;
  esac
done
tar czf "${OUT:-/tmp/out}/session.tgz" -C "$S" . && echo "logs: session.tgz"
