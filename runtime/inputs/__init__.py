"""What a run is asked: requests parsed and checked (``request``, ``structured``, ``parse``),
vLLM's ``SamplingParams`` (``sampling_params``) and the run's settings (``settings``), shared by
the commands' file formats (``cli/``) and the Python API (``runtime/api.py``)."""
