"""``wan-sharding``: the command line. Parses arguments and prints; the work is in the library,
the jobs (``wan_sharding.jobs``), compile (``wan_sharding.compile``) and the planner.

With no subcommand it runs the main job, ``check``: the embedded tiny Wan 2.2 DiT, sharded on
each mesh with each executing backend (CPU virtual devices), against the unsharded model.

Exit codes: 0 success; 1 a check failed (PCC, bill, tiles) or a worker failed; 2 a usage error;
130 interrupted (Ctrl-C, SIGTERM), after every worker the command started has been stopped.

Errors are one line on stderr, ``wan-sharding <command>: error: <problem>; <fix>``: bad input is
found before any worker starts (``wan_sharding.cli.validate``). ``--debug`` (anywhere on the
command line) or ``WAN_SHARDING_DEBUG=1`` adds the Python traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn

from ..runtime import scratch
from . import check as check_commands
from . import compile as compile_commands
from . import pipeline as pipeline_commands
from . import plan as plan_commands
from . import serve as serve_commands
from .validate import UsageError, join_negative_values

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
DEBUG_ENV = "WAN_SHARDING_DEBUG"


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage block stays behind ``--help``), and no
    abbreviated options: ``--vae`` must never be read as ``--vae-kind`` (the subcommands' parsers
    are this class too)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="wan-sharding",
        description="Shard the unmodified diffusers Wan 2.2 DiT on Tenstorrent meshes. With no subcommand: check.",
        epilog="exit codes: 0 ok; 1 a check or worker failed; 2 usage error; 130 interrupted (workers stopped). "
               f"--debug (anywhere) or {DEBUG_ENV}=1: Python tracebacks with errors")
    sub = ap.add_subparsers(dest="command")
    for commands in (check_commands, compile_commands, plan_commands, pipeline_commands, serve_commands):
        commands.add_subcommands(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from ..runtime.workers import install_signal_handlers

    # The CLI process itself never runs a stack (its workers do, each with its own environment:
    # the tt backend's workers set PJRT_DEVICE=TT); say CPU up front so an import of torch-xla
    # here does not warn about defaulting to it.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    install_signal_handlers()  # SIGTERM unwinds like Ctrl-C, so workers are stopped
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = join_negative_values([a for a in argv if a != "--debug"])
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["check", *argv]
    args = parser.parse_args(argv)
    prog = f"wan-sharding {args.command}"
    scratch.adopt_library_temp_dirs()  # torch's, made at import: gone with ours even if we are killed
    try:
        return args.func(args)  # each command runs its own checks (args.validate) first
    except KeyboardInterrupt:
        print("wan-sharding: interrupted; its workers were stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    except UsageError as e:  # found before any worker started
        _report(prog, str(e), debug)
        return EXIT_USAGE
    except Exception as e:  # a bug or an environment failure: still one line unless debugging
        _report(prog, f"{type(e).__name__}: {e}".splitlines()[0]
                + ("" if debug else f" (rerun with --debug or {DEBUG_ENV}=1 for the traceback)"), debug)
        return 1


def _validate(args: argparse.Namespace) -> None:
    """The command's own input checks (``set_defaults(validate=...)``), before any worker starts."""
    validate = getattr(args, "validate", None)
    if validate is not None:
        validate(args)


def parse_and_validate(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` (without the program name) as ``main`` does and run the command's input
    checks, without running it: no worker starts and nothing is written.

    Raises:
        UsageError: what the command would refuse with exit 2 (one line: problem; fix);
        SystemExit: argparse's own refusal (unknown option, bad choice), also exit 2.
    """
    argv = join_negative_values([a for a in argv if a != "--debug"])
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["check", *argv]
    args = build_parser().parse_args(argv)
    _validate(args)
    return args


def _report(prog: str, message: str, debug: bool) -> None:
    if debug:
        traceback.print_exc()
    print(f"{prog}: error: {message}", file=sys.stderr)


__all__ = ["EXIT_INTERRUPTED", "EXIT_USAGE", "UsageError", "build_parser", "main", "parse_and_validate"]
