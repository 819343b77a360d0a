"""The rules of a video request that the command line and the server share.

A request to generate a video (``wan-sharding generate`` / ``serve``'s options, or a job posted to the
server's API) is checked by these functions before any worker starts; each raises
:class:`UsageError` with one line that names the field and the fix.

The numbers come from the diffusers Wan 2.2 pipelines (``diffusers/pipelines/wan/pipeline_wan.py``):
frames must be ``4k+1`` (the VAE's temporal factor, ``scale_factor_temporal`` 4) and height and
width multiples of the VAE's spatial factor times the DiT's patch size (the pipeline otherwise
rounds them down with only a log warning), and at least 16 (its ``check_inputs``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["PATCH", "UsageError", "check_counts", "check_video", "check_video_format", "positive_int",
           "read_json_file", "video_factors"]


class UsageError(ValueError):
    """A bad request (a command-line option or a server API field): one line naming the problem and
    the fix. ``wan-sharding`` exits 2 with it; the server answers 422."""


def positive_int(text: str) -> int:
    """An integer >= 1 (steps, iterations, blocks, batch, ...); UsageError otherwise (the command
    line turns it into its own option error: ``cli.validate.positive_int``)."""
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise UsageError(f"must be >= 1, got {value}")
    return value


# The DiT patch (frames, height, width): the same for every Wan 2.2 variant (wan_sharding.models).
PATCH = (1, 2, 2)


def video_factors(variant: str, model: str | None) -> tuple[int, int]:
    """(temporal factor, height/width multiple) of the pipeline ``generate`` will build: the tiny
    pipeline's VAE, or the checkpoint's own VAE and DiT configs (read from ``model``)."""
    if model is None:
        from ..pipeline.tiny import VARIANT_PIPELINES

        spatial = 16 if VARIANT_PIPELINES[variant].vae == "wan2.2" else 8
        return 4, max(16, spatial * PATCH[1])
    root = Path(model)
    vae = read_json_file(root / "vae" / "config.json", required=False) or {}
    dit = (read_json_file(root / "transformer" / "config.json", required=False)
           or read_json_file(root / "transformer_2" / "config.json", required=False) or {})
    patch = dit.get("patch_size") or PATCH
    return int(vae.get("scale_factor_temporal") or 4), max(16, int(vae.get("scale_factor_spatial") or 8) * int(patch[1]))


def check_video(frames_: int | None, height: int | None, width: int | None, variant: str, model: str | None,
                names: tuple[str, str, str] = ("--frames", "--height", "--width")) -> None:
    """Frames of the 4k+1 form and sizes the pipeline can patchify without rounding them. ``names``:
    what the messages call frames, height and width (the flags; the server's API fields)."""
    temporal, multiple = video_factors(variant, model)
    if frames_ is not None and (frames_ - 1) % temporal:
        low = (frames_ - 1) // temporal * temporal + 1
        raise UsageError(f"{names[0]} {frames_}: this pipeline needs {temporal}k+1 frames; use {low} or "
                         f"{low + temporal}")
    for flag, value in zip(names[1:], (height, width)):
        if value is not None and value % multiple:
            low = value // multiple * multiple
            fix = f"{low} or {low + multiple}" if low else str(multiple)
            raise UsageError(f"{flag} {value} is not a multiple of {multiple} (VAE stride x patch size of this "
                             f"pipeline); use {fix}")


def check_video_format(video_format: str, name: str = "--video-format") -> None:
    """A video format the writer knows, and for MP4 its encoder installed (``imageio-ffmpeg``)."""
    from ..pipeline.video import VIDEO_FORMATS, mp4_encoder_missing

    if video_format not in VIDEO_FORMATS:
        raise UsageError(f"{name} {video_format!r}: not a video format; use {' or '.join(VIDEO_FORMATS)}")
    missing = mp4_encoder_missing() if video_format == "mp4" else None
    if missing:
        raise UsageError(f"{name} mp4: {missing}; or pass {name} gif")


def read_json_file(path: Path, required: bool = True) -> Any:
    if not path.is_file():
        if required:
            raise UsageError(f"{path} is missing")
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{path} is not readable JSON ({e}); re-download or re-save the checkpoint") from None


def check_counts(counts: dict[str, Any]) -> None:
    """Each count given (``{name: value}``, ``None``: not given) is a whole number >= 1."""
    for name, value in counts.items():
        if value is not None:
            try:
                positive_int(str(value))
            except UsageError as e:
                raise UsageError(f"{name} {value}: {e}") from None
