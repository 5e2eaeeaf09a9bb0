"""Running engines on workloads and measuring them.

``workloads`` (the requests, as data), ``driver`` (the one run loop: arrivals, steps,
interleaved repetitions), ``simulator`` (the engine on a virtual clock), ``costfit`` (fit
the cost model on designed passes), ``microbench`` (single passes, the machine's sgemm and
copy rates), ``peers`` (mlx-lm's own batching on the same workloads) and ``bench``
(``batchlab bench``: everything side by side, against the machine's limits).
"""
