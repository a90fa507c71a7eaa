"""Mixture-of-experts layers: the layer (``layer.py``: ``FusedMoE``, ``SparseMoeBlock``), its
router (``route.py``), the slots sorted by expert (``align.py``), the grouped GEMM kernels
(``kernels.py``; torch's grouped GEMM in ``grouped_mm.py``; MXFP4 experts written out dense in
``dequantized.py``), the tiles planned by measurement (``plan.py``), the activations between
the GEMMs (``act.py``), each token's slots added (``combine.py``) and a shared expert beside
them (``shared.py``). Weight formats plug in through ``quantization``'s MoE methods."""
