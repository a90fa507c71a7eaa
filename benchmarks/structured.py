"""Structured output's cost on the GPU (issue 33): a batch of lines with ten distinct JSON
schemas against the same batch unconstrained, and vLLM on the same lines (its default
structured-output backend, xgrammar; whitespace off in both, pagedgen's default).

Llama-3-8B shape with dummy weights and a real BPE tokenizer (SmolLM2's 49,152 tokens, from
the packaged GGUF file, unless ``--tokenizer DIR``): the masks cover the model's 128,256
logits, the matchers a real vocabulary. The same prompt token ids and output limits for both
systems, greedy, EOS not ignored (a sample ends where its structure does). Random weights
rarely close a free string, so most constrained samples run to ``--max-tokens`` as the
unconstrained ones do: the comparison is per output token.

    python -m benchmarks.structured --json benchmarks/results/h100-structured.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    build_engine,
    free_gpu,
    median_run,
    parse_overrides,
    print_table,
    profile_configs,
    random_prompts,
    timed_runs,
)
from benchmarks.mixed_steps import record_steps, traced_window
from benchmarks.vllm_peer import run_vllm, same_limits
from pagedgen.runtime.config import SamplingParams, StructuredOutput
from pagedgen.runtime.models.loader import load_tokenizer, resolve_model
from pagedgen.runtime.sampling import structured

_STR = {"type": "string"}
SCHEMAS = [  # extraction, classification and labelling shapes
    {"type": "object", "properties": {"name": _STR, "age": {"type": "integer"}, "city": _STR},
     "required": ["name", "age", "city"]},
    {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                                      "reason": _STR}, "required": ["label", "reason"]},
    {"type": "object", "properties": {"title": _STR, "tags": {"type": "array", "items": _STR,
                                                              "maxItems": 5}},
     "required": ["title", "tags"]},
    {"type": "object", "properties": {"company": _STR, "revenue": {"type": "number"},
                                      "currency": {"enum": ["USD", "EUR", "JPY"]}},
     "required": ["company", "revenue", "currency"]},
    {"type": "object", "properties": {"question": _STR, "answer": _STR,
                                      "confidence": {"type": "integer", "minimum": 0,
                                                     "maximum": 100}},
     "required": ["question", "answer", "confidence"]},
    {"type": "object", "properties": {"entities": {"type": "array", "items": {
        "type": "object", "properties": {"text": _STR, "type": {
            "enum": ["PERSON", "ORG", "PLACE", "DATE"]}}, "required": ["text", "type"]}}},
     "required": ["entities"]},
    {"type": "object", "properties": {"summary": _STR, "language": {"enum": ["en", "de", "fr"]},
                                      "words": {"type": "integer"}},
     "required": ["summary", "language", "words"]},
    {"type": "object", "properties": {"date": {"type": "string", "format": "date"},
                                      "event": _STR, "attendees": {"type": "array",
                                                                   "items": _STR}},
     "required": ["date", "event", "attendees"]},
    {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                      "price": {"type": "number"}, "in_stock": {"type": "boolean"},
                                      "note": _STR},
     "required": ["sku", "price", "in_stock", "note"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "email": _STR}, "required": ["id", "email"]},
        "action": {"enum": ["create", "update", "delete"]}, "details": _STR},
     "required": ["user", "action", "details"]},
]


def smollm2_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer saved in ``out``."""
    load_tokenizer(resolve_model("smollm2-135m")).tok.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="llama-3-8b")
    ap.add_argument("--num-prompts", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--backend", default="flash-attn")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a directory with tokenizer files (default: SmolLM2's)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--mixed-ahead-off", action="store_true",
                    help="the constrained lines once more with steps that carry prefills "
                         "launched after the last step's tokens")
    ap.add_argument("--mask-fill-schedule-off", action="store_true",
                    help="the constrained lines once more without scheduling the next step "
                         "while a step's sampling waits for the grammar worker's masks")
    ap.add_argument("--set", action="append", default=[],
                    help="engine config override KEY=VALUE (int, float, bool or text)")
    ap.add_argument("--pool-variants", default="",
                    help="the constrained lines once more per WORKERS:THREADS, e.g. 0:16,4:4: "
                         "the grammar pool in WORKERS processes (0: inline), each filling "
                         "masks on THREADS threads")
    ap.add_argument("--timeline", default="",
                    help="FIRST:STEPS: after the timed runs, trace STEPS step calls from the "
                         "FIRST of the constrained and the same-lengths runs for GPU kernels: "
                         "where the GPU waits for the host")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    variants = [(int(w), int(t)) for w, t in
                (v.split(":") for v in args.pool_variants.split(",") if v)]

    tmp = Path(tempfile.mkdtemp())
    model = tmp / "model"
    model.mkdir()
    cfg, _ = profile_configs(args.profile, backend=args.backend, load_format="dummy",
                             **parse_overrides(args.set))
    hf = resolve_model(cfg.model).hf_config
    (model / "config.json").write_text(json.dumps(hf.to_transformers().to_dict()))
    if args.tokenizer is None:
        smollm2_tokenizer(model)
    else:
        for f in args.tokenizer.iterdir():
            if f.is_file() and f.name != "config.json":
                (model / f.name).write_bytes(f.read_bytes())
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model))  # prompt ids the tokenizer knows
    prompts = random_prompts(args.num_prompts, 128, 512, vocab)
    outs = [args.max_tokens] * len(prompts)
    schemas = [SCHEMAS[i % len(SCHEMAS)] for i in range(len(prompts))]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                  structured=StructuredOutput("json", json.dumps(s)))
                   for s in schemas]

    engine, load_s = build_engine(replace(cfg, model=str(model)))
    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    if args.mixed_ahead_off:
        runs["constrained, mixed steps not ahead"] = []
    # the constrained samples' own lengths, unconstrained: the same tail of the batch, so
    # the ratio is the constraint's cost per step (where random weights close a structure
    # early, the plain unconstrained batch runs every line to --max-tokens)
    seqs = _last_seqs(engine, prompts, constrained)
    lengths = [SamplingParams(max_tokens=max(1, s.num_output_tokens), temperature=0.0,
                              ignore_eos=True) for s in seqs]
    runs["unconstrained, the constrained lengths"] = []
    if args.mask_fill_schedule_off:
        runs["constrained, not scheduled during mask fill"] = []
    for variant in variants:
        runs[_variant_name(*variant)] = []
    for _ in range(args.repeats):  # alternate, so drift hits both alike
        runs["unconstrained"] += timed_runs(engine, prompts, free, load_s=load_s)
        runs["constrained"] += timed_runs(engine, prompts, constrained, load_s=load_s)
        runs["unconstrained, the constrained lengths"] += timed_runs(engine, prompts, lengths,
                                                                    load_s=load_s)
        if args.mixed_ahead_off:
            engine.config.mixed_steps_ahead = False
            runs["constrained, mixed steps not ahead"] += timed_runs(
                engine, prompts, constrained, load_s=load_s)
            engine.config.mixed_steps_ahead = True
        if args.mask_fill_schedule_off:
            engine.config.schedule_during_mask_fill = False
            runs["constrained, not scheduled during mask fill"] += timed_runs(
                engine, prompts, constrained, load_s=load_s)
            engine.config.schedule_during_mask_fill = True
        default = engine.grammars
        for workers, threads in variants:
            engine._grammars = structured.Grammars(engine.tokenizer, hf.vocab_size,
                                                   threads=threads, workers=workers)
            # untimed: the workers start (import xgrammar) and take the grammars, as the
            # default pool did in the first run; `pagedgen generate` starts them with the model
            timed_runs(engine, prompts[:64], [replace(c, max_tokens=4) for c in constrained[:64]])
            runs[_variant_name(workers, threads)] += timed_runs(engine, prompts, constrained,
                                                                load_s=load_s)
            engine.grammars.pool.close()
        engine._grammars = default
        engine.grammars  # noqa: B018 - the runner masks with the default pool again
    timelines = {}
    if args.timeline and torch.cuda.is_available():
        first, steps = (int(x) for x in args.timeline.split(":"))
        for name, params in (("constrained", constrained),
                             ("unconstrained, the constrained lengths", lengths)):
            try:
                timelines[name] = t = timeline(engine, prompts, params, first, steps, tmp)
            except Exception as e:  # noqa: BLE001 - the timed rows above are kept
                print(f"timeline, {name}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            if not t:
                print(f"timeline, {name}: the run ended before step call {first + steps}")
                continue
            print(f"timeline, {name}: GPU busy {t['gpu_busy_fraction']:.1%} of "
                  f"{t['gpu_span_ms']:.0f} ms; a step call {t['host_ms_per_call']:.2f} ms on the "
                  f"host, {t['grammar_wait_ms_per_call']:.2f} of them waiting for masks; GPU "
                  + "; ".join(f"{k}: {d['steps']} steps, busy {d['busy_ms'] / d['steps']:.2f}, "
                              f"idle before {d['idle_before_ms'] / d['steps']:.2f}, inside "
                              f"{d['idle_inside_ms'] / d['steps']:.2f} ms a step; host "
                              f"{d['host_ms']:.2f}, waiting {d['wait_ms']:.2f} ms a call"
                              for k, d in t["by_kind"].items()), flush=True)
    texts = [engine.output_text(s) for s in _last_seqs(engine, prompts[:64], constrained[:64])]
    valid = sum(_parses(t) for t in texts)
    del engine
    free_gpu()

    rows = []
    for name, rs in runs.items():
        m = median_run(rs)
        rows.append({"system": f"pagedgen {args.backend}, {name}", **m, **{
            f"{k}_ms_per_step": 1000 * m.get(f"{k}_s", 0.0) / max(m["steps"], 1)
            for k in ("grammar_mask", "grammar_wait", "grammar_worker")}})
    base = rows[0]["output_tokens_per_s"]
    same = next(r for r in rows if r["system"].endswith("constrained lengths"))
    for r in rows:
        r["vs_unconstrained"] = r["output_tokens_per_s"] / base
        r["vs_same_lengths"] = r["output_tokens_per_s"] / same["output_tokens_per_s"]
    columns = ["system", "output_tokens", "wall_time_s", "output_tokens_per_s",
               "vs_unconstrained", "vs_same_lengths", "pagedgen_vs_this",
               "grammar_mask_ms_per_step", "grammar_wait_ms_per_step",
               "grammar_worker_ms_per_step", "grammar_workers", "steps_scheduled_during_masks",
               "steps_launched_ahead", "steps"]
    title = (f"{args.num_prompts} lines, {len(SCHEMAS)} schemas, {args.max_tokens} tokens at "
             f"most, {args.profile} shape")
    peer: dict[str, Any] = {"skipped": "--no-vllm"}
    if not args.no_vllm:
        _brief(rows)  # kept should vLLM not finish
        peer = run_vllm("", None, hf, same_limits(cfg), repeats=args.repeats, requests={
            "prompts": prompts, "outs": outs,
            "variants": {"unconstrained": [None] * len(prompts), "constrained": schemas}},
            tokenizer_dir=model)
        for name in ("unconstrained", "constrained"):
            vr = [r for r in peer.get("runs", []) if r["variant"] == name]
            if vr:
                m = median_run(vr)
                rows.append({"system": f"vLLM {peer['vllm']}, {name}", **m})
        if "skipped" in peer:
            print(f"vLLM: {peer['skipped']}", file=sys.stderr)
    mine = rows[1]  # pagedgen, constrained
    for r in rows:
        if r["system"].startswith("vLLM") and r["system"].endswith(", constrained"):
            r["pagedgen_vs_this"] = mine["output_tokens_per_s"] / r["output_tokens_per_s"]
    print_table(title, rows, columns)
    _brief(rows)
    print(f"pagedgen: {valid} of {len(texts)} checked constrained outputs parse as JSON "
          "(the others stopped at --max-tokens inside a string)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "vllm": {k: v for k, v in peer.items()
                                                                  if k != "runs"},
                                         "vllm_texts": [r.get("texts") for r in
                                                        peer.get("runs", [])][-1:],
                                         "parsed": [valid, len(texts)],
                                         "timeline": timelines}, indent=1))


def _brief(rows: list[dict[str, Any]]) -> None:
    """One line a row: the figures the issue reads."""
    for r in rows:
        print(f"{r['system']}: {r.get('output_tokens_per_s', 0):,.0f} tok/s, "
              f"{r.get('output_tokens', 0):,} tokens in {r.get('wall_time_s', 0):.2f} s, "
              f"vs unconstrained {r.get('vs_unconstrained', float('nan')):.3f}, "
              f"vs same lengths {r.get('vs_same_lengths', float('nan')):.3f}, waiting "
              f"{r.get('grammar_wait_ms_per_step', 0):.2f} ms a step", flush=True)


def timeline(engine, prompts: list[list[int]], params: list[SamplingParams], first: int,
             steps: int, tmp: Path) -> dict[str, Any]:
    """The lines run once more, step calls ``first`` to ``first + steps`` traced for GPU
    kernels only, a marker kernel launched as each call begins (``mixed_steps.step_timeline``):
    the GPU's busy fraction, its idle time between and inside steps by kind, and each call's
    host time and wait for the grammar workers' masks."""
    engine.reset_prefix_cache()
    engine.reset_stats()
    engine.add_requests((p, sp, i, i) for i, (p, sp) in enumerate(zip(prompts, params)))
    log: list[dict[str, Any]] = []
    record_steps(engine, log)  # each scheduled step's composition, in launch order
    pool = engine._grammars.pool if engine._grammars is not None else None
    i, prof, calls, out, before = 0, None, [], {}, 0
    try:
        while engine.has_unfinished():
            if i == first:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof.start()
                before = len(log)
            if prof is not None:
                torch.cuda._sleep(1)
            w0, t0 = pool.wait_s if pool else 0.0, time.perf_counter()
            engine.step()
            if prof is not None:
                calls.append((time.perf_counter() - t0, (pool.wait_s if pool else 0.0) - w0))
            i += 1
            if prof is not None and i == first + steps:
                window = ["mixed" if step["prefill_seqs"] else "decode"
                          for step in log[before:before + len(calls)]]
                by_kind, span, busy_fraction = traced_window(prof, tmp / "structured-trace.json",
                                                             window)
                for kind, d in by_kind.items():  # the host's side of the same calls
                    mine = [c for c, k in zip(calls, window) if k == kind]
                    d["host_ms"] = 1000 * sum(c for c, _ in mine) / len(mine)
                    d["wait_ms"] = 1000 * sum(w for _, w in mine) / len(mine)
                out = {"first_step": first, "steps": len(calls), "gpu_span_ms": span,
                       "gpu_busy_fraction": busy_fraction or 0.0,
                       "host_ms_per_call": 1000 * sum(c for c, _ in calls) / len(calls),
                       "grammar_wait_ms_per_call": 1000 * sum(w for _, w in calls) / len(calls),
                       "by_kind": by_kind}
                prof = None
    finally:
        del engine._schedule  # the class's method again
    return out


def _variant_name(workers: int, threads: int) -> str:
    return f"constrained, {workers} grammar workers x {threads} threads"


def _last_seqs(engine, prompts, params):
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.run()
    return seqs


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
