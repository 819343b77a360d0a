"""Test-session setup.

This pytest process runs JAX on 8 CPU devices for the in-process hook tests; torch-xla and the
tt-mlir compiler only ever run in subprocesses the tests start (each stack in its own process:
both read XLA_FLAGS, and the Tenstorrent plugin breaks JAX's CPU backend unless JAX_PLATFORMS=cpu).
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.pop("TT_COMPILE_ONLY_SYSTEM_DESC", None)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
