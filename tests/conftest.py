"""Shared fixtures: random paged batches, tiny Hugging Face checkpoints, the GPU marker."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # test our Triton kernels on CPU, in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedgen.attention.cases import PagedBatch, make_paged_batch, run_backend  # noqa: F401

pytest_plugins = ("tiers",)  # the tier marks' guard (after TRITON_INTERPRET is set)


def _quicken_the_interpreter() -> None:
    """What Triton's interpreter repeats for nothing, left out (same results; about half of an
    interpreted kernel's time in this suite): every integer add, subtract and multiply is
    done again in int64 for an overflow check whose assert only a debug build keeps (the
    interpreter's builder never has one); every call of a ``@triton.jit`` device function
    patches ``triton.language`` again, though its kernel's launch already has; and every op
    builds its result's block type, that type's shape fields for the tensor, and its numpy
    dtype afresh (each now made once per element type and shape). Only where the
    interpreter runs and has these internals; TRITON_DEBUG keeps all of them."""
    try:
        import dataclasses

        import triton
        from triton.runtime import interpreter as ti
        builder, rewrite = ti.interpreter_builder, ti.InterpretedFunction.rewrite
        launch, call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__
        core, np_dtype = triton.language.core, ti._get_np_dtype
        block, unwrap, tensor_init = core.block_type, core._unwrap_if_constexpr, \
            core.tensor.__init__
        debug = triton.knobs.runtime.debug
    except (ImportError, AttributeError):  # another Triton: as it is
        return
    if os.environ.get("TRITON_INTERPRET") != "1" or debug:
        return
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    patched: list[set] = []  # the language modules the running launch has patched

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is triton.language
                or v is triton.language.core}

    def launch_once(self, *args, **kwargs):
        patched.append(langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def call_patched(self, *args, **kwargs):
        if patched and langs(self.fn) <= patched[-1]:  # already patched by its kernel
            fn = rewrite(self)
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise ti.InterpreterError(repr(e)) from e
        if patched:  # patched now for the rest of the launch (the language core, say)
            patched[-1] |= langs(self.fn)
        return call(self, *args, **kwargs)

    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = launch_once, call_patched

    made: dict = {}
    init = block.__init__

    def new_block(cls, element_ty, shape):
        key = (cls, element_ty, *map(unwrap, shape))
        try:
            ty = made.get(key)
        except TypeError:  # an element type without a hash (pointers): made afresh
            ty = key = None
        if ty is None:
            ty = object.__new__(cls)
            init(ty, element_ty, shape)
            if key is not None:
                made[key] = ty
                ty.tensor_fields = None  # a tensor's shape fields, from the first tensor
        return ty

    def new_tensor(self, handle, type):
        fields = getattr(type, "tensor_fields", None)  # a shared block type's
        if fields is None:
            tensor_init(self, handle, type)
            if hasattr(type, "tensor_fields"):
                type.tensor_fields = (self.shape, self.numel, self.dtype)
            return
        self.handle, self.type = handle, type
        self.shape, self.numel, self.dtype = fields

    np_dtypes: dict = {}

    def cached_np_dtype(ty):  # by element type (a pointer's has no hash: asked afresh)
        element = ty.element_ty if isinstance(ty, block) else ty
        try:
            return np_dtypes[element]
        except KeyError:
            found = np_dtypes[element] = np_dtype(ty)
            return found
        except TypeError:
            return np_dtype(ty)

    block.__new__, block.__init__ = new_block, lambda self, *args, **kwargs: None
    core.tensor.__init__ = new_tensor
    ti._get_np_dtype = cached_np_dtype


_quicken_the_interpreter()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def dense_reference(batch: PagedBatch) -> torch.Tensor:
    """Attention computed without paging: each sequence's K/V assembled from its context
    (read block by block) and its new tokens, then a plain masked softmax in float64."""
    spec, bs = batch.spec, batch.block_size
    outs, t = [], 0
    group = spec.num_heads // spec.num_kv_heads
    for s in batch.prefills + batch.decodes:
        ks, vs = [], []
        for pos in range(s.num_context):
            blk, off = s.block_table[pos // bs], pos % bs
            ks.append(batch.kv_cache[blk, 0, off].double())
            vs.append(batch.kv_cache[blk, 1, off].double())
        k = torch.stack(ks + [batch.k[t + i].double() for i in range(s.num_new)])
        v = torch.stack(vs + [batch.v[t + i].double() for i in range(s.num_new)])
        q = batch.q[t:t + s.num_new].double()
        L = s.num_context + s.num_new
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
        if spec.logits_soft_cap:
            scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
        qpos = torch.arange(s.num_context, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        ok = kpos <= qpos
        if spec.sliding_window:
            ok &= kpos > qpos - spec.sliding_window
        scores = scores.masked_fill(~ok, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        if batch.sinks is not None:  # the sink's share of the softmax, taken from the keys'
            lse = scores.logsumexp(-1).transpose(0, 1)  # [q, h]
            o = o * torch.sigmoid(lse - batch.sinks.double())[:, :, None]
        outs.append(o)
        t += s.num_new
    return torch.cat(outs)


def padded_decodes(md, bs: int, num_pages: int, cascade_segments: int = 0):
    """Decode metadata ``md`` padded to ``bs`` decodes as the CUDA-graph runner pads (one token
    in a scratch page no sequence holds), its cascade levels held in ``cascade_segments``
    segments each."""
    import dataclasses
    pad = bs - md.num_decodes
    i32 = torch.int32
    scratch = max(set(range(num_pages)) - set(md.block_tables.flatten().tolist()))
    tables = torch.cat([md.block_tables, torch.full((pad, md.block_tables.shape[1]), scratch,
                                                    dtype=i32, device=md.block_tables.device)])
    return dataclasses.replace(
        md, num_decode_tokens=bs,
        slot_mapping=torch.cat([md.slot_mapping, torch.full((pad,), scratch * md.block_size,
                                                            device=md.slot_mapping.device)]),
        query_start_loc=torch.arange(bs + 1, dtype=i32, device=md.seq_lens.device),
        seq_lens=torch.cat([md.seq_lens, torch.ones(pad, dtype=i32, device=md.seq_lens.device)]),
        context_lens=torch.cat([md.context_lens, torch.zeros(pad, dtype=i32,
                                                             device=md.seq_lens.device)]),
        block_tables=tables, seq_lens_cpu=md.seq_lens_cpu + [1] * pad,
        query_lens_cpu=[1] * bs, cascade_segments=cascade_segments, _prefill=None, _decode=None)


@pytest.fixture
def one_layer(tmp_path) -> str:
    """The tiny preset cut to one layer (a profile file used as a preset): an engine's steps
    under the interpreter a quarter of the work, every attention path still taken."""
    import yaml

    from pagedgen.meta import PROFILES_DIR
    profile = yaml.safe_load((PROFILES_DIR / "tiny.yaml").read_text())
    profile["model"]["config"]["num_hidden_layers"] = 1
    path = tmp_path / "tiny-1.yaml"
    path.write_text(yaml.safe_dump(profile))
    return str(path)


@pytest.fixture(scope="module")
def hf(ckpt):
    """transformers' model, tokenizer and image processor of the module's multimodal
    checkpoint ``ckpt`` (``hf_models.hf_vision``)."""
    from hf_models import hf_vision

    return hf_vision(ckpt)
