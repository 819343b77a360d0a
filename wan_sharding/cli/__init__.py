"""``wan-sharding``: the command line. Parses arguments and prints; the work is in the library,
the jobs (``wan_sharding.jobs``), compile (``wan_sharding.compile``) and the planner.

With no subcommand it runs the main job, ``check``: the embedded tiny Wan 2.2 DiT, sharded on
each mesh with each executing backend (CPU virtual devices), against the unsharded model.

Exit codes: 0 success; 1 a check failed (PCC, bill, tiles) or a worker failed; 2 a usage error;
130 interrupted (Ctrl-C, SIGTERM), after every worker the command started has been stopped.
"""

from __future__ import annotations

import argparse
import sys

from . import check as check_commands
from . import compile as compile_commands
from . import pipeline as pipeline_commands
from . import plan as plan_commands

EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="wan-sharding",
        description="Shard the unmodified diffusers Wan 2.2 DiT on Tenstorrent meshes. With no subcommand: check.",
        epilog="exit codes: 0 ok; 1 a check or worker failed; 2 usage error; 130 interrupted (workers stopped)")
    sub = ap.add_subparsers(dest="command")
    for commands in (check_commands, compile_commands, plan_commands, pipeline_commands):
        commands.add_subcommands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    import os

    from ..workers import install_signal_handlers

    # The CLI process itself never runs a stack (its workers do, each with its own environment:
    # the tt backend's workers set PJRT_DEVICE=TT); say CPU up front so an import of torch-xla
    # here does not warn about defaulting to it.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    install_signal_handlers()  # SIGTERM unwinds like Ctrl-C, so workers are stopped
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["check", *argv]
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("wan-sharding: interrupted; its workers were stopped", file=sys.stderr)
        return EXIT_INTERRUPTED


__all__ = ["EXIT_INTERRUPTED", "build_parser", "main"]
