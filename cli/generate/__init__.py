"""`pagedgen generate` (``command.py``): the run (``runs.py``) and its output stream
(``stream.py``)."""
