"""Models: the family registry (``registry``), each family (``families/``), configs read
without transformers (``hf_config``), tokenizers, and loading (``loader``)."""
