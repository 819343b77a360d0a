"""What every job worker needs: its environment (parent side), its stack and its mesh (worker side)."""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Mapping

from ..mesh import mesh_from_preset
from ..runtime.workers import with_package_path

UNSHARDED = "unsharded"  # the one-device baseline a profile compares against


def num_devices(meshes: Iterable[str]) -> int:
    """CPU devices one worker needs to run every mesh in ``meshes`` (a tt worker uses the chips)."""
    return max(1 if m == UNSHARDED else mesh_from_preset(m).num_devices for m in meshes)


def plan_devices(plan: Any) -> int:
    """Devices a worker needs for a plan (its dict or a ShardingPlan)."""
    shape = plan["mesh_shape"] if isinstance(plan, dict) else plan.mesh_shape
    n = 1
    for s in shape:
        n *= int(s)
    return n


def check_stacks(backends: Iterable[str]) -> None:
    """Before any worker starts: BackendError (one line: what is missing and how to get it) when
    this machine lacks the stack one of ``backends`` runs on. Imports no stack."""
    for backend in dict.fromkeys(backends):
        if backend == "tt":
            from ..backends.tt import check_tt_stack

            check_tt_stack()


def worker_env(backend: str, devices: int, distributed: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The environment a worker process needs to run ``backend`` on ``devices`` CPU devices, or,
    for ``tt``, on this machine's Tenstorrent chips (BackendError when its stack is missing).
    ``distributed``: a tt launch over several hosts or processes
    (:class:`~wan_sharding.backends.tt_distributed.DistributedLaunch` as JSON): the worker is then
    tt-xla's controller, with exactly the variables tt-xla's topology helper sets for it."""
    from ..backends import BackendError, backend_class

    if distributed and backend != "tt":
        raise BackendError(f"a multi-host launch runs the tt backend, not {backend}")
    return _finish_env(backend_class(backend).worker_env(devices), distributed)


def planned_tt_env(distributed: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The environment a tt worker would get here, without checking the stack (what a dry run
    prints)."""
    from ..backends.tt import tt_worker_env

    return _finish_env(tt_worker_env(os.environ), distributed)


def _finish_env(env: dict[str, str], distributed: Mapping[str, Any] | None) -> dict[str, str]:
    if distributed:
        from ..backends.tt_distributed import DistributedLaunch, with_distributed

        env = with_distributed(env, DistributedLaunch.from_json(distributed))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # diffusers' Wan pipeline modules import transformers and (when installed) torch_xla, in a
    # JAX worker too: say which torch-xla device to use and keep their import noise down.
    env.setdefault("PJRT_DEVICE", "CPU")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return with_package_path(env)  # the package importable in the child, also from a source checkout


def quiet_progress(pipe: Any) -> Any:
    """``pipe`` with its progress bar off unless this worker's stderr is a terminal (piped or in a
    log, a bar is a line of carriage returns). diffusers' pipelines pass ``disable`` to tqdm
    themselves, so the runner's ``TQDM_DISABLE`` does not reach them: this is the pipeline's own
    per-instance setting."""
    from ..runtime.noise import is_terminal

    if not is_terminal(sys.stderr):
        pipe.set_progress_bar_config(disable=True)
    return pipe


def stall_seconds(backend: str) -> float | None:
    """How long a worker of ``backend`` may go without CPU progress before it counts as hung: the
    watchdog is for the jaxlib deadlock on CPU workers; a tt worker waits on its chips (compiles,
    device runs) with an idle CPU, so it is never taken for hung (a timeout still applies)."""
    from ..runtime.workers import STALL_SECONDS

    return None if backend == "tt" else STALL_SECONDS


def prepare_worker(backend: str) -> None:
    """First thing in a worker: start the backend's stack the way the package needs it."""
    if backend == "tt":  # Shardy for tt-mlir, the TT device type, SPMD
        from ..backends.tt import start_tt_runtime

        start_tt_runtime()
    elif backend == "xla":
        from ..backends.xla import enable_spmd

        enable_spmd()
    else:  # keep torch-xla's runtime (diffusers' Wan loop would start it) and unused plugins out of a JAX process
        from ..backends.jax_plugins import keep_plugins_out_of_cpu_jax
        from ..pipeline.shard import diffusers_without_torch_xla

        keep_plugins_out_of_cpu_jax()
        diffusers_without_torch_xla()


def _jax_subset_mesh(backend: str, shape: tuple[int, ...], axis_names: tuple[str, ...]) -> Any:
    """For JAX in a process with more devices than ``shape`` needs: a JAX mesh over the first ones
    (so one process can try several meshes); else ``None``."""
    if backend != "jax":
        return None
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    n = int(np.prod(shape))
    return Mesh(np.array(devices[:n]).reshape(shape), axis_names) if len(devices) > n else None


def plan_mesh_arg(backend: str, plan: Any) -> Any:
    """The mesh argument for ``shard_pipeline(..., plan=plan)`` in a worker: ``None`` (the plan's
    own), or a JAX mesh with the plan's axis names over the first devices (see ``mesh_arg``)."""
    return _jax_subset_mesh(backend, tuple(plan.mesh_shape), tuple(plan.axis_names))


def mesh_arg(backend: str, name: str) -> Any:
    """The mesh to shard on: the preset name, or (JAX, when the process has more devices) a JAX
    mesh over the first devices, so one process can try several meshes."""
    spec = mesh_from_preset(name)
    subset = _jax_subset_mesh(backend, spec.shape, spec.axis_names)
    return name if subset is None else subset
