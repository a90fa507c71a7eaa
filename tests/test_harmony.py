"""gpt-oss chats through openai-harmony: the vocabulary file written from the checkpoint's own
tokenizer, the messages as harmony reads them, and the chat template (with the reason said)
wherever the library cannot take the checkpoint."""

import base64
import sys

import pytest
from hf_models import make_checkpoint

from pagedgen.runtime.models.harmony import HarmonyChat, tiktoken_vocab
from pagedgen.runtime.models.loader import load_tokenizer, resolve_model
from pagedgen.runtime.models.tokenizer import HFTokenizer


def save_byte_level_tokenizer(path):
    """A byte-level BPE tokenizer (gpt-oss's kind) with a few merges, two added tokens and a
    chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab, merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|startoftext|>",
                                   eos_token="<|return|>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(path)
    return len(vocab)


def test_the_vocabulary_file_holds_each_ordinary_tokens_bytes_in_id_order(tmp_path):
    n = save_byte_level_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path, None)
    lines = tiktoken_vocab(tok.ordinary_tokens()).decode().splitlines()
    assert len(lines) == n  # the added tokens are not BPE ranks
    assert [int(line.split()[1]) for line in lines] == list(range(n))
    for line in lines:
        piece, rank = line.split()
        assert base64.b64decode(piece) == tok.token_bytes(int(rank))
    hello = tok.encode("hello world", add_special_tokens=False)
    pieces = dict(tok.ordinary_tokens())
    assert b"".join(pieces[i] for i in hello) == b"hello world"


def test_a_word_level_vocabulary_gives_no_harmony_tokens(tmp_path):
    ckpt = make_checkpoint("llama", tmp_path, with_tokenizer=True)
    assert HFTokenizer(ckpt, None).ordinary_tokens() == []


class Recorder:
    """An encoding that keeps the conversation it is asked to render."""

    def render_conversation_for_completion(self, conversation, role):
        self.conversation, self.role = conversation, role
        return [1, 2, 3]


def test_messages_render_in_harmonys_roles_and_channels():
    oh = pytest.importorskip("openai_harmony")
    enc = Recorder()
    ids = HarmonyChat(enc).render([
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "salut"},
        {"role": "user", "content": "and?"}], {"reasoning_effort": "high"})
    assert ids == [1, 2, 3] and enc.role == oh.Role.ASSISTANT
    msgs = enc.conversation.messages
    assert [m.author.role for m in msgs] == [oh.Role.SYSTEM, oh.Role.DEVELOPER, oh.Role.USER,
                                             oh.Role.ASSISTANT, oh.Role.USER]
    assert msgs[0].content[0].reasoning_effort == oh.ReasoningEffort.HIGH
    assert msgs[1].content[0].instructions == "Answer in French."
    assert msgs[3].channel == "final" and msgs[3].content[0].text == "salut"
    HarmonyChat(enc).render([{"role": "user", "content": "x"}], {"reasoning_effort": "minimal"})
    assert enc.conversation.messages[0].content[0].reasoning_effort == oh.ReasoningEffort.LOW
    with pytest.raises(ValueError, match="no role 'tool'"):
        HarmonyChat(enc).render([{"role": "tool", "content": "x"}])
    for options in ({"continue_final_message": True}, {"add_generation_prompt": False}):
        with pytest.raises(ValueError, match="always opens the assistant's turn"):
            HarmonyChat(enc).render([{"role": "user", "content": "x"}], options)


def test_gpt_oss_renders_with_its_template_and_says_why_when_harmony_cannot_load(tmp_path,
                                                                               monkeypatch):
    pytest.importorskip("openai_harmony")
    ckpt = make_checkpoint("gpt_oss", tmp_path / "oss")
    save_byte_level_tokenizer(ckpt)
    chat = [{"role": "user", "content": "hello"}]
    tok = load_tokenizer(resolve_model(str(ckpt)))
    # the library checks the vocabulary file's hash: this one is not gpt-oss's o200k
    assert tok.renderer is None
    assert tok.chat_format.startswith("chat template (the checkpoint's vocabulary is not")
    assert tok.apply_chat_template(chat) == tok.encode("user: hello\nassistant:")
    monkeypatch.setitem(sys.modules, "openai_harmony", None)  # not installed
    tok = load_tokenizer(resolve_model(str(ckpt)))
    assert tok.chat_format == "chat template (openai-harmony is not installed " \
                              "(pip install openai-harmony))"
    llama = make_checkpoint("llama", tmp_path / "llama", with_tokenizer=True)
    assert load_tokenizer(resolve_model(str(llama))).chat_format is None  # no choice to say


def test_the_summary_says_how_a_gpt_oss_chat_was_rendered(tmp_path):
    import json

    from typer.testing import CliRunner

    from pagedgen.cli.app import app

    ckpt = make_checkpoint("gpt_oss", tmp_path / "oss", with_tokenizer=True)
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "a b"}],
                               "max_tokens": 2}) + "\n")
    res = CliRunner().invoke(app, ["generate", str(src), "--model", str(ckpt), "--device",
                                   "cpu", "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["chat_format"].startswith("chat template (")


def test_the_python_api_says_how_a_gpt_oss_chat_renders(tmp_path):
    from pagedgen import LLM

    ckpt = make_checkpoint("gpt_oss", tmp_path / "oss", with_tokenizer=True)
    llm = LLM(model=str(ckpt), device="cpu", dtype="float32")
    assert llm.chat_format.startswith("chat template (")
    out = llm.generate({"messages": [{"role": "user", "content": "a b"}]}, max_tokens=2)
    assert len(out[0].token_ids) == 2
    assert LLM(model="tiny", device="cpu").chat_format is None  # no choice to say
