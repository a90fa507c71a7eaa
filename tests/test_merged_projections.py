"""Projections of one input as one GEMM (``linear.MergedProjections``): the same outputs, each
layer's weight a view of the merged matrix, and no merge where a layer is quantized or has a
bias."""

from __future__ import annotations

import torch

from pagedgen.runtime.collectives.sharding import Segment
from pagedgen.runtime.layers.linear import ColumnParallelLinear, MergedProjections
from pagedgen.runtime.quantization.fp8.scheme import Fp8


def _layer(out: int, bias: bool = False, method=None) -> ColumnParallelLinear:
    layer = ColumnParallelLinear(16, [(None, Segment(None, out, 0, out, 0))], bias, method)
    if layer.weight.dtype == torch.float32:  # an FP8 layer's weights are left as made
        torch.nn.init.normal_(layer.weight.data)
    return layer


def test_merged_projections_give_each_layers_output_from_one_matrix():
    torch.manual_seed(0)
    layers = [_layer(5), _layer(1), _layer(12)]
    x = torch.randn(3, 16)
    want = [layer(x) for layer in layers]
    merged = MergedProjections.of(layers)
    assert merged is not None and merged.weight.shape == (8 + 8 + 16, 16)
    assert [start for start, _ in merged.parts] == [0, 8, 16]  # each part 16-byte aligned
    for got, w, layer in zip(merged(x), want, layers):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-6)
        base = merged.weight.data_ptr()
        assert base <= layer.weight.data_ptr() < base + merged.weight.nbytes  # a view
        torch.testing.assert_close(layer(x), w, atol=1e-6, rtol=1e-6)
    assert merged.weight[5:8].eq(0).all() and merged.weight[9:16].eq(0).all()


def test_no_merge_with_a_quantized_layer_a_bias_or_another_dtype():
    assert MergedProjections.of([_layer(4), _layer(4, method=Fp8())]) is None
    assert MergedProjections.of([_layer(4), _layer(4, bias=True)]) is None
    other = _layer(4)
    other.weight.data = other.weight.data.double()
    assert MergedProjections.of([_layer(4), other]) is None
