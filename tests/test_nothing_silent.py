"""Nothing silent, round 3 (issue 100): the model a run uses is the one the user named,
profiles are checked as strictly as options, messages name where a value came from, and
``verify`` skips what a model does not use. (The API after an interrupt, reasoning parsers and
constraints: test_python_api.py, test_reasoning.py, test_structured_output.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.cli.app import app
from pagedgen.errors import PagedgenError

STOP = ["--on-bad-line", "stop"]  # a bad line ends the run: what these tests check

runner = CliRunner()
FAST = ["--device", "cpu", "--max-tokens", "4"]


def prompts(path: Path) -> Path:
    path.write_text('{"prompt": "Hello"}\n{"prompt": "The capital"}\n')
    return path


def texts(out: Path) -> list[str]:
    return [json.loads(x)["text"] for x in out.read_text().splitlines()]


# ---- the model the user named ----------------------------------------------------------------

def test_a_local_folder_named_like_a_preset_is_the_model_the_run_uses(tmp_path, monkeypatch):
    """``--model qwen3-0.6b`` beside a folder of that name used to take the preset's profile
    (dummy weights, its max_model_len and sampling): here, an error naming --max-model-len,
    which the user never gave. The folder wins, as ``./qwen3-0.6b`` does."""
    monkeypatch.chdir(tmp_path)
    make_checkpoint("llama", Path("qwen3-0.6b"), with_tokenizer=True)
    src = prompts(tmp_path / "p.jsonl")
    outs = []
    for name in ("qwen3-0.6b", "./qwen3-0.6b"):
        out = tmp_path / f"{len(outs)}.jsonl"
        res = runner.invoke(app, ["generate", str(src), "--model", name, "-o", str(out), *FAST])
        assert res.exit_code == 0, res.output
        outs.append(texts(out))
    assert outs[0] == outs[1]


def test_resume_after_the_weights_changed_under_the_same_path_is_an_error(tmp_path):
    """The resume record keeps a fingerprint of the checkpoint (sizes, headers, the first
    and last bytes of each file): new weights saved over the old ones used to resume the old
    model's lines silently."""
    from safetensors.torch import load_file, save_file

    ckpt = make_checkpoint("llama", tmp_path / "m", with_tokenizer=True)
    src = prompts(tmp_path / "p.jsonl")
    out = tmp_path / "o.jsonl"
    args = ["generate", str(src), "--model", str(ckpt), "-o", str(out), *FAST]
    assert runner.invoke(app, args).exit_code == 0
    assert runner.invoke(app, args + ["--resume"]).exit_code == 0  # same weights: resumes
    before = out.read_bytes()
    (weights,) = ckpt.glob("*.safetensors")
    tensors = load_file(weights)
    save_file({k: v + 0.01 if k.endswith("norm.weight") else v for k, v in tensors.items()},
              weights, metadata={"format": "pt"})
    res = runner.invoke(app, args + ["--resume"])
    assert res.exit_code == 1 and "weights" in res.output and "Traceback" not in res.output
    assert out.read_bytes() == before


# ---- profiles, as strictly as options ----------------------------------------------------------

CONFIG = ("{model_type: llama, vocab_size: 300, hidden_size: 64, intermediate_size: 128, "
          "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, "
          "max_position_embeddings: 256}")


@pytest.mark.parametrize("text,message", [
    # a model config the code cannot run (was a traceback at the first step)
    (f"model:\n  name: m\n  tokenizer: byte\n  config: "
     f"{CONFIG.replace('value_heads: 2', 'value_heads: 3')}\n",
     r"p\.yaml:4: model\.config: num_attention_heads \(4\) must be a multiple of "
     r"num_key_value_heads \(3\)"),
    # a tokenizer a preset cannot have (was a traceback)
    (f"model:\n  name: m\n  tokenizer: bpe\n  config: {CONFIG}\n",
     r"p\.yaml:3: model\.tokenizer must be one of byte, none"),
    # a model that is neither a name nor a mapping (ran the default model)
    ("model: 5\n", r"p\.yaml:1: 'model' must be a name .* not int"),
    ("model: [a, b]\n", r"p\.yaml:1: 'model' must be a name .* not list"),
    # a misspelt field (ran on defaults)
    ("model:\n  name: tiny\n  tokenizr: byte\n",
     r"p\.yaml:3: unknown field 'model\.tokenizr' \(did you mean 'tokenizer'\?\)"),
    ("engine:\n  max_num_seq: 4\n", r"p\.yaml:2: unknown field 'max_num_seq' \(did you mean "
                                    r"'max_num_seqs'\?\)"),
    ("sampling:\n  temprature: 0\n", r"p\.yaml:2: unknown field 'temprature'"),
    ("engin:\n  max_num_seqs: 4\n", r"p\.yaml:1: unknown section 'engin' \(did you mean "
                                    r"'engine'\?\)"),
    # a key given twice, at any depth (the last one won)
    ("engine:\n  max_num_seqs: 4\n  max_num_seqs: 8\n",
     r"p\.yaml:3: .*'max_num_seqs' is given twice \(first at line 2\)"),
    (f"model:\n  name: m\n  config: {CONFIG[:-1]}, hidden_size: 32}}\n",
     r"p\.yaml:3: .*'hidden_size' is given twice"),
])
def test_a_profile_is_checked_as_strictly_as_options(tmp_path, text, message):
    import re

    prof = tmp_path / "p.yaml"
    prof.write_text(text)
    res = runner.invoke(app, ["generate", str(prompts(tmp_path / "p.jsonl")), "--profile",
                              str(prof), "-o", str(tmp_path / "o.jsonl"), *FAST])
    out = res.output.strip()
    assert res.exit_code == 1 and out.startswith("error: ") and "Traceback" not in out, out
    assert re.search(message, " ".join(out.split())), out


# ---- messages name what the user gave, where -------------------------------------------------

def test_an_api_keyword_is_named_as_a_keyword_not_an_option():
    """``LLM(max_num_seqs=2)`` then ``n=3`` used to blame --max-num-seqs, which an API user
    never gave."""
    from pagedgen import LLM
    from pagedgen.errors import PagedgenError

    llm = LLM(device="cpu", max_num_seqs=2)
    with pytest.raises(PagedgenError, match=r"prompt 0: n = 3 samples run as 3 sequences at once; "
                                            r"keyword max_num_seqs is 2"):
        llm.generate("Hello", n=3)
    with pytest.raises(PagedgenError, match=r"keyword max_num_batched_tokens must be >= "
                                            r"keyword max_num_seqs|keyword max_num_seqs 4 is "
                                            r"more than max_num_batched_tokens \(2: keyword"):
        LLM(device="cpu", max_num_seqs=4, max_num_batched_tokens=2)


@pytest.mark.parametrize("args,lines,message", [
    # a profile's max_model_len (was "--max-model-len ...", an option the user never gave)
    (["--profile", "{prof}"], [{"prompt": "a"}],
     r"p\.yaml:\d+: engine\.max_model_len 9,999 is more than .* context \(2,048 tokens"),
    # OpenAI's top_logprobs out of range (was named as 'logprobs')
    ([], [{"custom_id": "a", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}}],
     r"p\.jsonl:1: body 'top_logprobs' must be in 0\.\.20"),
    # a tool-call history (was "must be a non-empty list of ... objects")
    ([], [{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
           "tool_calls": [{"id": "t", "type": "function"}]}]}],
     r"p\.jsonl:1: 'messages'\[1\] is a tool call or a tool's result: pagedgen runs no "
     r"tools"),
    # Ollama's "images" beside a prompt (was metadata: the prompt ran without its image)
    ([], [{"prompt": "describe it", "images": ["cat.png"]}],
     r"p\.jsonl:1: field 'images' is not read as images: give them as a chat message's "
     r"content parts .* or as 'multi_modal_data'"),
    # a KV cache the user sized too small (was "give --kv-cache-memory")
    (["--kv-cache-memory", "100"], [{"prompt": "a"}],
     r"--kv-cache-memory 100 holds 0 KV-cache block\(s\) of 16 tokens .* needs at least 2"),
])
def test_a_message_names_what_the_user_gave_where(tmp_path, args, lines, message):
    import re

    prof = tmp_path / "p.yaml"
    prof.write_text("model: tiny\nengine:\n  max_model_len: 9999\n")
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = runner.invoke(app, ["generate", *STOP, str(src), "-o", str(tmp_path / "o.jsonl"), *FAST,
                              *[a.format(prof=prof) for a in args]])
    out = " ".join(res.output.split())
    assert res.exit_code == 1 and out.startswith("error: ") and "Traceback" not in out, out
    assert re.search(message, out), out


# ---- verify checks what the model uses ----------------------------------------------------------

def test_verify_of_a_hybrid_model_skips_the_prefix_cache_and_says_so(tmp_path):
    """A Qwen3.5 checkpoint (linear-attention layers: its runs cache no prefixes) used to fail
    ``verify --model-only`` on its prefix-cache rows; they are left out, with why."""
    ckpt = make_checkpoint("qwen3_5_text", tmp_path / "hybrid")
    out = tmp_path / "v.json"
    res = runner.invoke(app, ["verify", "--backend", "sdpa", "--model", str(ckpt), "--dtype",
                              "float32", "--model-only", "--device", "cpu", "--steps", "3",
                              "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "not checked: prefix-cached prefill" in " ".join(res.output.split())
    (rep,) = json.loads(out.read_text())["backends"]
    assert rep["rows"] and all(r["passed"] for r in rep["rows"])
    assert not any("prefix" in r["group"] for r in rep["rows"])
    assert rep["not_checked"][0][0] == "prefix-cached prefill"


# ---- Hugging Face Hub ids (issue 99's first item) -----------------------------------------------

@pytest.mark.parametrize("model,revision,message", [
    ("tiny", "v1", "--revision applies to a Hugging Face Hub id (--model org/name), not tiny"),
    (None, "v1", "not the default preset"),
    ("acme/m@v2", "v1", "--revision v1 and --model acme/m@v2 both name a revision"),
    ("acme/m", " ", "--revision is empty"),
])
def test_a_revision_needs_a_hub_id_and_only_one(model, revision, message):
    from pagedgen.runtime.inputs.settings import engine_and_sampling
    with pytest.raises(PagedgenError, match=re.escape(message)):
        engine_and_sampling(None, model, {}, {}, revision=revision)
    cfg, _, _ = engine_and_sampling(None, "acme/m", {}, {}, revision="v1")
    assert cfg.model == "acme/m@v1"


@pytest.mark.process
def test_a_hub_id_in_the_users_cache_is_the_same_model_as_its_folder(tmp_path):
    """``--model org/name`` with ``HF_HUB_OFFLINE=1`` reads the user's Hugging Face cache (its
    layout: refs/main naming a snapshot) and writes what the folder itself gives; an id the
    cache lacks is one line naming the command that downloads it."""
    import os
    import subprocess
    import sys

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hf" / "hub" / "models--acme--tiny-llama"
    snapshot = make_checkpoint("llama", repo / "snapshots" / commit, with_tokenizer=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    src = prompts(tmp_path / "p.jsonl")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}

    def generate(model: str, out: str, *more: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pagedgen.cli.main", "generate", str(src),
                               "--model", model, "-o", str(tmp_path / out), *FAST, *more],
                              capture_output=True, text=True, env=env, timeout=300)

    hub, local = generate("acme/tiny-llama", "hub.jsonl"), generate(str(snapshot), "dir.jsonl")
    assert hub.returncode == 0 and local.returncode == 0, hub.stderr[-2000:]
    assert texts(tmp_path / "hub.jsonl") == texts(tmp_path / "dir.jsonl")
    at = generate("acme/tiny-llama", "at.jsonl", "--revision", commit)  # the same snapshot
    assert at.returncode == 0 and texts(tmp_path / "at.jsonl") == texts(tmp_path / "dir.jsonl")
    miss = generate("acme/absent", "miss.jsonl")
    err = miss.stderr.strip()
    assert miss.returncode == 1 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "not in the Hugging Face cache" in err and "hf download acme/absent" in err
