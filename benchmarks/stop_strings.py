"""What a stop string costs (issue 58).

On the host: the time per decode step a stop string costs one sequence, at 256, 1,024 and
4,096 output tokens: the output stage's incremental detokenizer and tail search against a
search of the whole text decoded again every step (what ``Engine._find_stop`` did before).
Random token ids, a stop string that never matches (the worst case: every step searches).

    python -m benchmarks.stop_strings [--tokenizer smollm2-135m] [--json out.json]

On a GPU (``--gpu``): workload (a) with and without that stop string on every request, in
pagedgen and in vLLM at their defaults (vLLM detokenizes, as it does by default), both with one
synthetic word-level tokenizer over the model's whole vocabulary (written here: no download).

    python -m benchmarks.stop_strings --gpu [--system pagedgen|vllm|both] --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path

from pagedgen.runtime.models.loader import load_tokenizer, resolve_model
from pagedgen.runtime.output.detokenizer import IncrementalDetokenizer, StopChecker

LENGTHS = (256, 1024, 4096)
STOP = ["<never-there>"]


def whole_text(tok, ids: list[int]) -> list[float]:
    """Seconds per step at each length: decode the output so far, search it all."""
    out = []
    for n in LENGTHS:  # the step at that length, measured 5 times
        t = time.perf_counter()
        for _ in range(5):
            text = tok.decode(ids[:n])
            [text.find(s) for s in STOP]
        out.append((time.perf_counter() - t) / 5)
    return out


def incremental(tok, ids: list[int], window: int = 64) -> list[float]:
    """Seconds per step at each length (the mean over ``window`` steps ending there)."""
    detok, checker = IncrementalDetokenizer(tok), StopChecker(STOP)
    out, marks = [], {n - window: n for n in LENGTHS}
    t = 0.0
    for n, token in enumerate(ids, start=1):
        if n - 1 in marks:
            t = time.perf_counter()
        detok.add(token)
        checker.check(detok.text, detok.new)
        if n in LENGTHS:
            out.append((time.perf_counter() - t) / window)
    return out


def word_tokenizer(path: Path, vocab: int) -> Path:
    """A word-level tokenizer of ``vocab`` words (``w0`` ...; id 1 BOS, 2 EOS), saved in
    ``path`` as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(path)
    return path


def on_gpu(system: str, workload_name: str, repeats: int) -> list[dict]:
    """Workload ``workload_name`` with and without the stop string, in ``system``."""
    import tempfile

    from benchmarks.common import build_engine, median_run, profile_configs, timed_runs
    from benchmarks.workloads import workload

    wl = workload(workload_name)
    src = resolve_model(wl.profile)
    prompts, outs = wl.requests(src.hf_config.vocab_size)
    tmp = Path(tempfile.mkdtemp())
    tok = word_tokenizer(tmp / "tok", src.hf_config.vocab_size)
    rows = []
    if system == "vllm":  # one engine, both runs in turn
        from benchmarks.vllm_peer import run_vllm
        res = run_vllm(workload_name, None, src.hf_config, {}, repeats=repeats,
                       tokenizer_dir=tok, sampling=[{"detokenize": True},
                                                    {"detokenize": True, "stop": STOP}])
        if "skipped" in res:
            return [{"system": "vLLM", **res}]
        for k, tag in enumerate(("no stop string", "stop string")):
            mid = median_run([r for r in res["runs"] if r["sampling"] == k])
            rows.append({"system": f"vLLM {res['vllm']}", "run": tag,
                         "output_tokens_per_s": mid["output_tokens_per_s"],
                         "runs_output_tokens_per_s": mid["runs_output_tokens_per_s"],
                         "startup_s": res["startup_s"]})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    (tmp / "model").mkdir()  # the model's config and the tokenizer: a dummy checkpoint
    cfg_json = src.hf_config.to_transformers().to_dict()
    (tmp / "model" / "config.json").write_text(json.dumps(cfg_json))
    for f in tok.iterdir():
        (tmp / "model" / f.name).write_bytes(f.read_bytes())
    cfg, sampling = profile_configs(wl.profile)
    cfg.model, cfg.load_format = str(tmp / "model"), "dummy"
    engine, load_s = build_engine(cfg)
    for stop in ([], STOP):  # one engine, both runs in turn
        params = [dataclasses.replace(p, stop=list(stop))
                  for p in wl.sampling_params(sampling, outs)]
        mid = median_run(timed_runs(engine, prompts, params, repeats=repeats, load_s=load_s))
        rows.append({"system": "pagedgen", "run": "stop string" if stop else "no stop string",
                     "output_tokens_per_s": mid["output_tokens_per_s"],
                     "runs_output_tokens_per_s": mid["runs_output_tokens_per_s"],
                     "decode_host_ms_per_step": mid.get("decode_host_ms_per_step")})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="smollm2-135m", help="a model whose tokenizer to use")
    ap.add_argument("--gpu", action="store_true", help="workload (a) on a GPU (see above)")
    ap.add_argument("--system", default="both", choices=["pagedgen", "vllm", "both"])
    ap.add_argument("--workload", default="a")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.gpu:
        systems = ["pagedgen", "vllm"] if args.system == "both" else [args.system]
        rows = [r for s in systems for r in on_gpu(s, args.workload, args.repeats)]
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows}, indent=2))
        return
    src = resolve_model(args.tokenizer)
    tok = load_tokenizer(src)
    rng = random.Random(0)
    ids = [rng.randrange(min(src.hf_config.vocab_size, 32000)) for _ in range(max(LENGTHS))]
    before, after = whole_text(tok, ids), incremental(tok, ids)
    rows = [{"output_tokens": n, "whole_text_us_per_step": b * 1e6,
             "incremental_us_per_step": a * 1e6} for n, b, a in zip(LENGTHS, before, after)]
    for r in rows:
        print(f"{r['output_tokens']:>5} tokens: whole-text search "
              f"{r['whole_text_us_per_step']:9.1f} us/step, incremental "
              f"{r['incremental_us_per_step']:6.1f} us/step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokenizer": args.tokenizer, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
