"""Write a generated video: H.264 in MP4 (the default), or an animated GIF on request.

MP4 goes through imageio's ffmpeg writer, whose ffmpeg binary comes in the ``imageio-ffmpeg`` wheel
(the writer diffusers' ``export_to_video`` uses). It is called directly, not through
``export_to_video``, because that function passes no encoder options, and the same frames must give
the same bytes on every run (a server's video before and after its worker is replaced):

- x264's output depends on its thread count, which by default follows the CPU count the process
  sees (a worker pinned to fewer cores wrote different bytes): the count is fixed (``MP4_THREADS``);
- ``bitexact`` keeps ffmpeg's version string out of the container;
- ``faststart`` puts the index first, so a player can start before the whole file has arrived.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..runtime.workers import atomic_path

VIDEO_FORMATS = ("mp4", "gif")
MP4_THREADS = 4  # fixed: x264's bytes depend on it (4 costs nothing on fewer cores, it only bounds the speed-up)
# crf 18: x264's "visually lossless" point; quality is given here, so imageio's own quality is off.
MP4_FFMPEG_PARAMS = ("-crf", "18", "-threads", str(MP4_THREADS), "-fflags", "+bitexact", "-flags:v",
                     "+bitexact", "-movflags", "+faststart")


def mp4_encoder_missing() -> str | None:
    """One line saying what MP4 output lacks here (``None``: ``imageio`` and ``imageio-ffmpeg``
    are installed)."""
    missing = [name for name, mod in (("imageio", "imageio"), ("imageio-ffmpeg", "imageio_ffmpeg"))
               if importlib.util.find_spec(mod) is None]
    if not missing:
        return None
    return f"MP4 output needs {' and '.join(missing)} (dependencies of wan-sharding: pip install {' '.join(missing)})"


@contextmanager
def ffmpeg_in_this_process_group() -> Iterator[None]:
    """Within: imageio-ffmpeg starts ffmpeg as a plain child. By default it passes
    ``preexec_fn=os.setpgrp`` (to keep a terminal's Ctrl-C from ffmpeg), which makes CPython fork
    and run Python in the child: unsafe beside JAX's threads ("os.fork() was called ... will likely
    lead to a deadlock"), and it puts ffmpeg outside the worker's process group, where stopping the
    group does not reach it. imageio-ffmpeg's own switch turns that off; what it costs is that a
    Ctrl-C reaching the group stops ffmpeg too, which the atomic write already covers."""
    key = "IMAGEIO_FFMPEG_NO_PREVENT_SIGINT"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _uint8(frames):
    import numpy as np

    return [(np.clip(f, 0, 1) * 255).round().astype(np.uint8) for f in frames]


def write_video(frames, stem: Path, fps: int = 8, video_format: str = "mp4") -> Path:
    """``frames``: (F, H, W, 3) floats in [0, 1]; returns the path written (``stem`` + ``.mp4`` or
    ``.gif``).

    Written under a temporary name and renamed when complete, so an interrupted run leaves no
    half-written video that looks complete.

    Raises:
        ValueError: an unknown ``video_format``.
        RuntimeError: MP4 asked for without its encoder installed (:func:`mp4_encoder_missing`).
    """
    if video_format not in VIDEO_FORMATS:
        raise ValueError(f"unknown video format {video_format!r}; choose {' or '.join(VIDEO_FORMATS)}")
    images = _uint8(frames)
    if video_format == "gif":
        from diffusers.utils import export_to_gif
        from PIL import Image

        target = stem.with_suffix(".gif")
        with atomic_path(target, suffix=".partial.gif") as tmp:  # PIL picks the format from the suffix
            export_to_gif([Image.fromarray(i) for i in images], str(tmp), fps=fps)
        return target
    missing = mp4_encoder_missing()
    if missing:
        raise RuntimeError(missing)
    import imageio

    target = stem.with_suffix(".mp4")
    with atomic_path(target, suffix=".partial.mp4") as tmp, ffmpeg_in_this_process_group():
        # yuv420p: what players decode; sizes must then be even, and the pipelines' are multiples of 16.
        with imageio.get_writer(str(tmp), format="FFMPEG", mode="I", fps=fps, codec="libx264", quality=None,
                                pixelformat="yuv420p", macro_block_size=16, ffmpeg_log_level="error",
                                ffmpeg_params=list(MP4_FFMPEG_PARAMS)) as writer:
            for image in images:
                writer.append_data(image)
    return target
