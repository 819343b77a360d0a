"""Argument types shared by the commands: one spelling of each choice (``wan_sharding.options``)."""

from __future__ import annotations

import argparse
import sys
from typing import Iterable

from ..mesh import PRESET_TABLE, MeshError, preset_key
from ..options import (COMPONENTS, DEFAULT_COMPONENT, DTYPE_ALIASES, DTYPES, PADDING_NAMES, dtype_name, settings_line,
                       vae_placement)


def _preset(text: str, several: str) -> str:
    try:
        return preset_key(text)
    except MeshError as e:
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) > 1 and all(p.lower().replace(" ", "") in PRESET_TABLE for p in parts):
            raise argparse.ArgumentTypeError(f"{text!r} names {len(parts)} meshes; {several}") from None
        raise argparse.ArgumentTypeError(str(e)) from None


def preset(text: str) -> str:
    """A mesh preset name, normalised (``"2 x 4"`` -> ``"2x4"``)."""
    return _preset(text, "this option takes one")


def presets(text: str) -> str:
    """One mesh preset of a list option (``--meshes 2x4 8x4``): the preset, normalised; a comma
    list is refused, naming how to write it."""
    return _preset(text, f"separate meshes with spaces: --meshes {' '.join(str(text).replace(' ', '').split(','))}")


def dtype(text: str) -> str:
    """``fp32`` or ``bf16`` (``f32``, ``float32``, ``bfloat16`` accepted)."""
    try:
        return dtype_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_mesh(ap: argparse.ArgumentParser, default: str, *extra: str, help: str = "") -> None:
    """``--mesh`` with the presets (and any ``extra`` names) as its choices."""
    choices = [*PRESET_TABLE, *extra]
    ap.add_argument("--mesh", default=default, type=lambda t: t if t in extra else preset(t), choices=choices,
                    metavar="MESH", help=help or f"mesh preset: {', '.join(choices)} (default {default})")


def add_component(ap: argparse.ArgumentParser, choices: tuple[str, ...] = COMPONENTS) -> None:
    """``--component NAME``: which part of the pipeline the command works on (``wan_sharding.options.COMPONENTS``)."""
    ap.add_argument("--component", default=DEFAULT_COMPONENT, choices=list(choices),
                    help=f"the pipeline component: {', '.join(choices)} (default {DEFAULT_COMPONENT})")


# Where the pipeline's UMT5 text encoder runs (``--text-encoder``): on the host, as diffusers runs it,
# or sharded on the mesh with the experts (``shard_pipeline(..., text_encoder=True)``).
TEXT_ENCODER_PLACES = ("host", "mesh")


def add_text_encoder(ap: argparse.ArgumentParser, help: str = "") -> None:
    """``--text-encoder host|mesh``: where the pipeline's UMT5 text encoder runs."""
    ap.add_argument("--text-encoder", default="host", choices=list(TEXT_ENCODER_PLACES),
                    help=help or "mesh: the UMT5 text encoder sharded on the mesh with the experts (Megatron TP); "
                                 "host: on the host, as diffusers runs it (default)")


def add_dtype(ap: argparse.ArgumentParser, default: str | None, help: str = "") -> None:
    ap.add_argument("--dtype", default=default, type=dtype, choices=DTYPES, metavar="{" + ",".join(DTYPES) + "}",
                    help=help or f"compute dtype (also accepted: {', '.join(a for a in DTYPE_ALIASES if a not in DTYPES)})")


def add_padding(ap: argparse.ArgumentParser, default: str | None) -> None:
    ap.add_argument("--padding", default=default, choices=list(PADDING_NAMES),
                    help=f"how the token dim is padded to SP x 32 (default {default or 'mask, or the plan padding'})")


def settings_for(args: argparse.Namespace) -> str:
    """What a ``check``, ``generate`` or ``profile`` run prints first (``wan_sharding.options.settings_line``):
    its backend(s), and the command's patches, step cache and CFG parallel (a plan with cfg axes,
    or ``--cfg 2``), from its checked arguments."""
    plan = getattr(args, "plan", None)
    cfg = 2 if plan is not None and plan.cfg_axes else getattr(args, "cfg", 1)
    backends = args.backends if hasattr(args, "backends") else [args.backend]
    places = {}
    component = getattr(args, "component", "dit")
    if component in ("vae", "text-encoder"):  # a component's own check: that component on the mesh, nothing else
        places = {"vae" if component == "vae" else "text encoder": "mesh"}
    elif hasattr(args, "text_encoder"):
        places["text encoder"] = args.text_encoder
    if hasattr(args, "vae") and component == "dit":  # per backend where its default differs (mesh on tt, host on CPU)
        where = {b: vae_placement(args.vae, b) for b in backends}
        places["vae"] = (next(iter(where.values())) if len(set(where.values())) == 1
                         else ", ".join(f"{w} ({b})" for b, w in where.items()))
    return settings_line(", ".join(backends), getattr(args, "patches", ()), getattr(args, "cache", "none"), cfg, places)


def print_settings(args: argparse.Namespace) -> None:
    """Print :func:`settings_for` ``args``."""
    print(settings_for(args), flush=True)


def stack_missing(backends: Iterable[str]) -> bool:
    """True, after one line on stderr naming what is missing and how to get it, when a backend's
    stack is not on this machine (``tt`` without Tenstorrent's stack); the command then exits 1
    before any worker starts."""
    from ..backends import BackendError
    from ..jobs.launch import check_stacks

    try:
        check_stacks(backends)
    except BackendError as e:
        print(f"wan-sharding: {e}", file=sys.stderr)
        return True
    return False


class _PatchNames(argparse.Action):
    """Stores the names with ``exact`` replaced by every exact patch (``wan_sharding.patches.patch_names``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        from ..patches import patch_names

        setattr(namespace, self.dest, patch_names(values))


def add_patches(ap: argparse.ArgumentParser) -> None:
    """``--patches NAME ...``: opt-in model rewrites applied before sharding (``wan_sharding.patches``);
    ``exact`` selects every exact one."""
    from ..patches import EXACT, EXACT_PATCHES, PATCHES

    ap.add_argument("--patches", nargs="+", default=[], choices=[*PATCHES, EXACT], metavar="PATCH",
                    action=_PatchNames,
                    help=f"model rewrites applied before sharding: {', '.join(PATCHES)}, or {EXACT} for every exact one "
                         f"({' '.join(EXACT_PATCHES)}) (default none)")


def add_cache(ap: argparse.ArgumentParser) -> None:
    """``--cache KIND``: a diffusers step cache on every expert, with Wan-ready settings (``wan_sharding.caching``)."""
    from ..caching import CACHE_KINDS

    ap.add_argument("--cache", default="none", choices=list(CACHE_KINDS),
                    help="step cache on every expert: fbc (FirstBlockCache), mag (MagCache, calibrated first), "
                         "taylorseer, pab (Pyramid Attention Broadcast); default none")


def add_cfg(ap: argparse.ArgumentParser) -> None:
    """``--cfg 2``: classifier-free guidance parallel, the mesh's SP axis cut into two groups, one
    per guidance branch (``wan_sharding.mesh.with_cfg``)."""
    ap.add_argument("--cfg", type=int, default=1, choices=[1, 2],
                    help="2: run each step's cond and uncond expert calls as one program, one branch per half of the "
                         "mesh (its SP axis cut in two: 2x4 -> 2 x 1x4, 8x4 -> 2 x (SP 4, TP 4)); default 1")


def add_plan(ap: argparse.ArgumentParser) -> None:
    """``--plan PLAN.json``: a ShardingPlan (``wan-sharding plan --write``) instead of a preset's roles."""
    from .validate import plan_file

    ap.add_argument("--plan", type=plan_file, metavar="PLAN.json",
                    help="a sharding plan written by `wan-sharding plan --write`: its mesh, axis roles, FSDP, layout "
                         "and padding are applied (--mesh / --padding then must agree or be left out)")


def binding_name(text: str) -> str:
    """A rank binding tt-xla's plugin knows (``wan_sharding.systems.RANK_BINDINGS``)."""
    from ..systems import BindingError, rank_binding

    try:
        return rank_binding(text).name
    except BindingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_multihost(ap: argparse.ArgumentParser, launch: bool = True) -> None:
    """``--rank-binding NAME``: a system of several hosts run by tt-xla's distributed runtime
    (``docs/tt-backend.md``, "Beyond one host"). With ``launch`` (the commands that run ``--backend
    tt``), also the hosts, the controller, MPI's network interface and remote shell, and
    ``--dry-run``; the checks are :func:`wan_sharding.cli.launch.check_launch`'s."""
    from ..systems import RANK_BINDINGS

    g = ap.add_argument_group("several hosts (tt-xla's distributed runtime; docs/tt-backend.md)")
    g.add_argument("--rank-binding", type=binding_name, metavar="NAME",
                   help=f"the system, as tt-xla's plugin names it: {', '.join(RANK_BINDINGS)}; the mesh must be its "
                        "global mesh (default: its preset)" + ("" if launch else "; its hosts are planned for"))
    if not launch:
        return
    g.add_argument("--hosts", metavar="H1,H2,...", help="the hosts, one MPI rank each, in rank order")
    g.add_argument("--hostfile", metavar="PATH", help="an MPI hostfile instead of --hosts")
    g.add_argument("--controller", metavar="HOST",
                   help="the host this command runs on, where the workers connect back to (default: the first host)")
    g.add_argument("--tcp-iface", metavar="IFACE", help="the network interface MPI uses between the hosts")
    g.add_argument("--rsh-agent", metavar="SCRIPT",
                   help="the script MPI reaches a host with (containers only; default: ssh)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the resolved mesh, binding, hosts and the tt worker's environment, then exit 0 "
                        "without starting anything")
def add_overwrite(ap: argparse.ArgumentParser) -> None:
    """``--overwrite``: replace what an earlier run left where this one writes (without it, the
    command refuses before it starts: ``wan_sharding.cli.validate.fresh_outputs``)."""
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the outputs an earlier run left there (default: refuse, before anything runs)")
