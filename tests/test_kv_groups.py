"""KV groups by layer kind (issue 94): a model mixing sliding-window and full-attention layers
plans a group per kind over one pool of pages; a window group's sequence holds only its
window's pages, let go as the window slides; prefix caching, forks, preemption and resume keep
every group right, and tiny gpt-oss and Gemma 2/3 checkpoints give transformers' tokens in a
KV budget that holds every sequence only because their window layers keep just their window."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import make_checkpoint
from typer.testing import CliRunner

from pagedgen.attention.backend import LayerSpec
from pagedgen.runtime.config import EngineConfig, SamplingParams
from pagedgen.runtime.engine.block_manager import BlockManager
from pagedgen.runtime.engine.engine import Engine
from pagedgen.runtime.engine.kv_groups import plan_layout
from pagedgen.runtime.engine.sequence import Sequence

KINDS = ["gpt_oss", "gemma2", "gemma3_text"]  # 1:1 windows of 12 and full layers


def specs(windows, heads=((8, 64),)):
    """Layer specs with these windows (None: full), KV heads and head sizes cycling."""
    return [LayerSpec(16, heads[i % len(heads)][0], heads[i % len(heads)][1], 0.125, w)
            for i, w in enumerate(windows)]


# ---- planning ---------------------------------------------------------------------------------

def test_a_mixed_model_plans_a_group_per_kind_of_equally_many_layers():
    gpt_oss = plan_layout(specs([128, None] * 18))
    assert [(g.window, len(g.layers)) for g in gpt_oss.groups] == [(None, 18), (128, 18)]
    assert gpt_oss.num_slabs == 18 and sorted(gpt_oss.slots) == sorted(list(range(18)) * 2)
    # Gemma-3-27B: 52 window layers, 10 full (5:1, the last two windowed)
    gemma = plan_layout(specs(([1024] * 5 + [None]) * 10 + [1024] * 2))
    assert [(g.window, len(g.layers)) for g in gemma.groups] == \
        [(None, 10)] + [(1024, 10)] * 5 + [(1024, 2)]
    assert gemma.num_slabs == 10 and gemma.note is None
    for group in gemma.groups:  # each layer of a group in a slab of its own
        assert sorted(gemma.slots[i] for i in group.layers) == list(range(len(group.layers)))
    one = plan_layout(specs([None] * 4))
    assert len(one.groups) == 1 and one.num_slabs == 4 and one.note is None
    off = plan_layout(specs([128, None] * 2), enabled=False)
    assert len(off.groups) == 1 and "off" in off.note
    windows_only = plan_layout(specs([64, 512] * 2))  # the widest window keeps every page
    assert [(g.window, g.layers) for g in windows_only.groups] == [(None, (1, 3)), (64, (0, 2))]


def test_a_model_with_two_kv_shapes_shares_one_pool_of_pages():
    """Gemma-4-31B's shape: 50 window layers of 16 KV heads of 256, 10 global ones of 4 of 512
    (half as wide): the global layers take half a slab's page each, two to a slab, so every
    group has 5 slabs and the window groups' pages save memory as the one-shape models' do."""
    layout = plan_layout(specs(([1024] * 5 + [None]) * 10, heads=[(16, 256)] * 5 + [(4, 512)]))
    glob = tuple(range(5, 60, 6))
    assert [(g.window, len(g.layers)) for g in layout.groups] == [(None, 10)] + [(1024, 5)] * 10
    assert layout.groups[0].layers == glob and layout.num_slabs == 5 and layout.note is None
    assert [(layout.slots[i], layout.share(i)) for i in glob] == \
        [(j % 5, (j // 5, 2)) for j in range(10)]
    for g in layout.groups[1:]:  # a window layer fills its slab's page
        assert sorted(layout.slots[i] for i in g.layers) == list(range(5))
        assert {layout.share(i) for i in g.layers} == {(0, 1)}
    odd = plan_layout(specs([512, None] * 2, heads=[(8, 256), (3, 512)]))  # 2048 and 1536
    assert len(odd.groups) == 2 and odd.num_slabs == 4 and "do not divide" in odd.note


def test_layers_sharing_a_slab_write_their_own_bytes():
    """Each layer's cache is a view of its share of its slab's pages, in its backend's layout
    (a flash-attn slab keeps K and V apart; an eager group reads it through a view): a write
    into one layer leaves the bytes of every other layer of its group as they were (a page id
    belongs to one group at a time)."""
    from pagedgen.attention.eager import EagerBackend
    from pagedgen.attention.flash_attn.backend import FlashAttnBackend
    from pagedgen.attention.ops.kv_cache import write_kv
    from pagedgen.runtime.worker.kv_memory import KVMemory

    layer_specs = specs(([16] * 2 + [None]) * 2, heads=[(4, 32)] * 2 + [(1, 64)])
    layout = plan_layout(layer_specs)  # globals 2 and 5 (64 wide) share slab 0's pages
    group = layout.group_of()
    assert layout.groups[0].layers == (2, 5) and layout.num_slabs == 1
    for primary, backends in [(EagerBackend, None),  # the global group eager, the rest FA
                              (FlashAttnBackend, [EagerBackend] + [FlashAttnBackend] * 4)]:
        kv = KVMemory(primary, layer_specs, layout, 4, torch.float32, torch.device("cpu"),
                      backends)
        caches = kv.allocate(6)
        assert kv.page_bytes() == 2 * 4 * 128 * 4 * layout.num_slabs
        for i, cache in enumerate(caches):
            before = [c.clone() for c in caches]
            s = layer_specs[i]
            k = torch.randn(3, s.num_kv_heads, s.head_size)
            v = torch.randn(3, s.num_kv_heads, s.head_size)
            slots = torch.tensor([1, 9, 22])
            blocks = kv.layer_backends[i].blocks_view(cache)
            assert tuple(blocks.shape) == (6, 2, 4, s.num_kv_heads, s.head_size)
            write_kv(blocks, k, v, slots)
            assert torch.equal(blocks[slots // 4, 0, slots % 4], k)
            assert torch.equal(blocks[slots // 4, 1, slots % 4], v)
            for j, c in enumerate(caches):  # a page id is one group's: its layers apart
                if j != i and group[j] == group[i]:
                    assert torch.equal(c, before[j]), (i, j)


# ---- the block manager ------------------------------------------------------------------------

def seq(n: int, i: int = 0) -> Sequence:
    return Sequence(i, list(range(100 * i, 100 * i + n)), SamplingParams(), 0)


def step(bm: BlockManager, s: Sequence, n: int) -> None:
    """Schedule ``n`` new tokens of ``s`` and count them as computed."""
    bm.allocate(s, s.num_computed_tokens + n)
    s.num_computed_tokens += n


def test_window_pages_are_let_go_as_the_window_slides():
    bm = BlockManager(64, 4, windows=[6])
    s = seq(40)
    step(bm, s, 17)  # a chunk: the window group holds the chunk's pages for the step
    assert len(s.block_table) == 5 and s.group_first == [0]
    assert bm.held == [5, 5] and bm.num_free_blocks == 54
    step(bm, s, 1)  # the next query at 17 sees 12..17: blocks 3 and 4 (0-2 let go)
    assert s.group_first == [3] and bm.held == [5, 2]
    for _ in range(20):
        step(bm, s, 1)
        first = max(0, s.num_computed_tokens - 1 - 6 + 1) // 4
        assert s.group_first == [first]
        assert bm.held[1] == len(s.group_tables[0]) - first <= -(-6 // 4) + 1
    assert len(s.group_tables[0]) == len(s.block_table) == 10  # stale ids keep positions
    bm.free(s)
    assert bm.held == [0, 0] and bm.num_free_blocks == 64 and s.group_tables == []


def test_a_chunk_lets_its_window_pages_go_once_computed():
    bm = BlockManager(64, 4, windows=[6, None])
    s = seq(40)
    step(bm, s, 17)  # the chunk's step holds its window pages for all 17 tokens
    assert bm.held == [5, 5, 5]
    bm.slide(s)  # the next query, at 17, sees 12..17: blocks 3 and 4 (0-2 go)
    assert s.group_first == [3, 0] and bm.held == [5, 2, 5] and bm.num_free_blocks == 52
    bm.slide(s)  # nothing more to let go; the next step takes only its new pages
    assert bm.held == [5, 2, 5] and bm.pages_needed(s, 18) == 0
    step(bm, s, 4)  # 17..20: a page more in each group
    assert s.group_first == [3, 0] and bm.held == [6, 3, 6]


def test_what_a_sequence_needs_counts_every_group_net_of_pages_let_go():
    bm = BlockManager(64, 4, windows=[6, None])
    s = seq(40)
    assert bm.pages_needed(s, 9) == 3 + 3 + 3  # group 0, the window, another full group
    step(bm, s, 9)
    s.num_computed_tokens = 12  # positions 9..11 computed by steps not counted here
    before = bm.num_free_blocks
    need = bm.pages_needed(s, 13)  # window: lets blocks 0-1 go, takes block 3
    bm.allocate(s, 13)
    assert need == 1 + (1 - 1) + 1 and before - bm.num_free_blocks == need


def test_a_prefix_is_a_hit_only_where_every_group_resumes():
    bm = BlockManager(64, 4, prefix_caching=True, windows=[6])
    a = seq(30)
    step(bm, a, 30)
    bm.cache_blocks(a, 30)
    for _ in range(3):  # decodes: the window slides, its early pages go (still cached)
        a.token_ids.append(7)
        step(bm, a, 1)
    b = seq(30)
    hit = bm.match_prefix(b, 29)  # 7 full blocks cached in both groups
    assert len(hit) == 7 and hit.groups == [(5, a.group_tables[0][5:7])]
    bm.take_prefix(b, hit)
    assert b.group_first == [5] and b.num_computed_tokens == 28
    step(bm, b, 2)
    assert b.group_tables[0][5:7] == a.group_tables[0][5:7]  # shared, not copied
    # the window pages at the prefix's end evicted: the hit shortens to where both resume
    c, d = seq(30), seq(30)
    bm.free(a)
    bm.free(b)
    (key,) = [k for k in bm.cached if k[0] == 1 and k[1][1][0] == 24]  # the window's block 6
    bm.block_key[bm.cached.pop(key)] = None  # evicted
    hit = bm.match_prefix(c, 29)
    assert len(hit) == 6 and hit.groups[0][0] == (6 * 4 - 6 + 1) // 4
    assert len(bm.match_prefix(d, 29)) == 6


def test_a_fork_shares_full_window_pages_and_copies_the_last():
    bm = BlockManager(64, 4, windows=[6])
    parent, child = seq(18), seq(18, 1)
    step(bm, parent, 18)
    copies = bm.fork(parent, child, 18)
    assert len(copies) == 2  # the partial last block of each group
    assert child.group_tables[0][:4] == parent.group_tables[0][:4]
    assert child.group_first == parent.group_first
    assert all(bm.ref_counts[b] == 2 for b in parent.group_tables[0][
        parent.group_first[0]:4])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 64


# ---- a run: transformers' tokens in a budget only groups meet ---------------------------------

@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


PROMPTS = [torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (37, 29, 41, 33)]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def reference(path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]


def run(path, groups: bool, layer_pages: int, **kw) -> Engine:
    """An engine whose KV cache holds ``layer_pages`` pages of one layer (8 tokens each)."""
    probe = Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", backend="eager",
                                block_size=8, num_blocks=4))
    page = probe.runner.kv.layer_bytes[0]
    return Engine(EngineConfig(model=str(path), device="cpu", dtype="float32", backend="eager",
                               block_size=8, kv_cache_memory=layer_pages * page, max_num_seqs=8,
                               max_num_batched_tokens=64, kv_cache_groups=groups, **kw))


def test_window_layers_holding_their_window_fit_a_budget_that_otherwise_preempts(checkpoint):
    """4 sequences of up to 57 tokens, in 50 pages of one layer: 8 pages each for a full
    layer, 3 for a window of 12 (4 during a chunk), so every sequence fits at once; every page
    for every layer does not, and the same budget runs them in more steps (some wait, or are
    preempted). Both give transformers' tokens."""
    want = reference(checkpoint)
    steps = {}
    for groups in (True, False):
        eng = run(checkpoint, groups, 50)
        seqs = eng.generate(PROMPTS, PARAMS)
        assert [s.output_token_ids for s in seqs] == want, groups
        steps[groups] = eng.stats.num_steps
        if groups:
            assert eng.stats.num_preemptions == 0
        windows = [None] + [12] * sum(x.sliding_window is not None for x in eng.runner.specs)
        s = eng.summary(1.0, 0.0)
        assert [g["window"] for g in s["kv_groups"]] == (windows if groups else [None])
        assert s["kv_groups"][0]["peak_tokens_held"] > 0
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert steps[False] > steps[True]


def test_through_preemption_prefix_caching_and_forks_the_tokens_stay_transformers(checkpoint):
    """A budget that preempts even with groups; prompts sharing a prefix (cached, with the
    window's pages at its end); ``n`` samples forked from one prompt."""
    want = reference(checkpoint)
    eng = run(checkpoint, True, 24)
    seqs = eng.generate(PROMPTS, PARAMS)
    assert eng.stats.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == want
    shared = PROMPTS[2][:33]
    twice = eng.generate([shared + [5, 6], shared + [9]], PARAMS)
    assert eng.stats.prefix_hit_tokens > 0
    plain = run(checkpoint, True, 200, prefix_caching=False)
    assert [s.output_token_ids for s in twice] == \
        [s.output_token_ids for s in plain.generate([shared + [5, 6], shared + [9]], PARAMS)]
    forked = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.9, n=3,
                                                       seed=4, ignore_eos=True))[0]
    alone = plain.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0.9, n=3,
                                                        seed=4, ignore_eos=True))[0]
    assert [s.output_token_ids for s in forked.samples] == \
        [s.output_token_ids for s in alone.samples]


def test_a_windowed_model_resumes_to_the_same_file(checkpoint, tmp_path):
    """``--resume`` of a file cut short writes what one whole run writes."""
    from pagedgen.cli.app import app

    runner = CliRunner()
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": 8,
                                       "temperature": 0}) + "\n" for p in PROMPTS))
    out = tmp_path / "o.jsonl"
    args = ["generate", str(src), "--model", str(checkpoint), "-o", str(out), "--device",
            "cpu", "--backend", "eager", "--dtype", "float32", "--block-size", "8"]
    assert runner.invoke(app, args).exit_code == 0
    whole = out.read_text()
    out.write_text("".join(whole.splitlines(keepends=True)[:2]))
    res = runner.invoke(app, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert out.read_text() == whole


# ---- start-up never ends in a traceback -------------------------------------------------------

def test_auto_never_takes_the_eager_reference_on_a_gpu_and_says_why(monkeypatch):
    """gpt-oss with an FP8 KV cache: no GPU backend here took both sinks and FP8 pages, and
    ``auto`` fell through to the float32 reference (an out-of-memory traceback on an H100)."""
    from pagedgen.attention import registry
    from pagedgen.errors import PagedgenError

    monkeypatch.setitem(registry._AUTO_ORDER, "cuda", ["sdpa", "eager"])
    monkeypatch.setattr(registry, "unavailable_reason", lambda name, device: None)
    layer = LayerSpec(8, 2, 64, 0.125, 128, sinks=True)
    with pytest.raises(PagedgenError, match=r"no attention backend here runs m on cuda "
                                            r"\(sdpa: no FP8 KV cache\): the eager reference .*"
                                            r"--kv-cache-dtype auto"):
        registry.backend_for_model("auto", torch.device("cuda"), [layer], torch.bfloat16,
                                   torch.float8_e4m3fn, "m")
    assert registry.backend_for_model("eager", torch.device("cuda"), [layer], torch.bfloat16,
                                      torch.float8_e4m3fn, "m").name == "eager"  # if named


@pytest.mark.parametrize("where,knob", [("num_blocks", "--max-num-batched-tokens"),
                                        ("allocate", "--kv-cache-memory")])
def test_out_of_memory_at_start_up_is_one_line_naming_the_knob(monkeypatch, where, knob):
    from pagedgen.errors import PagedgenError
    from pagedgen.runtime.worker import kv_memory, memory_plan

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")

    target = memory_plan if where == "num_blocks" else kv_memory.KVMemory
    monkeypatch.setattr(target, where, oom)
    with pytest.raises(PagedgenError, match=rf"out of GPU memory .*{knob}"):
        Engine(EngineConfig(device="cpu", kv_cache_memory="64MiB"))
