"""The process plumbing every command shares, below all of the sharding.

- :mod:`.workers`: the one worker-process runner (protocol, watchdog, cleanup, atomic files);
- :mod:`.processes`: the process table (CPU time of a process tree, killing a tree);
- :mod:`.scratch`: temporary folders (one per process, a private ``TMPDIR`` per worker);
- :mod:`.noise`: third-party messages known to be harmless, dropped in workers; progress bars.
"""
