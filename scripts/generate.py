"""End to end: a Wan 2.2 pipeline with both experts sharded on a mesh, generating a short video.

The pipeline is diffusers' own (``WanPipeline`` / ``WanImageToVideoPipeline``), called as usual;
only its experts are swapped for sharded stand-ins while ``shard_pipeline``'s handle is live.
Without ``--model`` it is the tiny random-weight pipeline built offline (the video is noise; the
point is the plumbing); with ``--model PATH`` a local diffusers Wan 2.2 checkpoint.

    .venv/bin/python scripts/generate.py                               # tiny T2V-A14B, jax, 2x4
    .venv/bin/python scripts/generate.py --backend xla --mesh 1x4 --variant ti2v-5b
    .venv/bin/python scripts/generate.py --model /ckpt/Wan2.2-T2V-A14B-Diffusers --mesh 8x4 --steps 40

On CPU the mesh is virtual devices; the device count is set in the environment below, before
JAX or torch-xla starts, which is why the heavy imports come after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.mesh import PRESET_TABLE, mesh_from_preset  # noqa: E402  (light: no JAX / torch-xla)
from wan_sharding.options import DEFAULT_PADDING, PADDING_NAMES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="2x4", choices=list(PRESET_TABLE))
    ap.add_argument("--backend", default="jax", choices=["jax", "xla", "tt"])
    ap.add_argument("--variant", default="t2v-a14b", choices=["t2v-a14b", "i2v-a14b", "ti2v-5b"])
    ap.add_argument("--model", help="local diffusers Wan 2.2 checkpoint directory (needs transformers)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--padding", default=DEFAULT_PADDING, choices=list(PADDING_NAMES))
    ap.add_argument("--prompt", default="a red fox running through fresh snow, golden hour")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "results" / "generate"))
    args = ap.parse_args(argv)

    # 1. The runtime's devices: CPU virtual devices for jax / xla (the tt backend uses the chips).
    devices = mesh_from_preset(args.mesh).num_devices
    if args.backend == "jax":
        os.environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    elif args.backend == "xla":
        os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
        os.environ.pop("XLA_FLAGS", None)

    import torch

    from wan_sharding.pipeline import diffusers_without_torch_xla, shard_pipeline, write_video

    if args.backend == "jax":
        diffusers_without_torch_xla()  # before diffusers' pipelines are imported: one XLA runtime per process
    else:
        from wan_sharding.backends.xla import enable_spmd

        enable_spmd()  # torch-xla SPMD, before the first XLA op
    from wan_sharding.pipeline.tiny import build_tiny_pipeline, call_kwargs, load_pipeline

    # 2. A pipeline: a real checkpoint, or the tiny one built offline.
    if args.model:
        pipe = load_pipeline(args.model, dtype=torch.bfloat16)
    else:
        pipe = build_tiny_pipeline(args.variant, seed=args.seed)
    kwargs = call_kwargs(pipe, prompt=args.prompt, steps=args.steps, seed=args.seed, tiny=not args.model)

    # 3. Shard every expert, run the pipeline as usual, put everything back.
    handle = shard_pipeline(pipe, args.mesh, backend=args.backend, padding=args.padding)
    print(f"sharded {', '.join(handle.components)} of {type(pipe).__name__} on {args.backend} {args.mesh}")
    start = time.perf_counter()
    try:
        frames = pipe(**kwargs, output_type="np").frames[0]
    finally:
        handle.remove()
    seconds = time.perf_counter() - start

    stem = Path(args.out) / f"example-{args.variant if not args.model else Path(args.model).name}-{args.backend}-{args.mesh}"
    video = write_video(frames, stem)
    print(f"{frames.shape[0]} frames {frames.shape[2]}x{frames.shape[1]} in {seconds:.1f} s -> {video}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
