"""Compile a StableHLO text module on the Tenstorrent PJRT client (compile-only), exporting IR.

Runs inside a process that already has the Tenstorrent plugin initialised (the compile worker);
the text comes from :func:`.shardy.gspmd_to_shardy` (torch-xla frontend).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Mapping, NamedTuple

import numpy as np

__all__ = ["TextCompileResult", "compile_stablehlo_text"]


class TextCompileResult(NamedTuple):
    """What :func:`compile_stablehlo_text` leaves: the exported IR files (``None`` when the
    plugin wrote none) and the wall time of the compile."""

    ttnn_path: str | None
    ttir_path: str | None
    seconds: float


def _find_ir(out_dir: Path, stage: str) -> str | None:
    # The plugin writes <out>/irs/<stage>_<timestamp>.mlir ("ttnn_runtime_*" is a second dump).
    hits = sorted(p for p in (out_dir / "irs").glob(f"{stage}_*.mlir") if re.fullmatch(rf"{stage}_\d+\.mlir", p.name))
    return str(hits[-1]) if hits else None


def compile_stablehlo_text(module_text: str, num_devices: int, export_dir: str | Path,
                           options: Mapping[str, str] | None = None) -> TextCompileResult:
    """Compile a (Shardy) StableHLO text module on the Tenstorrent PJRT client, exporting IR.

    Must run in a process where JAX sees the ``tt`` platform (``TT_COMPILE_ONLY_SYSTEM_DESC`` set
    before JAX starts, ``JAX_PLATFORMS`` unset: ``runner.worker_env``). The module is compiled
    for the first ``num_devices`` devices, one replica, ``num_devices`` partitions; the plugin
    writes its IRs to ``export_dir/irs/`` (compile option ``export_path``, as ``lowered.compile``
    passes it in :mod:`.lowering`). ``options``: further plugin compile options by the plugin's
    own keys (:meth:`.options.CompileOptions.plugin_options`); ``None`` sends none (tt-mlir's
    defaults: level 0, no DRAM saving, no trace).

    Raises:
        RuntimeError: JAX's backend is not the tt plugin or has too few devices;
        whatever the plugin raises (``XlaRuntimeError``) when tt-mlir rejects the module.
    """
    from jax._src import compiler, xla_bridge
    from jax._src.lib import xla_client as xc

    backend = xla_bridge.get_backend("tt")
    devices = backend.devices()
    if len(devices) < num_devices:
        raise RuntimeError(f"the tt backend has {len(devices)} devices; {num_devices} needed")
    devices = devices[:num_devices]
    export = Path(export_dir)
    export.mkdir(parents=True, exist_ok=True)
    # As jax.jit's compile: one replica, one partition per device, SPMD; export_path goes in as
    # an env option override (the plugin reads it from the compile options).
    opts = compiler.get_compile_options(
        num_replicas=1, num_partitions=num_devices,
        device_assignment=np.array(devices).reshape(1, num_devices),
        env_options_overrides={"export_path": str(export), **dict(options or {})}, backend=backend)
    t0 = time.perf_counter()
    backend.compile_and_load(module_text, xc.DeviceList(tuple(devices)), opts)
    return TextCompileResult(_find_ir(export, "ttnn"), _find_ir(export, "ttir"), round(time.perf_counter() - t0, 3))
