"""Checks of command-line input, all in one place, run before any worker starts.

Each check raises :class:`UsageError` (or, as an argparse ``type``, ``ArgumentTypeError``) with one
line that names the problem and the fix; ``wan-sharding`` prints it as
``wan-sharding <command>: error: ...`` and exits 2 (``wan_sharding.cli.main``). Nothing is changed
on disk by a check: output paths are tested for writability (an unnamed temporary file), not created.

The rules a video request shares with the server (counts, frames and sizes) are
:mod:`wan_sharding.jobs.requests`'s; this module adds what only the command line has (paths,
plan files, option combinations).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable

# The rules a request shares with the server live in jobs.requests; re-exported here for the commands.
from ..jobs import requests
from ..jobs.requests import PATCH, UsageError, check_counts, check_video, read_json_file  # noqa: F401


# ---- argparse types: a bad value is an argparse error (one line, exit 2) --------------------------


def positive_int(text: str) -> int:
    """An integer >= 1 (the request rule ``jobs.requests.positive_int``, as an argparse type)."""
    try:
        return requests.positive_int(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def checked_option(flag: str, check, value: Any) -> Any:
    """``check(value)`` with an argparse type's error (or a request rule's) as a UsageError naming ``flag``."""
    try:
        return check(str(value))
    except (argparse.ArgumentTypeError, UsageError) as e:
        raise UsageError(f"{flag} {value}: {e}") from None


def positive_float(text: str) -> float:
    """A number > 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def compile_options(text: str) -> dict[str, Any]:
    """``--compile-options``: ``key=value,...`` or a JSON object of tt-mlir options, keys as
    tt-xla's plugin spells them (``wan_sharding.compile.options``); checked here, returned as the
    request's ``compile_options`` (our field names)."""
    from ..compile.options import CompileOptions

    try:
        return CompileOptions.parse(text).to_json()
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_latent(text: str) -> tuple[int, int, int]:
    """``"F,H,W"`` (or ``FxHxW``) as three positive sizes, H and W divisible by the patch size."""
    parts = str(text).replace("x", ",").split(",")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if len(dims) != 3:
        raise argparse.ArgumentTypeError(f"latent must be three whole numbers F,H,W such as 3,10,14, got {text!r}")
    if min(dims) < 1:
        raise argparse.ArgumentTypeError(f"latent sizes must be >= 1, got {text!r}; e.g. 3,10,14")
    bad = [f"{n} {v}" for n, v, p in zip(("F", "H", "W"), dims, PATCH) if v % p]
    if bad:
        raise argparse.ArgumentTypeError(
            f"latent {text!r}: {', '.join(bad)} not divisible by the patch size {PATCH[1]}; use even H and W")
    return dims  # type: ignore[return-value]


def latent(text: str) -> str:
    """argparse type: a latent shape, normalised to ``"F,H,W"``."""
    return ",".join(map(str, parse_latent(text)))


def check_length(names: tuple[str, ...]):
    """argparse type for ``check --lengths``: one of ``names`` or a latent ``F,H,W``."""
    def length(text: str) -> str:
        if text in names:
            return text
        try:
            return latent(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (or one of: {', '.join(names)})") from None
    return length


# Option values that start with '-' and hold a comma (``--latent -1,2,2``) are not numbers to
# argparse, which then reads them as an unknown option; joined as ``--latent=-1,2,2`` they reach the
# option's own check and get its message.
_NEGATIVE_LIST = re.compile(r"^-\d+(,-?\d+)+$")


def join_negative_values(argv: list[str]) -> list[str]:
    """``[..., "--latent", "-1,2,2"]`` -> ``[..., "--latent=-1,2,2"]``."""
    out: list[str] = []
    for tok in argv:
        if out and _NEGATIVE_LIST.match(tok) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


# ---- checks that need several options or the file system ---------------------------------------


def check_rope_length(dims: tuple[int, ...] | str, limit: int, what: str) -> None:
    """The patchified grid of a latent must fit the DiT's rope table (``rope_max_seq_len`` per axis)."""
    if isinstance(dims, str):
        dims = parse_latent(dims)
    grid = [d // p for d, p in zip(dims, PATCH)]
    if max(grid) > limit:
        raise UsageError(f"{what} {','.join(map(str, dims))} has a patch grid {'x'.join(map(str, grid))}, past the "
                         f"tiny DiT's rope table of {limit} per axis; use a smaller latent")


def model_dir(path: str) -> str:
    """A local diffusers Wan 2.2 pipeline directory: exists, and its ``model_index.json`` is JSON
    naming a Wan pipeline class."""
    from ..pipeline.shard import SUPPORTED_PIPELINES

    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"--model {path}: no such directory; pass the directory of a downloaded Wan 2.2 "
                         "diffusers checkpoint (e.g. a local copy of Wan-AI/Wan2.2-T2V-A14B-Diffusers)")
    if not (root / "model_index.json").is_file():
        raise UsageError(f"--model {path} has no model_index.json, so it is not a diffusers pipeline directory; "
                         "pass the checkpoint's top directory")
    index = read_json_file(root / "model_index.json")
    name = index.get("_class_name") if isinstance(index, dict) else None
    if name not in SUPPORTED_PIPELINES:
        raise UsageError(f"--model {path}: model_index.json names {name!r}, not a Wan 2.2 pipeline "
                         f"({', '.join(SUPPORTED_PIPELINES)})")
    return path


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _writable_dir(start: Path, flag: str, target: Path) -> None:
    base = _existing_ancestor(start)
    if not base.is_dir():
        raise UsageError(f"{flag} {target}: {base} is a file, not a directory; pick another path")
    try:  # a probe, not os.access: root passes os.access where the file system still refuses (/proc)
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {target}: cannot write in {base} ({e.strerror}); pick a writable place") from None


def output_dir(path: str | os.PathLike[str], flag: str, writes: Iterable[str] = (), overwrite: bool = False) -> None:
    """A directory the command will write into: an existing writable directory, or one that can
    be created (its nearest existing parent is a writable directory). Never an existing file.
    ``writes``: the names (or glob patterns) this run writes there; any already there is refused
    unless ``overwrite`` (:func:`fresh_outputs`)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise UsageError(f"{flag} {target} is an existing file, not a directory; pass a directory (it is created "
                         "if missing)")
    _writable_dir(target, flag, target)
    if target.is_dir():
        fresh_outputs(flag, target, [p for pattern in writes for p in target.glob(pattern)], overwrite)


def output_file(path: str | os.PathLike[str], flag: str, overwrite: bool) -> None:
    """A file the command will write: not a directory, in a writable (or creatable) directory, and
    not there already unless ``overwrite`` (:func:`fresh_outputs`)."""
    target = Path(path)
    if str(path) == "" or target.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a directory (or empty); pass a file name such as out.json")
    if target.exists() and not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {target} exists and is not writable; pick another path")
    _writable_dir(target.parent, flag, target)
    fresh_outputs(flag, target, [target] if target.exists() else [], overwrite)


def fresh_outputs(flag: str, target: Path, existing: list[Path], overwrite: bool) -> None:
    """The one policy of every command for outputs an earlier run left where it writes: refused,
    naming them and the fix, unless ``--overwrite`` (then they are replaced). Nothing is replaced
    silently, and the refusal comes before any worker starts."""
    if not existing or overwrite:
        return
    if existing == [target]:
        raise UsageError(f"{flag} {target} exists; pass --overwrite to replace it, or another {flag}")
    names = sorted(p.name for p in existing)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise UsageError(f"{flag} {target} already holds {shown} from an earlier run; pass --overwrite to replace "
                     f"{'it' if len(names) == 1 else 'them'}, or another {flag}")


def server_url(url: str, flag: str = "--server") -> None:
    """A server address as a URL with its scheme (``http://127.0.0.1:8765``): a bare ``host:port``
    is refused with the URL to use (the HTTP client would fail on it with an unhelpful error)."""
    if re.match(r"^https?://[^/\s]+", url):
        return
    if "://" in url:
        raise UsageError(f"{flag} {url}: use an http:// or https:// URL, e.g. http://127.0.0.1:8765")
    raise UsageError(f"{flag} {url} has no scheme; use http://{url.lstrip('/')}")


# ---- a sharding plan file (``--plan``) -------------------------------------------------------------


def plan_file(text: str) -> Any:
    """``--plan PLAN.json``: a :class:`~wan_sharding.plan.ShardingPlan` file that loads and checks."""
    from ..plan import PlanError, ShardingPlan

    try:
        return ShardingPlan.load(text)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} ({e.strerror}); pass a file written by "
                                         "`wan-sharding plan --write`") from None
    except (PlanError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a sharding plan: {e}") from None


def _roles_by_position(spec: Any) -> tuple:
    """(shape, positions of the SP axes, positions of the TP axes) of a MeshSpec."""
    from ..mesh import axes_of

    def positions(role: Any) -> tuple:
        return tuple(sorted(spec.axis_names.index(a) for a in axes_of(role)))

    return tuple(spec.shape), positions(spec.sp_axis), positions(spec.tp_axis)


def cfg_plan(mesh: str, cfg: int, padding: str | None) -> Any:
    """The plan of preset ``mesh`` cut into ``cfg`` guidance groups (``--cfg 2``), or a UsageError
    naming why it cannot be (``with_cfg``'s one line)."""
    from ..mesh import MeshError, with_cfg
    from ..options import DEFAULT_PADDING
    from ..plan import ShardingPlan

    try:
        return ShardingPlan.from_mesh(with_cfg(mesh, cfg), padding=padding or DEFAULT_PADDING)
    except MeshError as e:
        raise UsageError(f"--cfg {cfg} --mesh {mesh}: {e}") from None


def apply_cfg(args: argparse.Namespace, default_mesh: str) -> None:
    """``--cfg 2`` beside ``--mesh``: the mesh's plan cut into guidance groups becomes ``args.plan``
    (``--mesh`` then names nothing more). With a ``--plan``, ``--cfg`` must say what the plan says;
    with guidance off (``--guidance-scale`` <= 1: no uncond branch) it is refused."""
    cfg = getattr(args, "cfg", 1)
    plan = getattr(args, "plan", None)
    if plan is not None:
        if cfg == 2 and not plan.cfg_axes:
            raise UsageError(f"--cfg 2 contradicts the plan {plan.name!r}, which has no cfg axis; leave --cfg out "
                             "with --plan, or write a plan with cfg_axes")
        cfg = 2 if plan.cfg_axes else 1
    if cfg == 2 and getattr(args, "cache", "none") != "none":
        from ..pipeline.standin import CFG_CACHE_REFUSAL

        raise UsageError(f"--cache {args.cache} with --cfg 2: {CFG_CACHE_REFUSAL}")
    if cfg == 2 and getattr(args, "guidance_scale", 2.0) <= 1.0:
        raise UsageError(f"--cfg 2 with --guidance-scale {args.guidance_scale}: guidance is off, so a step has no "
                         "uncond branch to run beside the cond one; use --cfg 1 or a guidance scale above 1")
    if cfg == 2 and plan is None:
        from ..jobs.launch import UNSHARDED

        if getattr(args, "mesh", None) == UNSHARDED:
            raise UsageError(f"--cfg 2 needs a mesh to cut in two; --mesh {UNSHARDED} is the one-device baseline")
        args.plan = cfg_plan(args.mesh or default_mesh, cfg, args.padding)
        args.mesh = None


def apply_plan(args: argparse.Namespace, default_mesh: str | list[str], mesh_flag: str = "--mesh") -> None:
    """With ``--plan``: the mesh (``args.mesh``, or ``args.meshes`` for ``check``) and padding become
    the plan's; a ``--mesh``/``--padding`` that says otherwise is a usage error. Without: the defaults.
    ``--cfg 2`` (``apply_cfg``) first makes the plan of ``--mesh`` cut into guidance groups."""
    from ..mesh import mesh_from_preset
    from ..options import DEFAULT_PADDING

    if mesh_flag == "--mesh":
        apply_cfg(args, default_mesh)  # type: ignore[arg-type]
    plan = getattr(args, "plan", None)
    attr = mesh_flag.lstrip("-")
    given = getattr(args, attr)
    if plan is None:
        if given is None:
            setattr(args, attr, default_mesh)
        if args.padding is None:
            args.padding = DEFAULT_PADDING
        return
    wanted = plan.mesh()
    for name in ([given] if isinstance(given, str) else given or []):
        if _roles_by_position(mesh_from_preset(name)) != _roles_by_position(wanted):
            raise UsageError(f"{mesh_flag} {name} contradicts the plan's mesh ({plan.name}); leave {mesh_flag} out "
                             "with --plan")
    if args.padding is not None and args.padding != plan.padding:
        raise UsageError(f"--padding {args.padding} contradicts the plan's padding {plan.padding}; leave --padding "
                         "out with --plan")
    setattr(args, attr, wanted.name if attr == "mesh" else [wanted.name])
    args.padding = plan.padding


# ---- whole commands (called first thing in the command, before any worker starts) ---------------


def check_generate(args: argparse.Namespace) -> None:
    """``generate``: counts >= 1, a checkpoint that loads, frames/sizes the pipeline takes as they
    are, and an output directory that can be written, without this run's video and summary in it
    unless ``--overwrite``."""
    check_counts({f"--{flag}": getattr(args, flag) for flag in ("steps", "frames", "height", "width")})
    if args.model is not None:
        model_dir(args.model)
    check_video(args.frames, args.height, args.width, args.variant, args.model)
    from ..jobs.generate import output_files
    from ..pipeline.tiny import checkpoint_variant

    variant = args.variant if args.model is None else checkpoint_variant(args.model)
    plan = getattr(args, "plan", None)
    files = output_files(args.out, variant, args.backend, args.mesh, args.padding, None if plan is None else plan.name,
                         args.cache, args.video_format)
    output_dir(args.out, "--out", [f.name for f in files], args.overwrite)


def check_profile(args: argparse.Namespace) -> None:
    """``profile``: no ``--plan`` with the unsharded baseline, ``--cache`` only with denoising steps,
    at least one warm-up (the first iteration compiles and is never timed) and one timed iteration;
    a latent the tiny DiT can take."""
    from ..jobs.launch import UNSHARDED
    from ..models import config_for

    if getattr(args, "plan", None) is not None and args.mesh == UNSHARDED:
        raise UsageError(f"--mesh {UNSHARDED} is the one-device baseline; leave it out with --plan")
    if getattr(args, "cache", "none") != "none" and "dit" in args.what:
        raise UsageError("--cache acts across denoising steps; use it with --what step")
    checked_option("--iters", positive_int, args.iters)
    if args.warmup < 1:
        raise UsageError(f"--warmup {args.warmup}: must be >= 1 (the first iteration compiles, so it is a warm-up "
                         "and never timed); use --warmup 1 or more")
    if args.latent is not None:
        args.latent = checked_option("--latent", latent, args.latent)
        check_rope_length(args.latent, config_for(args.variant)["rope_max_seq_len"], "--latent")


# ---- several hosts (``cli.args.add_multihost``) -----------------------------------------------------


def binding_mesh(args: argparse.Namespace, default: Any) -> Any:
    """The default mesh of a command: with ``--rank-binding`` (and neither ``--mesh`` nor
    ``--plan``) the binding's preset (:func:`wan_sharding.systems.served_presets`), else
    ``default`` (a name, or a list of names for ``check``)."""
    from ..systems import rank_binding, served_presets

    name = getattr(args, "rank_binding", None)
    if not name or getattr(args, "plan", None) is not None:
        return default
    system = rank_binding(name)
    presets = served_presets(system)
    if not presets and getattr(args, "mesh", getattr(args, "meshes", None)) is None:
        grid = "x".join(map(str, system.grid))
        raise UsageError(f"--rank-binding {name}: its global mesh {grid} has no preset; pass --plan PLAN.json (wan-sharding "
                         f"plan --mesh {grid} --arch {system.arch} --rank-binding {name} --write PLAN.json)")
    if not presets:
        return default
    return presets[0] if isinstance(default, str) else presets[:1]


def _grids(args: argparse.Namespace) -> list[tuple[str, tuple[int, ...]]]:
    """``(what, chip grid)`` of every mesh the command runs on (after :func:`apply_plan`)."""
    from ..jobs.launch import UNSHARDED
    from ..mesh import parse_mesh_shape

    plans = dict(getattr(args, "cfg_plans", None) or {})
    if not plans and getattr(args, "plan", None) is not None:
        return [(f"the plan's mesh ({args.plan.name})", args.plan.mesh().grid)]
    names = args.meshes if hasattr(args, "meshes") else [args.mesh]
    return [(f"--mesh {n}", (1, 1) if n == UNSHARDED else plans[n].mesh().grid if n in plans
             else parse_mesh_shape(n)) for n in names]


def check_binding(args: argparse.Namespace) -> None:
    """``--rank-binding`` on a command that plans or compiles (no launch): the mesh (or plan) must
    be its global mesh, the chips its architecture."""
    from ..systems import BindingError, check_binding_grid, rank_binding

    system = rank_binding(args.rank_binding)
    plan = getattr(args, "plan", None)
    if plan is not None and plan.rank_binding and plan.rank_binding != system.name:
        raise UsageError(f"--rank-binding {system.name} contradicts the plan's rank binding {plan.rank_binding}; leave "
                         "--rank-binding out with --plan")
    try:
        for what, grid in _grids(args):
            check_binding_grid(system, grid, what)
    except BindingError as e:
        raise UsageError(str(e)) from None
    if getattr(args, "arch", system.arch) != system.arch:
        raise UsageError(f"--arch {args.arch} contradicts --rank-binding {system.name} ({system.machine}: "
                         f"{system.arch} chips); pass --arch {system.arch}")


def check_launch(args: argparse.Namespace, backends: list[str]) -> None:
    """The multi-host flags, after the mesh is known: sets ``args.distributed`` (the resolved
    launch as JSON, or None on one host). Refused in one line: the flags without ``--backend tt``,
    a mesh or plan that is not the binding's global mesh, a binding other than the plan's, hosts
    that do not match it, a missing worker binary, a controller that is not this machine
    (:func:`wan_sharding.backends.tt_distributed.resolve_launch`), several serve replicas, and an
    environment that turns tt-xla's distributed runtime on without a binding."""
    from ..backends.tt_distributed import LAUNCH_FLAGS, LaunchError, inherited_problem, resolve_launch
    from ..systems import BindingError, check_binding_grid, rank_binding

    args.distributed = None
    flag = "--backends" if hasattr(args, "backends") else "--backend"
    plan = getattr(args, "plan", None)
    given = [f for f in ("--rank-binding", *LAUNCH_FLAGS, "--dry-run") if getattr(args, f[2:].replace("-", "_"), None)]
    if "tt" not in backends:
        if given:
            raise UsageError(f"{given[0]} is for a launch on Tenstorrent hardware; add {flag} tt")
        return
    name = args.rank_binding
    if plan is not None and plan.rank_binding:
        if name and name != plan.rank_binding:
            raise UsageError(f"--rank-binding {name} contradicts the plan's rank binding {plan.rank_binding}; leave "
                             "--rank-binding out with --plan")
        name = plan.rank_binding
    if name is None:
        hosts = [f for f in given if f in LAUNCH_FLAGS]
        if hosts:
            raise UsageError(f"{hosts[0]} belongs to a launch over several hosts; pass --rank-binding NAME with it")
        problem = "" if args.dry_run else inherited_problem()
        if problem:
            raise UsageError(problem)
        return
    if backends != ["tt"]:
        raise UsageError(f"--rank-binding {name} runs the tt backend over several hosts; use {flag} tt alone")
    if getattr(args, "replicas", 1) > 1:
        raise UsageError(f"--replicas {args.replicas} with --rank-binding {name}: tt-xla's distributed runtime has one "
                         "controller for all its hosts, so the server runs one worker; use --replicas 1")
    try:
        system = rank_binding(name)
        for what, grid in _grids(args):
            check_binding_grid(system, grid, what)
        launch = resolve_launch(name, args.hosts, args.hostfile, args.controller, args.tcp_iface, args.rsh_agent,
                                dry_run=args.dry_run)
    except (BindingError, LaunchError) as e:
        raise UsageError(str(e)) from None
    args.distributed = launch.to_json()


def check_vae_compile(args: argparse.Namespace) -> None:
    """``compile --component vae``: a resolution the VAE's compile knows, no DiT-only option."""
    from ..compile.vae import PIXELS

    if args.resolution not in PIXELS:
        raise UsageError(f"--resolution {args.resolution} with --component vae: choose {' or '.join(PIXELS)}")
    if (args.latent is not None or args.plan is not None or args.cfg == 2 or args.patches or args.rank_binding
            or args.variant is not None or args.blocks is not None):
        raise UsageError("--latent, --plan, --cfg, --patches, --rank-binding, --variant and --blocks are DiT options; "
                         "with --component vae give --mesh, --resolution, --frontend, --vae-kind, --strategy and --step")
    if args.tokens is not None or args.vocab is not None:
        raise UsageError("--tokens and --vocab are the text encoder's; with --component vae give --mesh, --resolution, "
                         "--frontend, --vae-kind, --strategy and --step")


def check_vae_request(args: argparse.Namespace) -> None:
    """``check --component vae``: no DiT-only option."""
    if args.plan is not None or args.cfg == 2 or args.patches or args.padding not in (None, "mask"):
        raise UsageError("--plan, --cfg, --patches and --padding are DiT options; with --component vae give "
                         "--meshes, --backends, --dtype and --vae-kind")
    if args.rank_binding or args.hosts or args.hostfile or args.dry_run:
        raise UsageError("--rank-binding, --hosts, --hostfile and --dry-run launch the DiT's check over several hosts; "
                         "the VAE's check runs on one host: leave them out with --component vae")
