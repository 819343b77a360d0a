"""Jobs that run in worker processes, one backend per process: ``check`` (the PCC matrix),
``generate`` (a sharded pipeline end to end), ``profile`` (warm-iteration timing).

Each job module has a parent side (``run_*``: validates, starts the worker through
:func:`wan_sharding.runtime.workers.run_worker`, returns results) and a worker side (its ``__main__``).
:mod:`.pcc` holds the one comparison and its thresholds; :mod:`.launch` what every worker needs.
"""
