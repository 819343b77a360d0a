"""Third-party output known to be harmless, dropped in worker processes by message and module.

A worker (:func:`wan_sharding.runtime.workers.worker_main`) calls :func:`quiet_worker` first. Each entry of
:data:`HARMLESS` names the logger (or warning category), the module that emits it (a file on the
call stack when it is made) and the start of its message, and says why it is harmless; a record
or warning is dropped only when all three match, so nothing else from that library, and no other
message of that logger or category, is silenced.

Progress bars are drawn only when the worker's stderr is a terminal: piped or redirected, they
would fill a log with carriage returns. :func:`progress_env` (set by the worker runner) turns off
tqdm's default for the bars of checkpoint loading; diffusers' pipelines pass their own setting, so
their bars are turned off per pipeline (``wan_sharding.jobs.launch.quiet_progress``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass

__all__ = ["HARMLESS", "Harmless", "dropped", "is_terminal", "progress_env", "quiet_worker"]


@dataclass(frozen=True)
class Harmless:
    """One known message: where it comes from (``logger`` name, or a warning ``category``), the
    emitting module's file (a path suffix), the start of the message, and why it can be dropped."""

    module: str
    message: str
    why: str
    logger: str | None = None
    category: type[Warning] | None = None

    def matches(self, message: str) -> bool:
        """Whether ``message``, being logged now, is this one: its start, and :attr:`module` on the
        call stack (the record's own file can be a logging wrapper's: absl's)."""
        if not message.startswith(self.message):
            return False
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_filename.replace(os.sep, "/").endswith(self.module):
                return True
            frame = frame.f_back
        return False


HARMLESS: tuple[Harmless, ...] = (
    Harmless("flax/io.py", "Tensorflow library not found",
             "flax (imported by torchax) falls back to plain file I/O; nothing here reads gs:// paths", logger="absl"),
    Harmless("torchax/ops/ops_registry.py", "Duplicate op registration for aten.__and__",
             "torchax 0.0.13 registers its lowering of aten.__and__ twice at import; the second, the same op, is "
             "kept", logger="root"),
    Harmless("diffusers/models/transformers/transformer_wan.py",
             "scatter inputs have incompatible types: cannot safely cast value from dtype=float32 to dtype=bfloat16",
             "diffusers' interleaved rotary (apply_rotary_emb) writes float32 products into a bf16 tensor; torch "
             "casts them on assignment, and JAX 0.7.1's scatter under torchax does the same cast with this warning "
             "(same values; the package's own rotary casts explicitly)", category=FutureWarning),
    Harmless("torchax/tensor.py", "Explicitly requested dtype int64 requested in",
             "JAX without x64 keeps integers in int32: under torchax the text encoder's token ids and positions "
             "(all below 2**31: UMT5's vocabulary is 256384) and the VAE's upsampling indices are int32, the same "
             "values", category=UserWarning),
)


class _DropHarmless(logging.Filter):
    def __init__(self, entries: list[Harmless]):
        super().__init__()
        self.entries = entries

    def filter(self, record: logging.LogRecord) -> bool:
        return not _drop(self.entries, record.getMessage())


_DROPPED: dict[str, int] = {}


def dropped() -> dict[str, int]:
    """How many times each :data:`HARMLESS` message (log record or warning) was dropped in this
    process so far, by its message."""
    return dict(_DROPPED)


def _drop(entries: list[Harmless], message: str) -> bool:
    for entry in entries:
        if entry.matches(message):
            _DROPPED[entry.message] = _DROPPED.get(entry.message, 0) + 1
            return True
    return False


def quiet_worker() -> None:
    """Drop :data:`HARMLESS` messages in this process. For worker processes: call first thing."""
    by_logger: dict[str, list[Harmless]] = {}
    for entry in HARMLESS:
        if entry.logger is not None:
            by_logger.setdefault(entry.logger, []).append(entry)
    for name, entries in by_logger.items():
        # A filter acts on the records logged on its own logger (the root logger's: module-level
        # ``logging.warning`` calls), which is where these are made.
        logging.getLogger(None if name == "root" else name).addFilter(_DropHarmless(entries))
    caught = [e for e in HARMLESS if e.category is not None]
    for entry in caught:  # every time, not once per place: each one's caller decides whether it shows
        warnings.filterwarnings("always", message=re.escape(entry.message), category=entry.category)
    show = warnings.showwarning

    # A warnings filter matches the module a warning is attributed to (here JAX's), not the caller
    # that made it: the stdlib's display hook runs inside warn(), with the caller on the stack.
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not _drop([e for e in caught if issubclass(category, e.category)], str(message)):
            show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning


def progress_env(env: dict[str, str], stderr_is_terminal: bool) -> dict[str, str]:
    """``env`` for a process whose stderr is (or is not) a terminal: without one, progress bars
    off (``TQDM_DISABLE=1``: tqdm >= 4.66 reads its defaults from ``TQDM_<argument>`` when it is
    imported, so this has to be in the environment the process starts with). A value already
    there is kept."""
    if not stderr_is_terminal:
        env.setdefault("TQDM_DISABLE", "1")
    return env


def is_terminal(stream: object) -> bool:
    """Whether ``stream`` is a terminal (False for anything without a working ``isatty``)."""
    try:
        return bool(stream.isatty())  # type: ignore[attr-defined]
    except (AttributeError, ValueError):
        return False
