"""`pagedgen generate`: its options, and the summary it prints (the run: ``runs.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import typer

from pagedgen.cli.common import cli_errors, console, out_console, set_verbosity
from pagedgen.errors import PagedgenError
from pagedgen.runtime.inputs.settings import engine_and_sampling


@cli_errors
def generate(
    prompts: str = typer.Argument(..., help="JSONL file (one {\"prompt\"|\"prompt_token_ids\"|"
                                            "\"messages\": ...} per line, or an OpenAI batch "
                                            "input file; gzip-compressed or not), or a "
                                            "directory or glob of them."),
    output: str | None = typer.Option(
        None, "--output", "-o", help="Output JSONL [default: PROMPTS.completions.jsonl; needed "
                                     "for stdin or a glob]; with --ray, a path ending in / is "
                                     "a directory of shards."),
    resume: bool = typer.Option(
        False, help="Finish an output file an earlier run of the same input and settings "
                    "began: its whole lines are kept, the rest run."),
    overwrite: bool = typer.Option(
        False, help="Replace an output file that already holds completions (at the first "
                    "new line; until then it stays as it was)."),
    model: str | None = typer.Option(
        None, help="Checkpoint directory, .gguf file, Hugging Face Hub id (org/name) or "
                   "preset (smollm2-135m: a real model from pip) [default: the profile's, "
                   "else tiny]."),
    revision: str | None = typer.Option(
        None, help="A Hub id's branch, tag or commit [default: main]."),
    profile: str | None = typer.Option(
        None, help="Run profile: a name in profiles/ or a YAML file [default: the preset's, "
                   "else none]."),
    backend: str | None = typer.Option(
        None, help="Attention backend: auto, flashinfer, flash-attn, triton, sdpa or eager "
                   "[default: auto: the fastest that runs here]."),
    device: str | None = typer.Option(
        None, help="auto, cpu, cuda or cuda:N [default: auto: cuda where there is one]."),
    dtype: str | None = typer.Option(
        None, help="auto, float32, float16 or bfloat16 [default: auto: bfloat16 on a GPU, "
                   "float32 on a CPU]."),
    kv_cache_dtype: str | None = typer.Option(
        None, help="auto (the model's dtype) or fp8 [default: auto]."),
    quantization: str | None = typer.Option(
        None, "--quantization", "-q",
        help="fp8: weights quantized to FP8 (e4m3, per-channel scales) at load, activations "
             "per token [default: the checkpoint's own, else none]."),
    load_format: str | None = typer.Option(
        None, help="auto, safetensors, gguf or dummy (random weights) [default: auto: the "
                   "checkpoint's own, dummy for a preset]."),
    max_tokens: int | None = typer.Option(
        None, help="Output tokens per request, where a line sets none [default: the "
                   "profile's, else 64]."),
    temperature: float | None = typer.Option(
        None, help="Sampling temperature, 0 = greedy [default: the profile's, else 1.0]."),
    top_p: float | None = typer.Option(
        None, help="Sample from the smallest set of tokens whose probability reaches this, "
                   "in (0, 1] [default: the profile's, else 1.0: off]."),
    top_k: int | None = typer.Option(
        None, help="Sample from the k most likely tokens [default: the profile's, else 0: "
                   "off]."),
    seed: int | None = typer.Option(
        None, help="Run seed; a request without one samples with a seed derived from it and "
                   "its position [default: 0]."),
    min_p: float | None = typer.Option(
        None, help="Drop tokens below this times the top token's probability, in [0, 1] "
                   "[default: the profile's, else 0: off]."),
    presence_penalty: float | None = typer.Option(
        None, help="Subtracted from the logit of each token already in the output, in "
                   "[-2, 2] [default: 0]."),
    frequency_penalty: float | None = typer.Option(
        None, help="Subtracted per occurrence in the output, in [-2, 2] [default: 0]."),
    repetition_penalty: float | None = typer.Option(
        None, help="Tokens of the prompt or output: a positive logit divided by it, a negative "
                   "one multiplied, in (0, 100] [default: 1: off]."),
    min_tokens: int | None = typer.Option(
        None, help="No EOS, stop token or stop string before this many output tokens "
                   "[default: 0]."),
    json_schema: str | None = typer.Option(
        None, help="A JSON schema file: every line without a constraint of its own "
                   "(response_format, structured_outputs) writes JSON valid against it."),
    ignore_eos: bool | None = typer.Option(
        None, "--ignore-eos/--no-ignore-eos",
        help="Keep generating past the end-of-sequence token [default: no]."),
    n: int | None = typer.Option(None, "--n", help="Samples per request (1-128); they "
                                 "share the prompt's KV cache [default: 1]."),
    block_size: int | None = typer.Option(
        None, help="Tokens per KV page [default: the backend's]."),
    num_blocks: int | None = typer.Option(
        None, help="KV-cache size as the memory of this many blocks of every layer "
                   "[default: sized from memory, see --kv-cache-memory]."),
    kv_cache_memory: str | None = typer.Option(
        None, help="KV-cache size, e.g. 4GiB [default: what the GPU has left at "
                   "--gpu-memory-utilization after the model; on a CPU up to 1 GiB, at least "
                   "one whole sequence]."),
    gpu_memory_utilization: float | None = typer.Option(
        None, help="Share of the GPU's memory the run may use, the KV cache sized to fill it "
                   "[default: 0.9, vLLM's]."),
    max_num_seqs: int | None = typer.Option(
        None, help="Most sequences in a step [default: the profile's, else vLLM's rule: "
                   "1024 on a GPU of 70 GiB or more (not an A100), 256 on other GPUs, 128 on a "
                   "CPU; cut to the run's sequences]."),
    max_num_batched_tokens: int | None = typer.Option(
        None, help="Most tokens in a step; longer prompts prefill in chunks [default: the "
                   "profile's, else vLLM's rule: 16384 on a GPU of 70 GiB or more (not an "
                   "A100), 8192 on other GPUs and a CPU]."),
    max_model_len: int | None = typer.Option(
        None, help="Longest sequence, prompt and output [default: the model's context]."),
    enforce_eager: bool | None = typer.Option(
        None, "--enforce-eager/--cuda-graphs", help="Turn CUDA graphs off [default: on, "
                                                    "where the backend has them]."),
    fused_kernels: bool | None = typer.Option(
        None, "--fused-kernels/--no-fused-kernels",
        help="Norms, rotary and SwiGLU as fused Triton kernels on CUDA [default: on]."),
    prefix_caching: bool | None = typer.Option(
        None, "--prefix-caching/--no-prefix-caching",
        help="Reuse the KV cache of prompt prefixes computed before [default: on]."),
    kv_cache_groups: bool | None = typer.Option(
        None, "--kv-cache-groups/--no-kv-cache-groups",
        help="A model mixing sliding-window and full-attention layers: window layers hold "
             "only their window's KV pages [default: on]."),
    prefix_grouping: bool | None = typer.Option(
        None, "--prefix-grouping/--no-prefix-grouping",
        help="Admit lines whose prompts share a prefix together, so its KV is computed once "
             "and read together; the output keeps input order [default: on]."),
    cascade_attention: bool | None = typer.Option(
        None, "--cascade-attention/--no-cascade-attention",
        help="Decode steps attend the KV pages all their sequences share once for the batch "
             "[default: on, where the backend can: flash-attn FA4, flashinfer, triton]."),
    batch_invariant: bool | None = typer.Option(
        None, "--batch-invariant",
        help="Every request's tokens and log-probabilities bit for bit those it gets run "
             "alone, whatever else the batch holds (unquantized dense and MoE models, triton "
             "backend, one GPU; "
             "pagedgen verify --batch-invariance checks it) [default: off]."),
    reasoning_parser: str | None = typer.Option(
        None, help="How a reasoning model's thinking is split from its answer (into "
                   "reasoning_content; structured output constrains the answer only): auto "
                   "(from the tokenizer: <think> tags, gpt-oss's harmony channels or Gemma "
                   "4's <|channel> tags), none, qwen3, deepseek_r1, gpt_oss, gemma4 "
                   "[default: auto]."),
    logprobs: int | None = typer.Option(
        None, help="Log-probabilities per output token, with this many top alternatives "
                   "(0-20), where a line sets none [default: none]."),
    prompt_logprobs: int | None = typer.Option(
        None, help="Log-probabilities per prompt token, with this many top alternatives "
                   "(0-20), where a line sets none [default: none]."),
    prompt_field: str = typer.Option("prompt", help="The field that holds a text prompt."),
    messages_field: str = typer.Option("messages", help="The field that holds chat messages."),
    strict_fields: bool = typer.Option(
        False, "--strict-fields", help="Unknown fields are errors [default: they are copied "
                                      "into the output line's \"metadata\"]."),
    on_bad_line: str = typer.Option(
        "error", help="A line that cannot run: error (an error record in its place; the run "
                      "goes on, as OpenAI's batch API does) or stop (the first ends the run "
                      "before the model loads) [default: error]."),
    served_model_name: str | None = typer.Option(
        None, help="OpenAI batch files: the model name their lines' body \"model\" must "
                   "have, and the name reported."),
    ray: str | None = typer.Option(
        None, "--ray", help="Run on Ray Data: 'local' (a Ray instance started here) or a "
                            "cluster address; needs pagedgen[ray]."),
    replicas: int = typer.Option(1, help="With --ray: engine replicas (actors), one GPU each."),
    data_parallel_size: int = typer.Option(
        1, "--data-parallel-size", "-dp", help="Engine replicas on this host, each on "
                                                "--tensor-parallel-size GPUs (worker processes)."),
    expert_parallel: bool | None = typer.Option(
        None, "--expert-parallel/--no-expert-parallel", "-ep",
        help="Under -tp, each rank holds a share of a MoE model's experts whole, instead of a "
             "share of every expert [default: off]."),
    tensor_parallel_size: int | None = typer.Option(
        None, "--tensor-parallel-size", "-tp", help="GPUs one model is sharded over (worker "
                                                     "processes joined by NCCL; gloo on CPU) "
                                                     "[default: 1]."),
    threads: int | None = typer.Option(
        None, help="CPU threads for torch [default: on a CPU, the cores of this process that "
                   "other processes leave free, measured at start-up]."),
    json_summary: bool = typer.Option(False, "--json", help="Print every figure of the "
                                                            "summary as JSON."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True,
                                help="Say what start-up does (-v: its phases, the backend and "
                                     "KV cache; -vv: more)."),
    quiet: bool = typer.Option(False, "--quiet", help="Errors only: no progress, notes or "
                                                      "summary."),
) -> None:
    """Generate completions for every line of PROMPTS and print a throughput summary."""
    # the run's modules (torch among them) load here, not for --help
    from pagedgen.cli.generate.runs import Job, run
    from pagedgen.cli.summary import summary_table
    from pagedgen.runtime.inputs.request import InputOptions
    from pagedgen.runtime.inputs.structured import schema_file

    set_verbosity(verbose, quiet)
    engine_cfg, defaults, _ = engine_and_sampling(
        profile, model,
        dict(backend=backend, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
             quantization=quantization, load_format=load_format, seed=seed,
             block_size=block_size, num_blocks=num_blocks,
             kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
             max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
             max_model_len=max_model_len,
             enforce_eager=enforce_eager, fused_kernels=fused_kernels,
             prefix_caching=prefix_caching, prefix_grouping=prefix_grouping,
             kv_cache_groups=kv_cache_groups,
             cascade_attention=cascade_attention, batch_invariant=batch_invariant,
             tensor_parallel_size=tensor_parallel_size,
             expert_parallel=expert_parallel, threads=threads, reasoning_parser=reasoning_parser),
        sampling := dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                         top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                         frequency_penalty=frequency_penalty,
                         repetition_penalty=repetition_penalty, min_tokens=min_tokens,
                         ignore_eos=ignore_eos, n=n, logprobs=logprobs,
                         prompt_logprobs=prompt_logprobs), revision=revision)
    # paths as a shell would give them, where a script quoted them ("~/out.jsonl")
    prompts, output = (p if p in (None, "-") else os.path.expanduser(p) for p in (prompts, output))
    if json_schema is not None:
        defaults = dataclasses.replace(defaults, structured=schema_file(
            os.path.expanduser(json_schema)))
        try:
            defaults.validate()
        except ValueError as e:
            raise PagedgenError(f"--json-schema: {e}")
    job = Job(prompts, output, resume, overwrite, engine_cfg, defaults,
              InputOptions(prompt_field, messages_field, strict_fields, served_model_name,
                           engine_cfg.reasoning_parser not in ("auto", "none"), on_bad_line),
              tensor_parallel_size, data_parallel_size, ray, replicas, quiet=json_summary,
              given_sampling=frozenset(k for k, v in sampling.items() if v is not None))
    summary = run(job)
    if summary is None:  # a torchrun rank other than 0: rank 0 reports
        return
    to_stderr = summary.get("output_stream", "").startswith("standard output")
    if quiet:
        return
    if json_summary:  # beside lines written to standard output, the summary goes to stderr
        print(json.dumps(summary, indent=2), file=sys.stderr if to_stderr else sys.stdout)
    else:
        shown = console if to_stderr else out_console()
        shown.print(summary_table(summary, width=shown.width))  # a pipe's: COLUMNS, or 80
