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
    if cfg == 2 and getattr(args, "vae", None) == "mesh":
        from ..vae.layout import CFG_MESH_REFUSAL

        raise UsageError(f"--vae mesh (tt's default) with --cfg 2: {CFG_MESH_REFUSAL}; pass --vae host (the VAE "
                         "decodes once per video, after denoising) or leave --cfg out")
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


# the command line's names for the request fields, in the messages of the request rules (jobs/requests.py)
REQUEST_FLAGS = {"prompt": "--prompt", "negative_prompt": "--negative-prompt", "num_inference_steps": "--steps",
                  "num_frames": "--frames", "height": "--height", "width": "--width", "seed": "--seed",
                  "guidance_scale": "--guidance-scale"}


GENERATE_MAX_STEPS = 10_000


def check_generate(args: argparse.Namespace) -> None:
    """``generate``: counts >= 1, a checkpoint that loads, frames/sizes the pipeline takes as they
    are, and an output directory that can be written, without this run's video and summary in it
    unless ``--overwrite``."""
    check_counts({f"--{flag}": getattr(args, flag) for flag in ("steps", "frames", "height", "width")})
    if args.model is not None:
        model_dir(args.model)
    check_video(args.frames, args.height, args.width, args.variant, args.model)
    import dataclasses

    from ..jobs.conditioning import default_limits
    from ..jobs.requests import check_limits

    # the server's rules, but for the steps: a local run's steps cost only its own time (a bound stays)
    limits = dataclasses.replace(default_limits(args.variant, args.model), steps=GENERATE_MAX_STEPS)
    check_limits({"prompt": args.prompt, "negative_prompt": args.negative_prompt, "num_inference_steps": args.steps,
                  "num_frames": args.frames, "height": args.height, "width": args.width, "seed": args.seed,
                  "guidance_scale": args.guidance_scale}, limits, REQUEST_FLAGS)
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
