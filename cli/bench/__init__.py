"""`pagedgen bench`: measurements a user runs on their own machine (``throughput``)."""
