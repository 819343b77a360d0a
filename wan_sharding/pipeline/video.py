"""Write a generated video: MP4 when imageio + imageio-ffmpeg are installed, else an animated GIF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..workers import atomic_path


def write_video(frames, stem: Path, fps: int = 8) -> Path:
    """``frames``: (F, H, W, 3) floats in [0, 1]; returns the path written (``stem`` + suffix).

    Written under a temporary name and renamed when complete, so an interrupted run leaves no
    half-written video that looks complete.
    """
    import numpy as np

    if importlib.util.find_spec("imageio") and importlib.util.find_spec("imageio_ffmpeg"):
        from diffusers.utils import export_to_video

        target = stem.with_suffix(".mp4")
        with atomic_path(target, suffix=".partial.mp4") as tmp:
            export_to_video(list(frames), str(tmp), fps=fps)
        return target
    from diffusers.utils import export_to_gif
    from PIL import Image

    target = stem.with_suffix(".gif")
    images = [Image.fromarray((np.clip(f, 0, 1) * 255).round().astype(np.uint8)) for f in frames]
    with atomic_path(target, suffix=".partial.gif") as tmp:  # PIL picks the format from the suffix
        export_to_gif(images, str(tmp), fps=fps)
    return target
