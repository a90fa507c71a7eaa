"""`pagedgen profile` (``command.py``): its workload, measurement and report."""
