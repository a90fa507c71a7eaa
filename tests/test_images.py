"""Images in prompts (issue 96): a random tiny Qwen3.5 multimodal checkpoint (vision tower,
hybrid language model, Qwen2-VL's image processor) gives transformers' greedy tokens for
prompts with no image, one, two of other sizes in one message, an image in a multi-turn chat,
through chunked prefill that splits an image's tokens and through preemption; an image two
prompts share runs through the tower once; the M-RoPE positions are transformers'; an image
that cannot be read, or a model that takes none, is a one-line error."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from hf_models import make_checkpoint, make_vision_checkpoint

from pagedgen.errors import PagedgenError
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.engine import Engine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def image(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_vision_checkpoint(tmp_path_factory.mktemp("qwen3_5_vl"))


def chat(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def reference(hf, messages, images, max_tokens: int = 8) -> list[int]:
    """transformers' greedy tokens: the template's placeholders repeated per image, as its
    processor does, with the image processor's pixels."""
    model, tok, proc = hf
    ids = chat(tok, messages)
    pad = model.config.image_token_id
    kw = {}
    if images:
        pix = proc(images=images, return_tensors="pt")
        counts = iter((pix["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for i in ids for t in ([pad] * next(counts) if i == pad else [i])]
        kw = dict(pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"])
    x = torch.tensor([ids])
    kw["mm_token_type_ids"] = (x == pad).int()
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                             max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def engine(ckpt, **kw) -> Engine:
    args = dict(model=str(ckpt), device="cpu", dtype="float32", backend="eager", block_size=8,
                num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    return Engine(EngineConfig(**{**args, **kw}))


def generate(eng: Engine, hf, cases, params: SamplingParams = LONG) -> list:
    """Each case (messages, images) a request of ``params`` through ``eng``, run together:
    their sequences."""
    seqs = []
    for messages, images in cases:
        ids = chat(hf[1], messages)
        ids, mm = eng.prompt_images(ids, images) if images else (ids, None)
        seqs.append(eng.add_request(ids, params, images=mm))
    eng.run()
    return seqs


def msg(*parts, role="user") -> dict:
    return {"role": role, "content": [{"type": "image"} if not isinstance(p, str)
                                      else {"type": "text", "text": p} for p in parts]}


CASES = {
    "no image": ([msg("a b c")], []),
    "one image": ([msg(0, "d e f")], [image(60, 90, 0)]),
    "two images of other sizes": ([msg(0, "g h", 1, "i")], [image(60, 90, 1),
                                                            image(100, 40, 2)]),
    "an image in a multi-turn chat": ([msg(0, "j k"), {"role": "assistant", "content": "l m"},
                                       msg("n o p")], [image(70, 70, 3)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_transformers(ckpt, hf, case):
    messages, images = CASES[case]
    want = reference(hf, messages, images, LONG.max_tokens)
    assert generate(engine(ckpt), hf, [CASES[case]])[0].output_token_ids == want


def test_chunks_that_split_an_image_and_preemption_give_the_same_tokens(ckpt, hf):
    """Chunks of 4 tokens (an image's 6 to 20 tokens cut across steps) and a cache of 10
    pages of 8 for three prompts at once (a preemption, whose recompute takes the tower's
    embeddings from the cache); an image shared by two prompts is encoded once; an image's
    pixels are made when its sequence is queued and let go once it is encoded."""
    shared = image(90, 60, 4)
    prompts = [([msg(0, "q r")], [shared]), ([msg(0, "s")], [shared]),
               CASES["two images of other sizes"]]
    want = [reference(hf, m, im, LONG.max_tokens) for m, im in prompts]
    eng = engine(ckpt, max_num_batched_tokens=4, num_blocks=10, max_num_seqs=3)
    seqs = []
    for messages, images in prompts:
        ids, mm = eng.prompt_images(chat(hf[1], messages), images)
        assert all(im.pixel_values is None for im in mm.images)  # sized, pixels let go
        seqs.append(eng.add_request(ids, LONG, images=mm))
        assert all(im.pixel_values is not None for im in mm.images)  # being made ahead
    eng.run()
    assert [s.output_token_ids for s in seqs] == want
    assert all(im.pixel_values is None for s in seqs for im in s.mm.images)  # encoded: gone
    assert eng.stats.num_preemptions > 0
    summary = eng.summary(100.0, 0.0)
    assert summary["images_encoded"] == 3 and summary["image_cache_hits"] > 0
    # the tower's time, counted once per run of it, and its share of the run's 100 s
    assert 0 < summary["vision_encoder_s"] < 100 and summary["image_pixel_wait_s"] >= 0
    assert summary["vision_encoder_share"] == summary["vision_encoder_s"] / 100
    assert summary["vision_attention"] == "sdpa"  # FA4 not asked
    eng.reset_stats()  # between benchmark runs: every image figure from zero
    after = eng.summary(100.0, 0.0)
    assert (after["images_encoded"], after["vision_encoder_s"], after["image_pixel_wait_s"]) \
        == (0, 0.0, 0.0)


def test_an_embeddings_cache_over_its_bytes_keeps_only_the_steps_images(ckpt, hf):
    """The chunked prompts again with the cache bounded to one byte: after each step only
    that step's images stay (their bytes counted), an image needed again by a later chunk or
    a recompute is encoded again, and the tokens are still transformers'."""
    shared = image(90, 60, 4)
    prompts = [([msg(0, "q r")], [shared]), ([msg(0, "s")], [shared]),
               CASES["two images of other sizes"]]
    want = [reference(hf, m, im, LONG.max_tokens) for m, im in prompts]
    eng = engine(ckpt, max_num_batched_tokens=4, num_blocks=10, max_num_seqs=3)
    enc = eng.runner.images
    enc.capacity_bytes = 1
    made = [eng.prompt_images(chat(hf[1], m), im) for m, im in prompts]
    seqs = [eng.add_request(ids, LONG, images=mm) for ids, mm in made]
    seen = []
    while eng.has_unfinished():
        eng.step()
        seen.append(len(enc.cache))
        assert enc.cache_bytes == sum(e.nbytes for e in enc.cache.values())
    assert [s.output_token_ids for s in seqs] == want
    assert max(seen) <= 2 and enc.encoded > 3  # a step's own; evicted ones encoded again


def test_mrope_positions_are_transformers(ckpt, hf):
    model, tok, proc = hf
    messages, images = CASES["two images of other sizes"]
    ids, mm = engine(ckpt).prompt_images(chat(tok, messages), images)
    x = torch.tensor([ids])
    want, delta = model.model.get_rope_index(
        x, (x == model.config.image_token_id).int(),
        image_grid_thw=proc(images=images, return_tensors="pt")["image_grid_thw"])
    assert torch.equal(mm.positions, want[:, 0]) and mm.delta == int(delta)
    assert torch.equal(mm.rope_positions(len(ids), len(ids) + 2),
                       torch.tensor([len(ids), len(ids) + 1]).expand(3, -1) + mm.delta)


def test_images_by_path_url_and_data_url_and_the_errors(ckpt, hf, tmp_path, monkeypatch):
    """A path, a ``file://`` URL and a ``data:`` URL give the same prompt; a missing file, a
    file that is not an image, bad base64, a folder, a decompression bomb, an image the
    processor refuses (sides past 200:1) and a model without a vision tower are one-line
    errors."""
    eng = engine(ckpt)
    img = image(60, 90, 5)
    img.save(tmp_path / "x.png")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    ids = chat(hf[1], [msg(0, "t")])
    made = [eng.prompt_images(ids, [ref]) for ref in (img, str(tmp_path / "x.png"),
                                                      f"file://{tmp_path / 'x.png'}", data)]
    assert all(m[0] == made[0][0] and m[1].images[0].key == made[0][1].images[0].key
               for m in made)
    with pytest.raises(PagedgenError, match=r"^line 3: cannot read the image '.*nope.png'"):
        eng.prompt_images(ids, [str(tmp_path / "nope.png")], "line 3")
    (tmp_path / "text.png").write_text("not an image")
    for bad in (str(tmp_path / "text.png"), "data:image/png;base64,@@@", str(tmp_path)):
        with pytest.raises(PagedgenError, match="^line 3: cannot read the image"):
            eng.prompt_images(ids, [bad], "line 3")
    from PIL import Image
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # a decompression bomb's size
    with pytest.raises(PagedgenError, match="cannot read the image .*DecompressionBombError"):
        eng.prompt_images(ids, [str(tmp_path / "x.png")], "line 3")
    monkeypatch.undo()
    from PIL import Image as PILImage
    wide = PILImage.new("RGB", (4000, 4))  # past Qwen's processor's 200:1 sides
    wide.save(tmp_path / "wide.png")
    for ref, named in ((wide, "of 4000 x 4 pixels"), (str(tmp_path / "wide.png"), "'/.*'")):
        with pytest.raises(PagedgenError, match=f"^line 3: the image processor refuses the "
                                                f"image {named}: ValueError: .*aspect ratio"):
            eng.prompt_images(ids, [ref], "line 3")
    with pytest.raises(PagedgenError, match="line 3: the prompt has 1 image placeholder"):
        eng.prompt_images(ids, [img, img], "line 3")
    plain = Engine(EngineConfig(model=str(make_checkpoint("qwen3_5_text", tmp_path / "text")),
                                device="cpu", dtype="float32", num_blocks=16))
    with pytest.raises(PagedgenError, match="takes no images"):
        plain.prompt_images([1, 2], [img])


def test_prefix_cache_keys_tell_images_apart():
    """Two prompts of the same ids (an image's placeholders are the same token for every
    image) key the blocks holding image tokens by the image, the blocks before alike."""
    from pagedgen.runtime.engine.prefix_cache import block_keys
    from pagedgen.runtime.engine.sequence import Sequence
    from pagedgen.runtime.models.multimodal import ImageInput, MultiModalPrompt

    ids = [5] * 8 + [9] * 8 + [6] * 8

    def seq(key: bytes) -> Sequence:
        mm = MultiModalPrompt([ImageInput(None, (1, 2, 4), key, 10, 2)], torch.zeros(3, 24), 0)
        return Sequence(0, list(ids), GREEDY, 0, mm=mm)

    a, b = block_keys(seq(b"a"), 8, 3), block_keys(seq(b"b"), 8, 3)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # the image's block, then its heirs


def image_lines(hf, tmp_path) -> tuple[list[str], list]:
    """A file of chat lines with ``image_url`` parts (a path, a data URL, a missing file), and
    the command's arguments (defaults but greedy) with what each line should hold:
    transformers' tokens, or for the missing image its line's error."""
    import json

    img = image(60, 90, 6)
    img.save(tmp_path / "x.png")
    buf = io.BytesIO()
    image(100, 40, 7).save(buf, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    def part(url):
        return {"type": "image_url", "image_url": {"url": url}}

    lines = [[part(str(tmp_path / "x.png")), {"type": "text", "text": "d e"}],
             [part(data), {"type": "text", "text": "f"}],
             [part(str(tmp_path / "missing.png")), {"type": "text", "text": "g"}]]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}],
                                       "max_tokens": 8, "temperature": 0}) + "\n"
                           for c in lines))
    want = [reference(hf, [{"role": "user", "content": [{"type": "image"}, content[1]]}], [pil])
            for content, pil in zip(lines, [img, image(100, 40, 7)])]
    return [str(src), "-o", str(tmp_path / "o.jsonl"), "--device", "cpu", "--dtype",
            "float32", "--on-bad-line", "error"], want + ["cannot read the image"]


def check_image_lines(out, want) -> None:
    import json

    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["token_ids"] for line in got[:2]] == want[:2], got
    assert want[2] in got[2]["error"] and "p.jsonl:3" in got[2]["error"]


def test_lines_with_images_from_the_command_line(ckpt, hf, tmp_path):
    """``pagedgen generate`` on chat lines with images: transformers' tokens; a line whose
    image cannot be read is its own error record (the others run); ``--resume`` of a file
    cut short writes the whole run's."""
    from typer.testing import CliRunner

    from pagedgen.cli.app import app

    args, want = image_lines(hf, tmp_path)
    args = ["generate", *args, "--model", str(ckpt)]
    out = tmp_path / "o.jsonl"
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    check_image_lines(out, want)
    whole = out.read_text()
    out.write_text(whole.splitlines(keepends=True)[0])
    res = CliRunner().invoke(app, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert out.read_text() == whole


@pytest.mark.parametrize("how", [["-dp", "2"], ["--ray", "local", "--replicas", "2"]],
                         ids=["dp", "ray"])
@pytest.mark.process
def test_lines_with_images_run_on_replicas(ckpt, hf, tmp_path, how):
    """The same lines on ``-dp 2`` worker processes and on Ray replicas: the images made
    ready in the command's process (a bad one is its line's error there), the requests
    travelling with their images' bytes: transformers' tokens."""
    from typer.testing import CliRunner

    from pagedgen.cli.app import app

    ray = pytest.importorskip("ray") if how[0] == "--ray" else None
    args, want = image_lines(hf, tmp_path)
    try:
        res = CliRunner().invoke(app, ["generate", *args, "--model", str(ckpt), *how])
    finally:
        if ray is not None:  # the command's local instance: tests after it start their own
            ray.shutdown()
    assert res.exit_code == 0, res.output
    check_image_lines(tmp_path / "o.jsonl", want)


def test_the_python_api_takes_pil_images_in_chats_and_multi_modal_data(ckpt, hf):
    """``LLM.chat`` with an ``image_pil`` part and ``LLM.generate`` with vLLM's
    ``multi_modal_data`` on a prompt holding the placeholder: transformers' tokens; an image
    without its placeholder is an error naming the prompt."""
    from pagedgen import LLM

    llm = LLM(model=str(ckpt), device="cpu", dtype="float32")
    img = image(60, 90, 8)
    messages = [msg(0, "d e")]
    want = reference(hf, messages, [img])
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                         {"type": "text", "text": "d e"}]}]
    out = llm.chat(chat, max_tokens=8, temperature=0, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want
    text = hf[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, max_tokens=8,
                       temperature=0, use_tqdm=False)
    assert out[0].outputs[0].token_ids == want
    with pytest.raises(PagedgenError, match="prompt 0: the prompt has 0 image placeholder"):
        llm.generate({"prompt": "a b", "multi_modal_data": {"image": img}}, use_tqdm=False)
    with pytest.raises(PagedgenError, match=r"^prompt 0: 'multi_modal_data' must be "
                                            r"\{\"image\": an image or a list of them\} \(URLs"):
        llm.generate({"prompt": text, "multi_modal_data": {"video": [img]}}, use_tqdm=False)


def test_the_memory_profile_runs_the_towers_largest_call(ckpt, monkeypatch):
    """(On a GPU the profile's peak then counts the tower.) A call holds the step's budget
    or the largest image the processor makes, whichever is more; the profile encodes that
    many tokens at least, in square images of whole merged patches, none over the bound."""
    from pagedgen.runtime.models.families import qwen3_5

    proc = engine(ckpt).runner.images.prompter.processor
    largest = proc.size["longest_edge"] // (proc.patch_size * 2) ** 2
    monkeypatch.setattr(qwen3_5, "PROFILE_IMAGE_TOKENS", 9)
    for budget, side, images in ((largest - 7, 3, 2), (largest + 7, 3, 3)):
        enc = engine(ckpt, max_num_batched_tokens=budget).runner.images
        seen = []
        real = enc.model.encode_images
        enc.model.encode_images = lambda pixels, grids: seen.append(grids) or real(pixels, grids)
        enc.profile()
        assert enc.call_tokens == max(budget, largest)
        assert seen == [[(1, 2 * side, 2 * side)] * images]  # 9 tokens an image
        assert images * side ** 2 >= enc.call_tokens


def test_a_steps_images_are_encoded_in_calls_of_at_most_the_towers_budget(ckpt, hf):
    """Five images in one step with the tower's calls bounded: each call holds at most
    ``call_tokens`` image tokens (one image above it alone), every image is encoded once,
    and the tokens are transformers'."""
    sizes = [(60, 90), (100, 40), (70, 70), (40, 40), (90, 60)]
    cases = [([msg(0, "a", 1, "b")], [image(*sizes[0], 10), image(*sizes[1], 11)]),
             ([msg(0, "c")], [image(*sizes[2], 12)]),
             ([msg(0, "d", 1)], [image(*sizes[3], 13), image(*sizes[4], 14)])]
    want = [reference(hf, m, im, GREEDY.max_tokens) for m, im in cases]
    eng = engine(ckpt, max_num_batched_tokens=512, num_blocks=128)
    enc = eng.runner.images
    enc.call_tokens = 8
    calls = []
    real = enc.model.encode_images
    enc.model.encode_images = lambda pixels, grids: calls.append(
        [t * h * w // 4 for t, h, w in grids]) or real(pixels, grids)
    seqs = generate(eng, hf, cases, GREEDY)
    assert [s.output_token_ids for s in seqs] == want
    assert sorted(n for c in calls for n in c) == sorted(im.num_tokens for s in seqs
                                                         for im in s.mm.images)
    assert len(calls) > 1 and all(sum(c) <= 8 or len(c) == 1 for c in calls)


def test_samples_forked_from_an_image_prompt_share_its_prefill(ckpt, hf):
    """``n`` = 3 greedy samples of one image prompt: one prefill (the image encoded once),
    three forks, each transformers' tokens."""
    from pagedgen.runtime.config import SamplingParams

    messages, images = CASES["one image"]
    want = reference(hf, messages, images, LONG.max_tokens)
    eng = engine(ckpt)
    ids, mm = eng.prompt_images(chat(hf[1], messages), images)
    seq = eng.add_request(ids, SamplingParams(max_tokens=LONG.max_tokens, temperature=0.0,
                                              ignore_eos=True, n=3), images=mm)
    eng.run()
    assert [s.output_token_ids for s in seq.samples] == [want] * 3
    assert eng.summary(1.0, 0.0)["images_encoded"] == 1


def test_images_are_read_in_threads_before_the_run_and_counted(ckpt, hf):
    """``LocalDriver.prepare``: every request's images read and sized (the command's "reading
    images" bar counts them), each request's result kept for its ``check``."""
    from array import array

    from pagedgen.runtime.drivers.driver import LocalDriver
    from pagedgen.runtime.inputs.request import Request

    driver = LocalDriver(EngineConfig(model=str(ckpt), device="cpu", dtype="float32",
                                      num_blocks=64), SamplingParams())
    ids = chat(hf[1], [msg(0, "a", 1, "b")])
    reqs = [Request(i, i + 1, i, prompt_token_ids=array("i", ids),
                    images=[image(40 + 10 * i, 60, i), image(60, 40, i)]) for i in range(5)]
    seen = []
    driver.prepare(reqs, seen.append)
    assert sorted(seen) == [2] * 5
    for r in reqs:
        driver.check(r)
        assert r.mm is not None and len(r.prompt_token_ids) > len(ids)


def test_an_image_file_gone_after_the_check_still_runs(ckpt, hf, tmp_path):
    """The check keeps an image's bytes, not its path: the pixels made during the run do not
    read the file again (a file deleted, or a URL that fails the second time, mid-run)."""
    img = image(60, 90, 11)
    img.save(tmp_path / "gone.png")
    messages = [msg(0, "w")]
    want = reference(hf, messages, [img], LONG.max_tokens)
    eng = engine(ckpt)
    ids, mm = eng.prompt_images(chat(hf[1], messages), [str(tmp_path / "gone.png")])
    (tmp_path / "gone.png").unlink()
    seq = eng.add_request(ids, LONG, images=mm)
    eng.run()
    assert seq.output_token_ids == want


def test_the_progress_bar_counts_the_images_of_finished_requests(monkeypatch):
    """On a terminal, the run's bar counts the images of the requests written so far."""
    from rich.console import Console

    from pagedgen.cli.generate import stream

    term = Console(file=io.StringIO(), force_terminal=True, width=200)
    monkeypatch.setattr(stream, "console", term)

    class Writer:
        def write_lines(self, lines):
            pass

        def close(self, reorder=True):
            pass

    batches = [([(0, "{}"), (1, "{}")], 10), ([(2, "{}")], 20)]
    stream.stream_output(Writer(), 3, batches, quiet=False, images={0: 2, 2: 1, 5: 4})
    shown = term.file.getvalue()
    assert "3/7 images, 20 tokens out" in shown, shown
    stream.stream_output(Writer(), 3, batches, quiet=False)
    assert "images" not in term.file.getvalue().replace(shown, "")


def test_the_tower_takes_its_index_tensors_from_the_host(ckpt, monkeypatch):
    """The vision tower's interpolation indices, rotary positions and sequence bounds are
    made on the host and given to it (on a GPU, made there, the tower would read them back
    and wait for the queue): its own helpers find each one given, and compute none."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    computed = []
    for name in ("get_vision_interpolation_indices_and_weights", "get_vision_position_ids",
                 "get_vision_attention_seqlens"):
        own = getattr(m, name)

        def given(*a, _own=own, _name=name, kwargs=None, **kw):
            keys = {"interp_indices", "position_ids", "cu_seqlens"} & set(kwargs or {})
            if not keys:
                computed.append(_name)
            return _own(*a, kwargs=kwargs, **kw)

        monkeypatch.setattr(m, name, given)
    model = engine(ckpt).runner.model
    grid = (1, 4, 6)
    out = model.encode_images([torch.randn(24, 3 * 2 * 16 * 16)], [grid])
    assert computed == [] and out[0].shape[0] == 6


def test_the_towers_attention_leaves_cudnn_out(ckpt, monkeypatch):
    """The tower's SDPA calls run with cuDNN's attention switched off (on Hopper torch prefers
    it, and it builds a plan for every new image size) and the other kernels on; the
    language model's calls after it find cuDNN as torch left it."""
    import torch.nn.functional as F

    seen = []
    own = F.scaled_dot_product_attention

    def sdpa(*a, **kw):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(),
                     torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled()))
        return own(*a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    model = engine(ckpt).runner.model
    before = torch.backends.cuda.cudnn_sdp_enabled()
    model.encode_images([torch.randn(24, 3 * 2 * 16 * 16)], [(1, 4, 6)])
    assert seen and set(seen) == {(False, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.kernels
def test_the_towers_fused_rotary_turns_q_and_k_as_transformers_does(ckpt, monkeypatch):
    """With the fused kernels on (a GPU; here Triton's interpreter), the tower's attention
    turns q and k in one kernel, and every layer hands its attention transformers' turned q
    and k (the tiny tower's attention is near uniform, so its output alone would not tell)."""
    from pagedgen.runtime.layers import fused_ops
    from pagedgen.runtime.models.families.qwen3_5 import VisionAttention

    if not fused_ops.HAVE_TRITON:
        pytest.skip("triton is not installed")
    model = engine(ckpt).runner.model
    packed = next(m for m in model.visual.modules() if isinstance(m, VisionAttention)).packed
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    monkeypatch.setattr(type(packed), "__call__",
                        lambda self, q, k, v, *a: seen.append((q, k)) or v)
    pixels = [torch.randn(24, 3 * 2 * 16 * 16), torch.randn(16, 3 * 2 * 16 * 16)]
    grids = [(1, 4, 6), (1, 4, 4)]
    model.encode_images(pixels, grids)
    want, seen[:] = list(seen), []
    calls = []
    own = fused_ops.rotary_fused
    monkeypatch.setattr(fused_ops, "rotary_fused", lambda *a: calls.append(1) or own(*a))
    model.use_fused_kernels(True)
    try:
        model.encode_images(pixels, grids)
    finally:
        model.use_fused_kernels(False)
    assert len(calls) == len(want) == len(seen) == len(model.visual.blocks)
    for (q, k), (wq, wk) in zip(seen, want):
        torch.testing.assert_close(q, wq, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k, wk, atol=1e-5, rtol=1e-5)
