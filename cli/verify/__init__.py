"""`pagedgen verify` (``command.py``): its checks, how they run, and their report."""
