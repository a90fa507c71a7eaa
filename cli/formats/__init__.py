"""The I/O formats of `pagedgen generate`: input lines as requests (``request``, ``reader``,
``openai_batch``), finished requests as output lines (``records``, ``openai_batch``), and the
output file (``output_claim``: whether this run may write it; ``output``: writing it)."""
