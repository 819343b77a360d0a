"""``wan-sharding serve`` put together: the workers, the socket, the store, the supervisor and uvicorn.

:func:`serve` splits the mesh for ``--replicas`` and binds the socket first (a mesh that does not
split, or a port in use, is a usage error before any worker starts), opens, migrates and recovers
the store, starts the supervisor (which starts the workers and warms them up) and runs uvicorn until
Ctrl-C or SIGTERM; then the running jobs are ``failed`` with that reason, the workers are killed and
the store is closed, leaving no process and no half-written file behind.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
from typing import Any

import uvicorn

from ..jobs.conditioning import default_limits
from ..jobs.requests import RequestLimits, UsageError
from .replicas import Replica, model_heads, split_mesh, split_plan
from .store import Store, StoreBusy
from .resident import WorkerSpec

API_KEY_ENV = "WAN_SHARDING_API_KEY"
DEFAULT_PROMPT = "a red fox running through fresh snow, golden hour"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one).

    Raises:
        UsageError: the address cannot be bound (in use, not this machine's).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another --port, or "
                         "stop what holds it") from None
    sock.listen(128)
    return sock


def request_defaults(p: dict[str, Any]) -> dict[str, Any]:
    """What a request that leaves a field out gets (and what the warm-up runs): the server's
    ``--steps`` / ``--frames`` / ``--height`` / ``--width``, else ``generate``'s defaults."""
    from ..pipeline.tiny import VARIANT_PIPELINES

    frames, height, width = VARIANT_PIPELINES[p["variant"]].size if not p.get("model") else (81, 480, 832)
    return {"prompt": DEFAULT_PROMPT, "negative_prompt": "", "seed": 0, "guidance_scale": 4.0,
            "num_inference_steps": p["steps"], "num_frames": p.get("frames") or frames,
            "height": p.get("height") or height, "width": p.get("width") or width}


def replicas_of(p: dict[str, Any]) -> tuple[list[Replica], dict[str, Any] | None]:
    """The sub-meshes of ``serve --replicas N`` (one: the whole mesh), and with ``--plan`` the plan
    each worker shards with (its mesh one sub-mesh).

    Raises:
        UsageError: the mesh does not split into N meshes the model shards on.
    """
    from ..jobs.conditioning import conditioning
    from ..mesh import mesh_from_preset
    from ..plan import ShardingPlan

    n = p.get("replicas") or 1
    variant = conditioning(p["variant"], p.get("model")).variant
    heads = model_heads(p["variant"], p.get("model"))
    if p.get("plan"):
        plan, replicas = split_plan(ShardingPlan.from_dict(p["plan"]), n, heads, variant)
        return replicas, plan.to_dict()
    return split_mesh(mesh_from_preset(p["mesh"]), n, heads, variant), None


def worker_specs(p: dict[str, Any], defaults: dict[str, Any]) -> list[WorkerSpec]:
    """One :class:`WorkerSpec` per replica: the worker's configuration (its sub-mesh) and its
    environment (that many CPU devices, or on ``tt`` its chips through ``TT_VISIBLE_DEVICES``). On a
    multi-host launch (``p["distributed"]``) there is one replica, whose worker is tt-xla's
    controller; every replacement of it starts with this same environment."""
    from ..jobs.launch import worker_env

    base = {k: p.get(k) for k in ("backend", "mesh", "plan", "padding", "patches", "cache", "dtype", "variant",
                                  "model", "text_encoder", "vae", "prompt_cache_mb", "lora")}
    base["defaults"] = defaults
    replicas, plan = replicas_of(p)
    specs = []
    for r in replicas:
        config, env = dict(base), worker_env(p["backend"], r.mesh.num_devices, p.get("distributed"))
        if len(replicas) > 1:
            if plan:
                config["plan"] = plan
            else:
                config["replica_mesh"] = r.mesh_dict()
            if p["backend"] == "tt":
                env["TT_VISIBLE_DEVICES"] = ",".join(map(str, r.devices))
        specs.append(WorkerSpec(r.mesh.name, r.devices_label, env, config))
    return specs


# serve's --max-* flags: (option key, RequestLimits field, what the flag's value is in)
LIMIT_FLAGS = (("max_steps", "steps", 1), ("max_frames", "frames", 1), ("max_height", "height", 1),
               ("max_width", "width", 1), ("max_frame_pixels", "frame_pixels", 1),
               ("max_prompt_bytes", "prompt_bytes", 1), ("max_prompt_tokens", "prompt_tokens", 1),
               ("max_images", "images", 1), ("max_image_mb", "image_bytes", 2**20),
               ("max_image_pixels", "image_pixels", 1), ("max_tokens", "tokens", 1))
HEADER_TIMEOUT_S = 10.0  # serve --header-timeout: a request head must be whole within this
BODY_TIMEOUT_S = 30.0  # serve --body-timeout: the longest pause while a body arrives
MAX_CONNECTIONS = 256  # serve --max-connections: well under the common 1,024 open files


def request_limits(p: dict[str, Any]) -> RequestLimits:
    """What one request may cost on this server: the model's defaults, sized to what one request may
    take on one device of the serve mesh (:func:`default_limits` of :func:`mesh_tokens`), each
    overridden by its ``--max-*`` flag."""
    base = default_limits(p["variant"], p.get("model"), mesh_tokens(p)).as_dict()
    for key, field, unit in LIMIT_FLAGS:
        if p.get(key) is not None:
            base[field] = int(p[key] * unit)
    return RequestLimits(**base)


def mesh_tokens(p: dict[str, Any]) -> int:
    """The most flat DiT tokens one request may have so that a worker's devices hold it, by the
    planner's memory model (:func:`wan_sharding.planner.serving.max_request_tokens`): one replica's
    mesh (or plan), the worker's dtype, the text encoder when it is on the mesh; a device's memory a
    Tenstorrent chip's DRAM (``tt``) or this host's memory shared by every device of the serve mesh."""
    from ..jobs.conditioning import conditioning
    from ..options import DEFAULT_PADDING
    from ..plan import ShardingPlan
    from ..planner.serving import TT_ARCH, device_memory_bytes, max_request_tokens

    replicas, plan = replicas_of(p)
    sub = (ShardingPlan.from_dict(plan) if plan else
           ShardingPlan.from_mesh(replicas[0].mesh, padding=p.get("padding") or DEFAULT_PADDING))
    model = p.get("model")
    dtype = p.get("dtype") or ("bf16" if model else "fp32")
    dit, encoder = checkpoint_configs(model) if model else ((), ())
    device = device_memory_bytes(p["backend"], sum(r.mesh.num_devices for r in replicas), p.get("arch") or TT_ARCH)
    return max_request_tokens(conditioning(p["variant"], model).variant, "full" if model else "tiny", sub, device,
                              attention="fused" if p["backend"] == "tt" else "materialised",
                              dtype_bytes=4 if dtype == "fp32" else 2, text_encoder=p.get("text_encoder") == "mesh",
                              dit=dit, encoder=encoder)


def checkpoint_configs(model: str) -> tuple[tuple, tuple]:
    """The DiT's and the text encoder's config entries of the checkpoint at ``model`` (those the
    full-size configs have), as the planner takes them."""
    from pathlib import Path

    from ..jobs.requests import read_json_file
    from ..models import FULL_CONFIGS, text_encoder_config

    root = Path(model)
    dit = (read_json_file(root / "transformer" / "config.json", required=False)
           or read_json_file(root / "transformer_2" / "config.json", required=False) or {})
    umt5 = read_json_file(root / "text_encoder" / "config.json", required=False) or {}
    keep = lambda cfg, known: tuple(sorted((k, tuple(v) if isinstance(v, list) else v)  # noqa: E731
                                           for k, v in cfg.items() if k in known))
    return keep(dit, FULL_CONFIGS["t2v-a14b"]), keep(umt5, text_encoder_config("full"))


def model_name(p: dict[str, Any]) -> str:
    """The job record's ``model``: the checkpoint directory, or ``tiny-<variant>``."""
    return str(p["model"]) if p.get("model") else f"tiny-{p['variant']}"


def serve(p: dict[str, Any], say: Any = print) -> int:
    """Run the server with the options of ``serve`` (``p``) until it is stopped; the exit code."""
    from ..jobs.conditioning import conditioning
    from ..jobs.launch import stall_seconds
    from .app import body_limits, create_app
    from .guard import Guard, guarded_protocol
    from .supervisor import Supervisor

    specs = worker_specs(p, request_defaults(p))  # a mesh that does not split: refused before the socket
    sock = bind(p["host"], p["port"])
    try:
        store = Store.open(p["store"])
    except StoreBusy as e:
        sock.close()
        raise UsageError(str(e)) from None
    host, port = sock.getsockname()[:2]
    defaults = specs[0].config["defaults"]
    sup = Supervisor(store, specs, model=model_name(p), queue_size=p["queue"], job_timeout=p["job_timeout"],
                     stall_s=p.get("stall_timeout") or stall_seconds(p["backend"]), say=_flushing(say),
                     keep_seconds=None if not p.get("keep_days") else p["keep_days"] * 86400,
                     keep_jobs=p.get("keep_jobs") or None)
    limits = request_limits(p)
    app = create_app(sup, defaults={k: defaults[k] for k in ("num_inference_steps", "num_frames", "height", "width")},
                     variant=p["variant"], model=p.get("model"), cache=p.get("cache") or "none",
                     rules=conditioning(p["variant"], p.get("model")), limits=limits,
                     adapters=tuple(sup.adapter_jobs))
    guarded = Guard(app, p.get("api_key"), body_limits(limits), p.get("body_timeout") or BODY_TIMEOUT_S)
    protocol = guarded_protocol(p.get("header_timeout") or HEADER_TIMEOUT_S, p.get("max_connections") or MAX_CONNECTIONS)
    server = _Server(uvicorn.Config(guarded, http=protocol, log_level="warning", access_log=False, lifespan="off",
                                    timeout_graceful_shutdown=5, timeout_keep_alive=5))
    sup.on_broken = lambda _reason: setattr(server, "should_exit", True)
    url_host = f"[{host}]" if ":" in host else host
    mesh = p.get("plan_name") or p["mesh"]
    workers = (f"the {p['backend']} worker on {mesh}" if len(specs) == 1 else
               f"{len(specs)} {p['backend']} workers on {specs[0].mesh} each ({mesh} split in {len(specs)})")
    say(f"wan-sharding serve: listening on http://{url_host}:{port} (store {p['store']}, queue {p['queue']}, "
        f"job timeout {p['job_timeout']:g} s{', API key required' if p.get('api_key') else ''}); warming up "
        f"{workers} (GET /health is 503 until it is ready)")
    say(f"wan-sharding serve: a request may have at most {limits.tokens:,} DiT tokens, {limits.frames} frames, "
        f"{limits.height}x{limits.width} and {limits.frame_pixels:,} pixels a frame, {limits.steps} steps (sized from "
        f"the model and the mesh, or by --max-*; docs/serving.md, Limits)")
    sys.stdout.flush()
    _log_to(sys.stdout)
    sup.prune(force=True)
    sup.start()
    try:
        server.run(sockets=[sock])
    finally:
        why = f"the server was stopped ({server.stopped_by})" if server.stopped_by else "the server was stopped"
        sup.stop(why)
        store.close()
        sock.close()
    if sup.broken:
        print(f"wan-sharding serve: error: {sup.broken}", file=sys.stderr)
        return 1
    if server.stopped_by:
        # uvicorn re-raises the signal that stopped it once it has shut down, under the handler the
        # process started with: where that was "ignore" (SIGINT in a shell's background job) the
        # server would exit 0. A stop by a signal is an interruption: exit 130 every time.
        raise KeyboardInterrupt(server.stopped_by)
    return 0


def _log_to(stream: Any) -> None:
    """The server's own errors (a store write that failed, with SQLite's real error) as one line each."""
    import logging

    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("wan-sharding serve: error: %(message)s"))
    logger = logging.getLogger("wan_sharding.serve")
    logger.handlers[:] = [handler]
    logger.propagate = False


def _flushing(say: Any) -> Any:
    def out(line: str) -> None:
        say(line)
        sys.stdout.flush()
    return out


class _Server(uvicorn.Server):
    """uvicorn's server, remembering which signal stopped it (the running job's error names it)."""

    stopped_by: str | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.stopped_by = signal.Signals(sig).name
        super().handle_exit(sig, frame)


def api_key_from(given: str | None) -> str | None:
    """``--api-key``, else the ``WAN_SHARDING_API_KEY`` environment variable, else None."""
    return given or os.environ.get(API_KEY_ENV) or None
