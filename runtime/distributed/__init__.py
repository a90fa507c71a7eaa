"""Runs over more than one process: tensor-parallel groups (``parallel``), worker processes
(``launch``), engine replicas (``replica``), replicas on this host (``data_parallel``) and on
Ray Data (``ray_data``)."""
