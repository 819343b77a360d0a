"""The rules of an image-conditioned (I2V) request, shared by ``serve``'s API and ``submit``.

Which Wan 2.2 pipelines take an image, and at which frame (diffusers 0.42.1,
``diffusers/pipelines/wan/pipeline_wan_i2v.py``):

- I2V-A14B (``WanImageToVideoPipeline``): needs ``image``, the first frame; also takes
  ``last_image``, which it puts at the last frame (``num_frames - 1``). No other frame.
- TI2V-5B (``expand_timesteps=True``): the same class replaces the first latent frame by the
  image's and reads only ``image``; a ``last_image`` would be ignored without a word, so it is
  refused here. Without an image it is a text-to-video pipeline.
- T2V-A14B: takes no image.

tt-media-server's ``image_prompts`` entries (``{"image": <base64>, "frame_pos": N}``) map onto these:
frame 0 is ``image``, frame ``num_frames - 1`` is ``last_image``; any other ``frame_pos`` is refused,
naming the frames this pipeline takes. Each image is checked before anything is queued: at most
:data:`MAX_IMAGE_BYTES` (tt-media-server's upload cap, 10 MiB) and :data:`MAX_IMAGE_PIXELS`, and it
must decode as a whole image. Every check raises :class:`UsageError` with one line naming the field
and the fix (:class:`ImageTooLarge` for the size limit: the upload route answers it with 413).
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .requests import RequestLimits, UsageError, read_json_file, video_factors, video_tokens

MAX_IMAGE_BYTES = 10 * 1024 * 1024
MAX_IMAGE_PIXELS = 1 << 25  # 32 Mi pixels (e.g. 8192x4096): bounds the decoded size (~100 MB RGB)
IMAGE_CONTENT_TYPES = ("image/png", "image/jpeg", "image/webp")  # what the upload route accepts, as tt-media-server
I2V_VARIANTS = ("i2v-a14b", "ti2v-5b")


class ImageTooLarge(UsageError):
    """An image over :data:`MAX_IMAGE_BYTES` (or its base64 text over what that many bytes take)."""


@dataclass(frozen=True)
class Conditioning:
    """What a pipeline does with images: ``takes_image`` (any), ``needs_image`` (it cannot run
    without one), ``last_image`` (it also conditions on the last frame). ``variant`` names it in
    messages."""

    variant: str
    takes_image: bool
    needs_image: bool
    last_image: bool

    def check_text_only(self) -> None:
        """A request without images (``POST /v1/videos/generations``) on this pipeline."""
        if self.needs_image:
            raise UsageError(f"this server runs {self.variant}, which needs an image: POST /v1/videos/generations/i2v "
                             'with image_prompts [{"image": <base64>, "frame_pos": 0}], or '
                             "/v1/videos/generations/i2v/upload (submit --image PATH)")

    def image_arguments(self, positions: list[int], num_frames: int, field: str = "frame_pos") -> list[str]:
        """The pipeline argument (``"image"``, ``"last_image"``) of each image, by its frame.

        Raises:
            UsageError: this pipeline takes no image, a frame it cannot condition on, a frame
                given twice, or a last frame without a first one.
        """
        if not self.takes_image:
            raise UsageError(f"this server runs {self.variant}, which takes no image; POST /v1/videos/generations "
                             f"(text to video), or start the server with --variant {' or '.join(I2V_VARIANTS)}")
        last = num_frames - 1
        allowed = {0: "image"} | ({last: "last_image"} if self.last_image and last > 0 else {})
        names = []
        for pos in positions:
            if pos not in allowed:
                frames = "frame 0 (the first)" + (f" and frame {last} (the last, num_frames - 1)" if len(allowed) > 1
                                                   else "")
                raise UsageError(f"{field} {pos}: {self.variant} conditions only on {frames} of this "
                                 f"{num_frames}-frame video; use {' or '.join(str(p) for p in allowed)}")
            if allowed[pos] in names:
                raise UsageError(f"{field} {pos} is given twice; give each image its own frame")
            names.append(allowed[pos])
        if "last_image" in names and "image" not in names:
            raise UsageError(f"{field} {last}: {self.variant} takes a last frame only with a first one; add an "
                             "image at frame_pos 0")
        if not names:
            raise UsageError("image_prompts is empty; give at least one image (frame_pos 0)")
        return names


def conditioning(variant: str, model: str | None) -> Conditioning:
    """The :class:`Conditioning` of the tiny pipeline of ``variant``, or of the checkpoint at
    ``model`` (read from its ``model_index.json``: the pipeline class and ``expand_timesteps``,
    without loading it)."""
    if model is None:
        from ..pipeline.tiny import VARIANT_PIPELINES

        vp = VARIANT_PIPELINES[variant]
        cls, expand = vp.pipeline, vp.expand_timesteps
    else:
        index = read_json_file(Path(model) / "model_index.json")
        index = index if isinstance(index, dict) else {}
        cls, expand = str(index.get("_class_name", "")), bool(index.get("expand_timesteps"))
    i2v = "ImageToVideo" in cls
    name = "ti2v-5b" if expand else ("i2v-a14b" if i2v else "t2v-a14b")
    return Conditioning(name, takes_image=i2v or expand, needs_image=i2v, last_image=i2v and not expand)


# What an image's first bytes are for each format the API takes (the PNG signature, JPEG's SOI
# marker, WebP's RIFF container); PIL is told these formats only, so no other decoder (nor
# Ghostscript, which PIL runs for EPS) is ever reached, whatever the client labels the file.
IMAGE_FORMATS = {"PNG": (b"\x89PNG\r\n\x1a\n",), "JPEG": (b"\xff\xd8\xff",), "WEBP": (b"RIFF",)}


def image_format(data: bytes) -> str | None:
    """``"PNG"``, ``"JPEG"`` or ``"WEBP"`` by the file's first bytes (its content, not a label); None otherwise."""
    for name, magics in IMAGE_FORMATS.items():
        if any(data.startswith(m) for m in magics) and (name != "WEBP" or data[8:12] == b"WEBP"):
            return name
    return None


def default_limits(variant: str, model: str | None, tokens: int | None = None) -> RequestLimits:
    """The limits of a pipeline: ``variant``'s tiny one, or the checkpoint at ``model`` (its
    ``model_index.json`` says which Wan 2.2 variant it is). With ``tokens`` (the most flat DiT
    tokens one request may have on the serve mesh: :func:`wan_sharding.planner.serving.max_request_tokens`)
    each of frames, height, width and frame pixels is also at most what fits with the others at
    their least (one latent frame, one patch of height or width), and their product, in tokens, at
    most ``tokens``."""
    rules = conditioning(variant, model)
    images = (1 + rules.last_image) if rules.takes_image else 0
    frames = 121 if rules.variant == "ti2v-5b" else 81
    base = (RequestLimits(frames=frames, height=256, width=256, frame_pixels=256 * 256, images=images) if model is None
            else RequestLimits(frames=frames, images=images))
    if tokens is None:
        return base
    temporal, multiple = video_factors(variant, model)
    tokens = min(tokens, video_tokens(base.frames, base.frame_pixels // multiple, multiple, (temporal, multiple)))
    if tokens < 1:  # not even one token fits: left to the token limit, which then refuses every request
        return replace(base, tokens=0)
    return replace(base, frames=min(base.frames, temporal * (tokens - 1) + 1), height=min(base.height, tokens * multiple),
                   width=min(base.width, tokens * multiple),
                   frame_pixels=min(base.frame_pixels, tokens * multiple * multiple), tokens=tokens)


def image_from_base64(text: str, field: str, max_bytes: int = MAX_IMAGE_BYTES,
                      max_pixels: int = MAX_IMAGE_PIXELS) -> bytes:
    """The bytes of a base64-encoded image, checked (:func:`check_image`)."""
    if len(text) > (max_bytes + 2) // 3 * 4:
        raise ImageTooLarge(f"{field}: {len(text):,} base64 characters is over the {max_bytes:,}-byte image "
                            "limit; send a smaller image (the video's size is enough)")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise UsageError(f"{field}: not base64; send the image file's bytes base64-encoded") from None
    check_image(data, field, max_bytes, max_pixels)
    return data


def check_image(data: bytes, field: str, max_bytes: int = MAX_IMAGE_BYTES,
                max_pixels: int = MAX_IMAGE_PIXELS) -> tuple[int, int]:
    """``(width, height)`` of a PNG, JPEG or WebP file's bytes that decode as a whole image within
    the limits. The format is read from the first bytes and the size from the header, both before
    anything is decoded (PIL's ``open`` reads only the header; ``load`` decodes).

    Raises:
        ImageTooLarge: over ``max_bytes``.
        UsageError: not PNG, JPEG or WebP by its content, more than ``max_pixels``, or it does not decode.
    """
    if len(data) > max_bytes:
        raise ImageTooLarge(f"{field}: {len(data):,} bytes is over the {max_bytes:,}-byte image limit; send a "
                            "smaller image (the video's size is enough)")
    fmt = image_format(data)
    if fmt is None:
        raise UsageError(f"{field}: not a PNG, JPEG or WebP file (by its first bytes); send one of those")
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=[fmt]) as im:
            w, h = im.size
            if w * h > max_pixels:
                raise UsageError(f"{field}: {w}x{h} is over {max_pixels:,} pixels; send a smaller image (the "
                                 "video's size is enough)")
            im.load()  # the whole image: a truncated file fails here, not in the worker
    except UsageError:
        raise
    except Image.DecompressionBombError:  # PIL's own bound (far above ours) refused it while opening
        raise UsageError(f"{field}: the image is over {max_pixels:,} pixels; send a smaller image (the video's size is "
                         "enough)") from None
    except Exception as e:  # PIL's errors for a broken image have no common base; only its kind is shown
        raise UsageError(f"{field}: does not decode as a {fmt} image ({type(e).__name__}); send a whole PNG, JPEG "
                         "or WebP file") from None
    if w < 1 or h < 1:
        raise UsageError(f"{field}: the image is {w}x{h}; send one of at least 1x1 pixels")
    return w, h


def open_image(data: bytes) -> Any:
    """The RGB PIL image of checked image bytes (what the pipeline gets)."""
    from PIL import Image

    with Image.open(io.BytesIO(data), formats=[image_format(data) or "PNG"]) as im:
        return im.convert("RGB")
