"""Gemma 4's images (runtime/models/families/gemma4_vision.py, attention/image_blocks.py): a
random tiny ``gemma4`` multimodal checkpoint (a two-layer vision tower, a language model of
windows of 8 with per-layer inputs, Gemma 4's image processor) gives transformers' greedy
tokens and log-probabilities for prompts with no image, one, two of other sizes and an image
in a multi-turn chat; its images' tokens see their whole block on the window layers (the
published configs' ``use_bidirectional_attention: "vision"``), also when prefill chunks are
small; a step budget or a cache that cannot hold an image's block is a one-line error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hf_models import hf_vision, make_gemma4_vision_checkpoint
from test_images import CASES, chat, generate

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.models.multimodal import ImageInput, MultiModalPrompt

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma4_vision_checkpoint(tmp_path_factory.mktemp("gemma4_vl"))


def reference(hf, messages, images, blocks: bool = True) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their log-probabilities: each image token made
    ``boi``, the image's soft tokens and ``eoi`` (``Gemma4Processor``'s expansion), with the
    image processor's pixels; ``blocks``: the image tokens marked (``mm_token_type_ids``), so
    that they see each other."""
    model, tok, proc = hf
    cfg = model.config
    ids, kw = chat(tok, messages), {}
    if images:
        pix = proc(images=images, return_tensors="pt")
        counts = iter(pix["num_soft_tokens_per_image"].tolist())
        ids = [t for i in ids for t in ([cfg.boi_token_id] + [i] * next(counts)
                                        + [cfg.eoi_token_id] if i == cfg.image_token_id
                                        else [i])]
        kw = dict(pixel_values=pix["pixel_values"], image_position_ids=pix["image_position_ids"])
    x = torch.tensor([ids])
    if blocks:
        kw["mm_token_type_ids"] = (x == cfg.image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=PARAMS.max_tokens, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True, **kw)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.scores, tokens)]
    return tokens, logprobs


def engine(ckpt, **kw) -> Engine:
    args = dict(model=str(ckpt), device="cpu", dtype="float32", backend="eager", block_size=8,
                num_blocks=128, max_num_seqs=4, max_num_batched_tokens=256)
    return Engine(EngineConfig(**{**args, **kw}))




def run(eng: Engine, hf, cases) -> list:
    return generate(eng, hf, cases, PARAMS)


def check(seq, want) -> None:
    tokens, logprobs = want
    assert seq.output_token_ids == tokens
    assert [e[0] for e in seq.logprobs] == pytest.approx(logprobs, abs=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_and_logprobs_equal_transformers(ckpt, hf, case):
    messages, images = CASES[case]
    check(run(engine(ckpt), hf, [CASES[case]])[0], reference(hf, messages, images))


def test_image_tokens_seeing_each_other_change_what_the_model_says(ckpt, hf):
    """The check above can fail: transformers' own log-probabilities move when the image
    tokens attend causally only (so a causal pagedgen would not match them)."""
    messages, images = CASES["two images of other sizes"]
    both = reference(hf, messages, images)[1]
    causal = reference(hf, messages, images, blocks=False)[1]
    assert max(abs(a - b) for a, b in zip(both, causal)) > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_small_chunks_keep_each_image_whole(ckpt, hf, backend):
    """Chunks of at most 80 tokens (an image's 60 to 70 tokens never cut: a chunk ends
    before an image it cannot hold, and a chunk that starts at one holds it), three prompts
    at once, on two backends."""
    cases = [CASES["one image"], CASES["two images of other sizes"],
             CASES["an image in a multi-turn chat"]]
    eng = engine(ckpt, backend=backend, max_num_batched_tokens=80)
    seqs = run(eng, hf, cases)
    for seq, (messages, images) in zip(seqs, cases):
        check(seq, reference(hf, messages, images))


def test_a_cache_too_small_for_an_images_pages_at_once_is_a_one_line_error(ckpt, hf):
    """13 pages of 8 cannot hold a 68-token chunk's pages in all four KV groups at once (a
    window group holds a chunk's every token during its step): said, not stalled."""
    cases = [CASES["one image"], CASES["two images of other sizes"]]
    with pytest.raises(PagedgenError, match="more KV pages at once than the cache has"):
        run(engine(ckpt, max_num_batched_tokens=80, num_blocks=13), hf, cases)


def test_a_budget_smaller_than_an_image_is_a_one_line_error(ckpt):
    with pytest.raises(PagedgenError, match="max-num-batched-tokens 64 is too small; give at "
                                            "least 70"):
        engine(ckpt, max_num_batched_tokens=64)


def test_a_chunk_ends_before_an_image_it_would_cut():
    im = ImageInput(None, (1, 1, 5), b"k", start=10, num_tokens=5)
    mm = MultiModalPrompt([im], torch.zeros(3, 20, dtype=torch.long), 0, whole_blocks=True)
    assert mm.chunk_end(0, 12) == 10  # cut back to the image's start
    assert mm.chunk_end(10, 14) == 10  # from the image's start: nothing until it fits
    assert mm.chunk_end(12, 14) == 12  # from inside (a cached prefix): likewise
    assert mm.chunk_end(0, 15) == 15 and mm.chunk_end(0, 9) == 9
    mm.whole_blocks = False  # Qwen's images split anywhere
    assert mm.chunk_end(0, 12) == 12


def test_a_tower_that_standardizes_and_clips_loads_its_statistics_and_bounds(tmp_path):
    """A tower with ``standardize`` and ``use_clipped_linears`` (statistics and bounds the
    checkpoint holds as buffers) gives transformers' tokens and log-probabilities."""
    path = make_gemma4_vision_checkpoint(tmp_path, vision=dict(standardize=True,
                                                               use_clipped_linears=True))
    hf = hf_vision(path)
    messages, images = CASES["one image"]
    check(run(engine(path), hf, [CASES["one image"]])[0], reference(hf, messages, images))


def test_the_memory_profile_encodes_a_calls_worth_of_the_largest_images(ckpt):
    """Gemma 4's processor pads every image to its largest size, so a tower call weighs that
    much an image, and the profile encodes as many padded images as a call holds."""
    enc = engine(ckpt, max_num_batched_tokens=300).runner.images
    largest = enc.prompter.largest_image
    seen = []
    real = enc.model.vision.encode
    enc.model.vision.encode = lambda pixels: seen.append([p.shape[1] for p, _ in pixels]) \
        or real(pixels)
    enc.profile()
    k2 = enc.model.vision.vision_tower.config.pooling_kernel_size ** 2
    assert enc.call_tokens == max(300, largest)
    assert seen == [[largest * k2] * -(-enc.call_tokens // largest)]
    assert enc.prompter.tower_tokens(SimpleNamespace(num_tokens=3)) == largest
