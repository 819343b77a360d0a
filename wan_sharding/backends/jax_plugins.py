"""Which platform and PJRT plugins a JAX process uses: CPU devices and no plugin in a CPU-only one."""

from __future__ import annotations

import os
import sys

from .base import DEVICE_COUNT_FLAG


def keep_plugins_out_of_cpu_jax() -> None:
    """In a process that runs JAX on the CPU only (``JAX_PLATFORMS=cpu``), load no PJRT plugin.

    JAX loads every installed plugin when it first makes its backends, whatever ``JAX_PLATFORMS``
    says. The Tenstorrent plugin (jax-tt-plugin 0.1.3) unpacks its 417 MB tt-metal runtime into
    ``$TMPDIR`` at every load: 2-10 s per process (measured here), and two processes loading it at
    once can fail ("failed to extract embedded tt-metal runtime archive") and leave the process
    stuck until the watchdog stops it. A CPU process never uses the plugin, so it is not loaded.
    Uses JAX's own "plugins already discovered" flag (jax 0.7.1, ``jax._src.xla_bridge``); a
    no-op once JAX has made its backends, or on a JAX without that flag."""
    if os.environ.get("JAX_PLATFORMS") != "cpu" and not _config_says_cpu():
        return
    import jax._src.xla_bridge as xb

    if hasattr(xb, "_plugins_registered") and hasattr(xb, "_plugin_lock"):
        with xb._plugin_lock:
            xb._plugins_registered = True


def _config_says_cpu() -> bool:
    jax = sys.modules.get("jax")  # not imported here: asking must not start it
    return jax is not None and jax.config.jax_platforms == "cpu"


def start_cpu_jax(devices: int) -> bool:
    """Set JAX up for ``devices`` CPU devices when it has not started yet in this process and
    nothing asks for another platform: what ``JAX_PLATFORMS=cpu`` and
    ``XLA_FLAGS=--xla_force_host_platform_device_count=<devices>`` set before importing JAX do, for a
    script that did not set them. Without it JAX would start every installed plugin; the
    Tenstorrent one fails on a machine without chips with a long log ("No chips detected") and JAX
    then refuses to start. A device count the user gave (the flag, or ``jax_num_cpu_devices``) is
    kept. Nothing happens once JAX has started (its devices are then what they are), in a
    compile-only process (``TT_COMPILE_ONLY_SYSTEM_DESC``: the plugin is wanted), or when
    ``JAX_PLATFORMS`` names another platform. Returns whether it set JAX up."""
    import jax
    import jax._src.xla_bridge as xb

    if xb.backends_are_initialized() or os.environ.get("TT_COMPILE_ONLY_SYSTEM_DESC"):
        return False
    if (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "cpu") != "cpu":
        return False
    jax.config.update("jax_platforms", "cpu")
    counted = any(f.startswith(DEVICE_COUNT_FLAG) for f in os.environ.get("XLA_FLAGS", "").split())
    if not counted and jax.config.jax_num_cpu_devices < 0:
        jax.config.update("jax_num_cpu_devices", devices)
    keep_plugins_out_of_cpu_jax()
    return True
