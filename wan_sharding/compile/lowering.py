"""Compile the sharded Wan DiT through the real tt-mlir compiler, without Tenstorrent hardware.

The Tenstorrent JAX plugin (``jax-tt-plugin``) compiles for real when
``TT_COMPILE_ONLY_SYSTEM_DESC`` names a system descriptor; it never opens a chip. The model is
the unmodified diffusers DiT built on the ``meta`` device, run as a JAX function through torchax
(:class:`~wan_sharding.backends.jax.JaxBackend`): weights, buffers and inputs are
``jax.ShapeDtypeStruct`` stand-ins with their ``NamedSharding``, so the full 14B expert compiles
with ~1.5 GB of host memory and no weights.

Every compile runs in a worker subprocess (``python -m wan_sharding.compile.worker``): the
variable has to be set before JAX initialises its backends, and with the plugin installed a
process that initialises JAX without it fails ("No chips detected"). The calling process (CLI,
pytest) never imports JAX with the plugin. One worker compiles a batch of requests to pay the
~15-20 s of start-up (plugin, torch, diffusers) once; a worker that dies mid-compile (a compiler
crash) is restarted for the requests after the one it died on.

Two halves live here:

- caller side: :class:`CompileRequest`, :func:`compile_many`, :func:`compile_dit`;
- worker side: :func:`compile_in_process` (imports JAX; only the worker calls it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..mesh import MeshError, MeshSpec, mesh_from_preset
from ..models import FULL_CONFIGS, PER_TOKEN_TIMESTEPS, PROMPT_TOKENS, RESOLUTIONS, config_for
from ..plan import ShardingPlan
from . import sysdesc

# Lines the worker writes into its log (stdout and stderr merged) so the caller can cut out the
# part of the log that belongs to one request. Results go to a JSON-lines file, not the log.
BEGIN_MARK = "@@wan_sharding.compile begin "
END_MARK = "@@wan_sharding.compile end "

DTYPES = ("bf16", "f32")
TIMESTEP_DTYPES = ("float32", "bfloat16")


class CompileError(RuntimeError):
    """The compile could not be set up (plugin missing, bad descriptor, bad request) or the
    worker process failed in a way that left no result."""


# ------------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class CompileRequest:
    """One compile of a (possibly shortened) Wan DiT for one mesh and latent shape.

    Attributes:
        variant: ``"t2v-a14b"``, ``"i2v-a14b"`` or ``"ti2v-5b"``.
        mesh: mesh preset (``"1x4"``, ``"2x4"``, ``"8x4"``, ...).
        latent: latent video (frames, height, width); :func:`latent_for` turns a resolution
            name into one.
        blocks: number of transformer blocks (``num_layers``); ``None`` keeps the variant's own.
        size: ``"full"`` (real widths) or ``"tiny"`` (the test configs).
        padding: SP padding mode, ``"slice"``, ``"mask"`` or ``"none"``.
        anchor: keep the replicated constraint in front of each L-on-SP split (the tt-mlir
            workaround). ``False`` only exists to show the workaround is still needed.
        dtype: ``"bf16"`` (weights and activations as ``from_pretrained(torch_dtype=bf16)`` loads
            them: the modules diffusers keeps in fp32 stay fp32) or ``"f32"``.
        timestep_dtype: dtype of the timestep input (``float32``, as the pipelines pass it).
        batch: batch size.
        resolution: display name of ``latent`` (e.g. ``"480p"``); informational.
        out_dir: where the compiler writes its IRs; a fresh temporary folder when ``None``.
        plan: a whole :class:`~wan_sharding.plan.ShardingPlan` (axes and order of SP / TP, FSDP,
            activation layout, padding). When given, the model is sharded through the ordinary
            API with it (``shard_dit_specs(dit, plan)``, ``apply_dit_sp_activation_sharding(...,
            plan=plan)``); ``mesh`` must then be the plan's mesh name and ``padding`` its padding
            (:meth:`for_plan` fills both). ``None``: the preset's default roles (SP on the first
            axis, TP on the second), as before.
    """

    variant: str = "t2v-a14b"
    mesh: str = "8x4"
    latent: tuple[int, int, int] = (21, 60, 104)
    blocks: int | None = None
    size: str = "full"
    padding: str = "slice"
    anchor: bool = True
    dtype: str = "bf16"
    timestep_dtype: str = "float32"
    batch: int = 1
    resolution: str | None = None
    out_dir: str | None = None
    plan: ShardingPlan | None = None

    @classmethod
    def for_plan(cls, plan: ShardingPlan, **fields: Any) -> "CompileRequest":
        """A request that compiles the DiT sharded by ``plan`` (its mesh and padding filled in)."""
        return cls(mesh=plan.mesh().name, padding=plan.padding, plan=plan, **fields)

    def mesh_spec(self) -> MeshSpec:
        """The mesh with its roles: the plan's when there is one, else the preset's."""
        if self.plan is not None:
            return self.plan.mesh()
        return mesh_from_preset(self.mesh)

    def validate(self) -> "CompileRequest":
        """Check every field before a subprocess is started; returns ``self``."""
        from ..attention import PADDING_MODES

        config_for(self.variant, self.size)  # unknown variant / size -> ValueError
        if self.plan is not None:
            if not isinstance(self.plan, ShardingPlan):
                raise CompileError(f"plan must be a ShardingPlan, got {type(self.plan).__name__}")
            try:
                name = self.plan.mesh().name
            except MeshError as e:
                raise CompileError(f"bad plan {self.plan}: {e}") from None
            if name != self.mesh:
                raise CompileError(f"request mesh {self.mesh!r} is not the plan's mesh {name!r}; "
                                   "build the request with CompileRequest.for_plan(plan, ...)")
            if self.plan.padding != self.padding:
                raise CompileError(f"request padding {self.padding!r} is not the plan's {self.plan.padding!r}; "
                                   "build the request with CompileRequest.for_plan(plan, ...)")
        else:
            try:
                mesh_from_preset(self.mesh)
            except MeshError as e:
                raise CompileError(str(e)) from None
        if len(self.latent) != 3 or any(int(v) < 1 for v in self.latent):
            raise CompileError(f"latent must be (frames, height, width) with positive sizes, got {self.latent}")
        patch = FULL_CONFIGS[self.variant]["patch_size"]
        if any(int(v) % p for v, p in zip(self.latent, patch)):
            raise CompileError(f"latent {self.latent} is not divisible by the patch size {patch}")
        if self.blocks is not None and self.blocks < 1:
            raise CompileError(f"blocks must be >= 1, got {self.blocks}")
        if self.padding not in PADDING_MODES:
            raise CompileError(f"unknown padding {self.padding!r}; choose one of {sorted(PADDING_MODES)}")
        if self.dtype not in DTYPES:
            raise CompileError(f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.timestep_dtype not in TIMESTEP_DTYPES:
            raise CompileError(f"unknown timestep dtype {self.timestep_dtype!r}; choose one of {TIMESTEP_DTYPES}")
        if self.batch < 1:
            raise CompileError(f"batch must be >= 1, got {self.batch}")
        return self

    @property
    def num_devices(self) -> int:
        return self.mesh_spec().num_devices

    @property
    def num_blocks(self) -> int:
        return self.blocks if self.blocks is not None else config_for(self.variant, self.size)["num_layers"]

    @property
    def tokens(self) -> int:
        """Flat token count L (patchified latent), before padding."""
        patch = config_for(self.variant, self.size)["patch_size"]
        return (self.latent[0] // patch[0]) * (self.latent[1] // patch[1]) * (self.latent[2] // patch[2])

    def label(self) -> str:
        lat = self.resolution or "x".join(map(str, self.latent))
        extra = "" if self.anchor else " no-anchor"
        if self.plan is not None:
            return f"{self.variant}/{self.size} {self.num_blocks}blk {lat} plan [{self.plan.name}]{extra}"
        return f"{self.variant}/{self.size} {self.num_blocks}blk {self.mesh} {lat} pad={self.padding}{extra}"

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["latent"] = list(self.latent)
        d["plan"] = None if self.plan is None else self.plan.to_dict()
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CompileRequest":
        d = dict(d)
        d["latent"] = tuple(int(v) for v in d["latent"])
        if d.get("plan") is not None:
            d["plan"] = ShardingPlan.from_dict(d["plan"])
        return cls(**d)


def latent_for(resolution: str | None = None, latent: str | Sequence[int] | None = None) -> tuple[int, int, int]:
    """(frames, height, width) from a resolution name (``"480p"``, ``"720p"``, ``"704p"``) or an
    explicit ``"F,H,W"`` string / sequence (which wins when both are given)."""
    if latent is not None:
        parts = latent.replace("x", ",").split(",") if isinstance(latent, str) else list(latent)
        try:
            vals = tuple(int(p) for p in parts)
        except ValueError:
            raise CompileError(f"latent must be F,H,W integers, got {latent!r}") from None
        if len(vals) != 3:
            raise CompileError(f"latent must have three sizes F,H,W, got {latent!r}")
        return vals  # type: ignore[return-value]
    if resolution is None:
        raise CompileError("give a resolution (480p, 720p, 704p) or a latent F,H,W")
    if resolution not in RESOLUTIONS:
        raise CompileError(
            f"unknown resolution {resolution!r}; known: {', '.join(RESOLUTIONS)} (or pass a latent F,H,W)")
    r = RESOLUTIONS[resolution]
    return (r.frames, r.height, r.width)


@dataclass
class CompileResult:
    """What one compile produced. ``ok`` is False when tt-mlir rejected the graph; ``error`` then
    holds the exception text and ``diagnostics`` the compiler's error lines from the log."""

    request: CompileRequest
    ok: bool
    error: str | None = None
    diagnostics: list[str] = field(default_factory=list)
    lower_seconds: float | None = None
    compile_seconds: float | None = None
    total_seconds: float | None = None  # build + trace + lower + compile, without process start-up
    out_dir: str | None = None
    ttnn_path: str | None = None
    ttir_path: str | None = None
    tokens: int | None = None
    padded_tokens: int | None = None
    sp_points: list[str] = field(default_factory=list)  # what the SP hooks constrained
    rss_mb: float | None = None
    log: str = ""  # this request's slice of the worker log

    @property
    def failure_text(self) -> str:
        """Everything that can explain a failure, for matching in tests and reports."""
        return "\n".join([self.error or "", *self.diagnostics, self.log])

    def ttnn_text(self) -> str:
        if not self.ttnn_path:
            raise CompileError(f"{self.request.label()}: no TTNN IR (compile ok={self.ok}): {self.error}")
        return Path(self.ttnn_path).read_text()

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("request", "log")}
        d["request"] = self.request.to_json()
        return d


# --------------------------------------------------------------------------- caller side


def check_plugin() -> str:
    """The installed ``jax-tt-plugin`` version, or :class:`CompileError` saying how to get it."""
    version = sysdesc.installed_plugin_version()
    if version is None:
        known = sysdesc.known_schema_hashes()
        raise CompileError(
            f"{sysdesc.PLUGIN_DIST} is not installed, so tt-mlir cannot be run. "
            f"Fix: pip install '{sysdesc.PLUGIN_DIST}=={max(known)}' (with jax/jaxlib 0.7.1 and torchax)."
        )
    return version


def prepare_descriptor(arch: str, num_chips: int, directory: str | os.PathLike[str]) -> Path:
    """Write a ``num_chips`` descriptor for ``arch`` and check it against the installed plugin.

    A descriptor with more chips than a mesh needs works (JAX sees them all; the mesh takes the
    first ones), so one descriptor serves every mesh of a batch.
    """
    if arch not in sysdesc.ARCHS:
        raise CompileError(f"unknown arch {arch!r}; known: {', '.join(sysdesc.ARCHS)}")
    path = Path(directory) / f"{arch}_{num_chips}.ttsys"
    sysdesc.write_system_descriptor(path, arch, num_chips)
    try:
        data = path.read_bytes()
        sysdesc.check_plugin_schema(data)
        sysdesc.check_chip_count(data, num_chips)
    except sysdesc.SystemDescriptorError as e:
        raise CompileError(f"bad system descriptor {path}: {e}") from e
    return path


# The plugin unpacks ~400 MB of tt-metal runtime files into $TMPDIR/<this prefix><hash> once.
ASSETS_PREFIX = "libtt-tt-metal-runtime-assets-"


def private_tmpdir(work: str | os.PathLike[str]) -> Path:
    """A ``TMPDIR`` for one worker, with links to the runtime files already unpacked.

    Why: the plugin copies the descriptor to the fixed path ``$TMPDIR/tt_pjrt_system_descriptor``
    and deletes it when its process exits, so two plugin processes sharing ``/tmp`` break each
    other ("system desc does not exist: /tmp/tt_pjrt_system_descriptor" in the middle of a
    compile). A private folder isolates the workers; the links spare the re-unpacking.
    """
    tmp = Path(work) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    for assets in Path(tempfile.gettempdir()).glob(ASSETS_PREFIX + "*"):
        link = tmp / assets.name
        if assets.is_dir() and not link.exists() and not link.is_symlink():
            link.symlink_to(assets, target_is_directory=True)
    return tmp


def _share_assets(tmp: Path) -> None:
    """Move runtime files a worker unpacked into its private folder to the shared temp folder
    (where the plugin itself would have put them), so they are unpacked once, not per run."""
    shared = Path(tempfile.gettempdir())
    for d in tmp.glob(ASSETS_PREFIX + "*"):
        if d.is_symlink() or not d.is_dir():
            continue
        try:
            if not (shared / d.name).exists():
                os.rename(d, shared / d.name)
                continue
        except OSError:  # another filesystem, or someone else just put it there
            pass
        shutil.rmtree(d, ignore_errors=True)


def worker_env(descriptor: str | os.PathLike[str], tmpdir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """Environment for a worker: the descriptor set, a private ``TMPDIR`` (see
    :func:`private_tmpdir`), no CPU-only JAX override."""
    env = dict(os.environ)
    env["TT_COMPILE_ONLY_SYSTEM_DESC"] = str(descriptor)
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    env.pop("JAX_PLATFORMS", None)  # the tt platform must be picked up
    env.pop("XLA_FLAGS", None)  # host device counts are for the CPU stack
    # The worker imports this package; make sure it finds the same copy as the caller.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


_DIAG = re.compile(r"(error|failed|doesn't match|does not match|mismatch|exception|abort)", re.I)


def _diagnostics(log: str, limit: int = 40) -> list[str]:
    """The compiler's error lines in a log slice (MLIR diagnostics, plugin errors)."""
    out = []
    for line in log.splitlines():
        if _DIAG.search(line) and "FutureWarning" not in line and "warnings.warn" not in line:
            out.append(line.strip()[:2000])
    return out[:limit]


def _split_log(log: str) -> dict[int, str]:
    """Log text per request index, cut at the worker's begin/end marks."""
    pieces: dict[int, list[str]] = {}
    current: int | None = None
    for line in log.splitlines():
        if line.startswith(BEGIN_MARK):
            current = int(line[len(BEGIN_MARK):].split()[0])
            pieces[current] = []
            continue
        if line.startswith(END_MARK):
            current = None
            continue
        if current is not None:
            pieces[current].append(line)
    return {i: "\n".join(lines) for i, lines in pieces.items()}


def compile_many(
    requests: Iterable[CompileRequest],
    arch: str = "wormhole_b0",
    *,
    timeout: float = 1800.0,
    work_dir: str | os.PathLike[str] | None = None,
    python: str | None = None,
    verbose: bool = False,
) -> list[CompileResult]:
    """Compile every request with tt-mlir in compile-only mode, in worker subprocesses.

    Args:
        requests: what to compile; results come back in the same order.
        arch: chip architecture of the system descriptor (``"wormhole_b0"`` or ``"blackhole"``).
        timeout: wall-clock seconds for all requests together.
        work_dir: where descriptors, logs and (for requests without ``out_dir``) IRs go;
            a fresh temporary folder when ``None``.
        python: interpreter for the worker (default: this one).
        verbose: echo the worker log to stderr as it runs.

    Returns:
        One :class:`CompileResult` per request. A graph tt-mlir rejects is a result with
        ``ok=False``, not an exception.

    Raises:
        CompileError: plugin missing, unknown arch, bad descriptor, an invalid request, the
            worker failing to start, or the timeout.
    """
    reqs = [r.validate() for r in requests]
    if not reqs:
        return []
    if arch not in sysdesc.ARCHS:
        raise CompileError(f"unknown arch {arch!r}; known: {', '.join(sysdesc.ARCHS)}")
    check_plugin()
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="wan_compile_"))
    work.mkdir(parents=True, exist_ok=True)
    desc = prepare_descriptor(arch, max(r.num_devices for r in reqs), work)
    # Give every request its own IR folder so the exported files cannot be confused.
    reqs = [r if r.out_dir else dataclasses.replace(r, out_dir=str(work / f"ir_{i:03d}")) for i, r in enumerate(reqs)]

    results: dict[int, CompileResult] = {}
    pending = list(range(len(reqs)))
    deadline = time.monotonic() + timeout
    attempt = 0
    while pending:
        attempt += 1
        batch = {"requests": [{"index": i, **reqs[i].to_json()} for i in pending]}
        results_file = work / f"results_{attempt}.jsonl"
        log_file = work / f"worker_{attempt}.log"
        batch["results_file"] = str(results_file)
        tmp = private_tmpdir(work)
        try:
            rc = _run_worker(batch, worker_env(desc, tmp), log_file, deadline, python, verbose)
        finally:
            _share_assets(tmp)
        log = log_file.read_text(errors="replace")
        pieces = _split_log(log)
        done = set()
        if results_file.exists():
            for line in results_file.read_text().splitlines():
                raw = json.loads(line)
                i = raw.pop("index")
                results[i] = _result_from_worker(reqs[i], raw, pieces.get(i, ""))
                done.add(i)
        left = [i for i in pending if i not in done]
        if not left:
            break
        if rc == 0:
            raise CompileError(f"worker exited cleanly without results for {len(left)} request(s); log: {log_file}")
        # The worker died while compiling the first request without a result (a compiler crash
        # takes the process down): record that one, run the rest in a fresh worker.
        dead = left[0]
        started = dead in pieces
        if not started and not done:
            raise CompileError(
                f"the compile worker failed before compiling anything (exit code {rc}); "
                f"last log lines:\n{_tail(log)}\nfull log: {log_file}"
            )
        results[dead] = CompileResult(
            reqs[dead], ok=False,
            error=f"compiler process died (exit code {rc}) while compiling {reqs[dead].label()}",
            diagnostics=_diagnostics(pieces.get(dead, log)), out_dir=reqs[dead].out_dir,
            log=pieces.get(dead, _tail(log)),
        )
        pending = left[1:]
    return [results[i] for i in range(len(reqs))]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _run_worker(batch: dict, env: dict[str, str], log_file: Path, deadline: float, python: str | None,
                verbose: bool) -> int:
    cmd = [python or sys.executable, "-m", "wan_sharding.compile.worker"]
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise CompileError("compile timeout reached before all requests were compiled")
    with open(log_file, "w") as log:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE if verbose else log,
                                    stderr=subprocess.STDOUT, env=env, text=True,
                                    start_new_session=True)
        except OSError as e:
            raise CompileError(f"cannot start the compile worker {cmd}: {e}") from e
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(batch))
        proc.stdin.close()
        try:
            if verbose:
                assert proc.stdout is not None
                for line in proc.stdout:  # echo and keep
                    log.write(line)
                    sys.stderr.write(line)
                    if time.monotonic() > deadline:
                        raise subprocess.TimeoutExpired(cmd, remaining)
            return proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            # Only the worker we started (its own session, so its children too).
            os.killpg(proc.pid, 9)
            proc.wait()
            raise CompileError(f"compile worker timed out after {remaining:.0f} s; log: {log_file}") from None


def _result_from_worker(req: CompileRequest, raw: dict[str, Any], log: str) -> CompileResult:
    fields = {f.name for f in dataclasses.fields(CompileResult)} - {"request", "log", "diagnostics"}
    res = CompileResult(req, **{k: v for k, v in raw.items() if k in fields})
    res.log = log
    if not res.ok:
        res.diagnostics = _diagnostics(log)
    return res


def compile_dit(request: CompileRequest | None = None, arch: str = "wormhole_b0", **kwargs: Any) -> CompileResult:
    """Compile one request (or ``CompileRequest(**kwargs)``); see :func:`compile_many`."""
    req = request if request is not None else CompileRequest(**kwargs)
    return compile_many([req], arch)[0]


# --------------------------------------------------------------------------- worker side


def _find_ir(out_dir: Path, stage: str) -> str | None:
    # The plugin writes <out>/irs/<stage>_<timestamp>.mlir; "ttnn_runtime_*" is a second TTNN dump.
    hits = sorted(p for p in (out_dir / "irs").glob(f"{stage}_*.mlir") if re.fullmatch(rf"{stage}_\d+\.mlir", p.name))
    return str(hits[-1]) if hits else None


def compile_in_process(req: CompileRequest) -> dict[str, Any]:
    """Build, shard, lower and compile one request in this process. Worker side only: imports
    JAX, which must already see the tt devices (``TT_COMPILE_ONLY_SYSTEM_DESC`` set at start)."""
    import resource

    import jax
    import jax.numpy as jnp
    import torch

    from ..activation import apply_dit_sp_activation_sharding
    from ..backends.jax import JaxBackend
    from ..models import build_dit
    from ..specs import shard_dit_specs

    t0 = time.perf_counter()
    mesh = req.mesh_spec()
    devices = jax.devices()
    if devices[0].platform != "tt":
        raise CompileError(
            f"JAX platform is {devices[0].platform!r}, not 'tt': TT_COMPILE_ONLY_SYSTEM_DESC was not honoured")
    if len(devices) < mesh.num_devices:
        raise CompileError(f"mesh {mesh.name} needs {mesh.num_devices} devices; the descriptor gives {len(devices)}")

    dtype = torch.bfloat16 if req.dtype == "bf16" else torch.float32
    overrides = {} if req.blocks is None else {"num_layers": req.blocks}
    dit = build_dit(req.variant, req.size, device="meta", dtype=dtype, **overrides)
    # With a plan: the ordinary API, given the plan (its roles, FSDP, layout and padding apply).
    specs = shard_dit_specs(dit, req.plan) if req.plan is not None else shard_dit_specs(dit, mesh)
    backend = JaxBackend(mesh, devices=list(devices[: mesh.num_devices]))
    handle = apply_dit_sp_activation_sharding(dit, mesh, backend=backend, padding=req.padding, plan=req.plan,
                                              anchor=req.anchor)
    try:
        # dtype=None: each weight keeps the dtype the meta model has (bf16, fp32 where diffusers
        # keeps fp32); float64 rope tables become float32.
        state = backend.abstract_state(dit, specs)
        rep = backend.sharding(())
        cfg = config_for(req.variant, req.size)
        act = jnp.bfloat16 if req.dtype == "bf16" else jnp.float32
        f, h, w = req.latent
        ts_shape = (req.batch, req.tokens) if req.variant in PER_TOKEN_TIMESTEPS else (req.batch,)
        inputs = {
            "hidden_states": jax.ShapeDtypeStruct((req.batch, cfg["in_channels"], f, h, w), act, sharding=rep),
            "timestep": jax.ShapeDtypeStruct(ts_shape, getattr(jnp, req.timestep_dtype), sharding=rep),
            "encoder_hidden_states": jax.ShapeDtypeStruct(
                (req.batch, PROMPT_TOKENS[req.size], cfg["text_dim"]), act, sharding=rep),
        }
        t1 = time.perf_counter()
        lowered = jax.jit(backend.jax_forward(dit)).lower(state, (), inputs)
        t2 = time.perf_counter()
        out_dir = Path(req.out_dir or tempfile.mkdtemp(prefix="wan_ir_"))
        out_dir.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {
            "out_dir": str(out_dir), "lower_seconds": round(t2 - t1, 3), "sp_points": handle.points,
            "tokens": handle.state.valid_len, "padded_tokens": handle.state.padded_len,
        }
        try:
            lowered.compile(compiler_options={"export_path": str(out_dir)})
            result["ok"] = True
        except Exception as e:  # the plugin raises XlaRuntimeError / JaxRuntimeError
            result.update(ok=False, error=f"{type(e).__name__}: {e}"[:8000])
        t3 = time.perf_counter()
        result.update(
            compile_seconds=round(t3 - t2, 3), total_seconds=round(t3 - t0, 3),
            ttnn_path=_find_ir(out_dir, "ttnn"), ttir_path=_find_ir(out_dir, "ttir"),
            rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        )
        if result["ok"] and not result["ttnn_path"]:
            result.update(ok=False, error=f"compiled but no TTNN IR was exported under {out_dir}/irs")
        return result
    finally:
        handle.remove()
