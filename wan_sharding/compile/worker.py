"""Compile worker: ``python -m wan_sharding.compile.worker``, started by
:func:`wan_sharding.compile.runner.compile_many` through the package's one process runner
(:func:`wan_sharding.runtime.workers.run_worker`).

Its parameters (JSON on stdin) are ``{"requests": [{"index": i, ...CompileRequest fields}]}``.
It compiles each request in this process (:func:`wan_sharding.compile.lowering.compile_in_process`)
and sends one ``RESULT`` line per request (:func:`wan_sharding.runtime.workers.emit`) as soon as that
request is done, so the results before a compiler crash survive it. Around each request it prints
begin/end marks into its log, so the caller can cut out what the compiler printed for it.

Needs ``TT_COMPILE_ONLY_SYSTEM_DESC`` set before JAX starts; run by hand only with that variable set.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from typing import Any

from ..runtime import workers
from .runner import BEGIN_MARK, END_MARK


def _start() -> list:
    """Start the plugin (``jax.devices()``) and import torch, torchax and diffusers side by side.

    The plugin spends most of its ~9 s start-up waiting, not computing, so overlapping it with the
    CPU-bound imports (~10 s, diffusers pulls in every transformer module) saves a few seconds per
    worker. Up front, so a broken plugin fails before any request is marked as started.
    """
    box: dict = {}

    def init() -> None:
        try:
            import jax

            box["devices"] = jax.devices()
        except BaseException as e:  # re-raised in the main thread
            box["error"] = e

    thread = threading.Thread(target=init, name="tt-plugin-start")
    thread.start()
    import diffusers  # noqa: F401
    import torch  # noqa: F401
    import torchax  # noqa: F401
    from diffusers import WanTransformer3DModel  # noqa: F401

    thread.join()
    if "error" in box:
        raise box["error"]
    return box["devices"]


def compile_batch(params: dict[str, Any]) -> None:
    """The worker's job: compile every request of ``params`` and emit one result per request."""
    devices = _start()
    print(f"wan_sharding.compile.worker: {len(devices)} {devices[0].platform} devices", flush=True)
    from .lowering import compile_in_process, compile_traced
    from .request import CompileRequest

    for raw in params["requests"]:
        raw = dict(raw)
        index = raw.pop("index")
        traced = raw.pop("traced", None)  # the torch-xla frontend's trace of this request
        req = CompileRequest.from_json(raw)
        print(f"{BEGIN_MARK}{index} {req.label()}", flush=True)
        try:
            out = compile_traced(req, traced) if traced is not None else compile_in_process(req)
        except Exception as e:  # a setup error (not a compiler rejection): report, go on
            traceback.print_exc()
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"[:8000]}
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"{END_MARK}{index}", flush=True)
        workers.emit({"index": index, **out})


def main() -> int:
    if "jax" in sys.modules:  # pragma: no cover - defensive: the variable must precede JAX
        print("wan_sharding.compile.worker: jax was imported before the worker started", file=sys.stderr)
        return 2
    desc = os.environ.get("TT_COMPILE_ONLY_SYSTEM_DESC")
    if not desc or not os.path.exists(desc):
        print(
            "wan_sharding.compile.worker: TT_COMPILE_ONLY_SYSTEM_DESC must name an existing system descriptor "
            f"(got {desc!r}); write one with `wan-sharding sysdesc` or use wan_sharding.compile.compile_many",
            file=sys.stderr,
        )
        return 2
    return workers.worker_main(compile_batch)


if __name__ == "__main__":
    sys.exit(main())
