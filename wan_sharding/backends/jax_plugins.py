"""Which PJRT plugins a JAX process loads: none in a CPU-only one."""

from __future__ import annotations

import os


def keep_plugins_out_of_cpu_jax() -> None:
    """In a process that runs JAX on the CPU only (``JAX_PLATFORMS=cpu``), load no PJRT plugin.

    JAX loads every installed plugin when it first makes its backends, whatever ``JAX_PLATFORMS``
    says. The Tenstorrent plugin (jax-tt-plugin 0.1.3) unpacks its 417 MB tt-metal runtime into
    ``$TMPDIR`` at every load: 2-10 s per process (measured here), and two processes loading it at
    once can fail ("failed to extract embedded tt-metal runtime archive") and leave the process
    stuck until the watchdog stops it. A CPU process never uses the plugin, so it is not loaded.
    Uses JAX's own "plugins already discovered" flag (jax 0.7.1, ``jax._src.xla_bridge``); a
    no-op once JAX has made its backends, or on a JAX without that flag."""
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        return
    import jax._src.xla_bridge as xb

    if hasattr(xb, "_plugins_registered") and hasattr(xb, "_plugin_lock"):
        with xb._plugin_lock:
            xb._plugins_registered = True
