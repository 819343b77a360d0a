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
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["PATCH", "RequestLimits", "UnknownAdapter", "UsageError", "check_adapters", "check_counts", "check_limits", "check_text", "check_video",
           "check_video_format", "positive_int", "read_json_file", "video_factors", "video_tokens"]


class UsageError(ValueError):
    """A bad request (a command-line option or a server API field): one line naming the problem and
    the fix. ``wan-sharding`` exits 2 with it; the server answers ``status`` (422)."""

    status = 422


class UnknownAdapter(UsageError):
    """A request names an adapter this server did not register (``serve --lora NAME=PATH``): 400."""

    status = 400


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


def video_tokens(frames_: int, height: int, width: int, factors: tuple[int, int]) -> int:
    """The DiT's flat token count for a video: latent frames ((frames - 1) / temporal factor + 1)
    times the height and width over ``factors[1]`` (the VAE's spatial factor times the patch)."""
    temporal, multiple = factors
    return ((frames_ - 1) // temporal + 1) * (height // multiple) * (width // multiple)


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


# ---- what one request may cost ------------------------------------------------------------------
# Every request is bounded before it is stored or run (docs/serving.md, "Limits"): the server's
# flags override each default. The defaults are sized from the model: Wan 2.2's own largest video
# (81 frames of 1280x720 for A14B, 121 of 1280x704 for TI2V-5B: the model cards' 5 s at 16 / 24
# fps), twice its default 40/50 steps, UMT5's 512-token prompt (the pipelines' max_sequence_length:
# past it a prompt is cut without a word); the tiny pipeline's frame area stays that of 256x256.
MAX_STEPS = 100
MAX_PROMPT_TOKENS = 512
MAX_PROMPT_BYTES = 8192  # 512 tokens of 16 bytes: longer than any prompt the encoder reads
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed
MAX_GUIDANCE = 100.0
TEXT_BODY_BYTES = 64 * 1024  # a request's JSON besides its images: prompts within their limits and the numbers


@dataclass(frozen=True)
class RequestLimits:
    """The bounds of one video request (``serve --max-*`` overrides each). ``images``: how many
    conditioning images; ``image_bytes`` / ``image_pixels``: each image's file size and pixels."""

    steps: int = MAX_STEPS
    frames: int = 81
    height: int = 1280
    width: int = 1280
    frame_pixels: int = 1280 * 720
    prompt_bytes: int = MAX_PROMPT_BYTES
    prompt_tokens: int = MAX_PROMPT_TOKENS
    images: int = 2
    image_bytes: int = 10 * 1024 * 1024
    image_pixels: int = 1 << 25
    tokens: int = 1 << 24  # the DiT's flat tokens (frames x height x width after the VAE and the patch)

    def body_bytes(self, images: int) -> int:
        """The most bytes a request body with ``images`` base64 images may take."""
        return TEXT_BODY_BYTES + images * ((self.image_bytes + 2) // 3 * 4)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_text(value: Any, name: str, limits: RequestLimits, count_tokens: Any = None) -> None:
    """A prompt the store, the responses and the encoder can all hold: real Unicode text (no lone
    surrogate, no NUL), within the byte and (with ``count_tokens(text)``) token limits."""
    if value is None:
        return
    bad = next((i for i, c in enumerate(value) if c == "\0" or "\ud800" <= c <= "\udfff"), None)
    if bad is not None:
        what = "a NUL character" if value[bad] == "\0" else "a lone UTF-16 surrogate"
        raise UsageError(f"{name}: {what} at character {bad} is not text; send UTF-8 text")
    size = len(value.encode("utf-8"))
    if size > limits.prompt_bytes:
        raise UsageError(f"{name}: {size:,} bytes is over the {limits.prompt_bytes:,}-byte prompt limit "
                         f"(--max-prompt-bytes); send a shorter prompt")
    if count_tokens is not None:
        tokens = count_tokens(value)
        if tokens > limits.prompt_tokens:
            raise UsageError(f"{name}: {tokens} tokens is over the {limits.prompt_tokens}-token prompt limit "
                             f"(--max-prompt-tokens; the encoder reads no more); send a shorter prompt")


def _shown(value: Any) -> str:
    """A value as a message shows it: at most 40 characters."""
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_limits(req: dict[str, Any], limits: RequestLimits, names: dict[str, str] | None = None,
                 count_tokens: Any = None, factors: tuple[int, int] | None = None) -> None:
    """A request (``prompt``, ``negative_prompt``, ``num_inference_steps``, ``num_frames``,
    ``height``, ``width``, ``seed``, ``guidance_scale``; ``None``: not given) within ``limits``:
    UsageError naming the field, the limit and the flag that sets it. ``names``: what the
    messages call the fields (the command line's flags); ``factors``: the pipeline's
    :func:`video_factors`, for the token limit (frames, height and width all given)."""
    names = names or {}
    name = lambda key: names.get(key, key)  # noqa: E731
    for key in ("prompt", "negative_prompt"):
        check_text(req.get(key), name(key), limits, count_tokens)
    bounds = {"num_inference_steps": (limits.steps, "--max-steps"), "num_frames": (limits.frames, "--max-frames"),
              "height": (limits.height, "--max-height"), "width": (limits.width, "--max-width")}
    for key, (most, flag) in bounds.items():
        value = req.get(key)
        if value is not None and not 1 <= value <= most:
            raise UsageError(f"{name(key)} {_shown(value)}: must be 1 to {most} for this pipeline (serve: {flag}); "
                             "send a value in that range")
    h, w = req.get("height"), req.get("width")
    if h is not None and w is not None and h * w > limits.frame_pixels:
        raise UsageError(f"{name('height')} x {name('width')} {h}x{w}: over {limits.frame_pixels:,} pixels a frame for "
                         f"this pipeline (serve: --max-frame-pixels); send a smaller size")
    f = req.get("num_frames")
    if factors is not None and None not in (f, h, w) and video_tokens(f, h, w, factors) > limits.tokens:
        raise UsageError(f"{name('num_frames')} x {name('height')} x {name('width')} {f}x{h}x{w}: "
                         f"{video_tokens(f, h, w, factors):,} tokens is over the {limits.tokens:,} one request may "
                         f"have on this server's mesh (serve: --max-tokens); send fewer frames or a smaller size")
    seed = req.get("seed")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise UsageError(f"{name('seed')} {_shown(seed)}: must be 0 to 2^63-1; send a smaller seed")
    guidance = req.get("guidance_scale")
    if guidance is not None:
        try:
            ok = math.isfinite(float(guidance)) and 0 <= float(guidance) <= MAX_GUIDANCE
        except OverflowError:
            ok = False
        if not ok:
            raise UsageError(f"{name('guidance_scale')} {_shown(guidance)}: must be a finite number 0 to "
                             f"{MAX_GUIDANCE:g}; e.g. 4.0")


def check_adapters(choices: list[dict[str, Any]], known: tuple[str, ...]) -> list[dict[str, Any]]:
    """A request's ``loras`` (``[{"name", "scale"}]``) against the adapters the server registered
    (``known``): each name one of them (:class:`UnknownAdapter`, naming them), named once, its
    scale a finite number (UsageError); ``[{"name", "scale": float}]``."""
    out: list[dict[str, Any]] = []
    for i, choice in enumerate(choices):
        name, scale = choice["name"], choice.get("scale", 1.0)
        if name not in known:
            have = (f"this server's adapters are {', '.join(known)}" if known else
                    "this server has no adapters (serve --lora NAME=PATH registers them)")
            raise UnknownAdapter(f"loras[{i}].name {_shown(name)}: no such adapter; {have}")
        if any(c["name"] == name for c in out):
            raise UsageError(f"loras[{i}].name {_shown(name)}: named twice; send each adapter once with its scale")
        try:
            ok = math.isfinite(float(scale))
        except OverflowError:
            ok = False
        if not ok:
            raise UsageError(f"loras[{i}].scale {_shown(scale)}: not a finite number; send its weight, e.g. 1.0")
        out.append({"name": name, "scale": float(scale)})
    return out
