"""The package's vocabulary: the names every command, request and report uses for the same choice.

One place, so a command line, a ``CompileRequest`` and a JSON report cannot drift apart
(``fp32`` in one, ``f32`` in another). Imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

# ---- dtypes ----------------------------------------------------------------------------------
# The two compute dtypes a Wan run uses, by their short names.
DTYPES: tuple[str, ...] = ("fp32", "bf16")
# Spellings accepted on input (older commands said ``f32``); every output uses the short name.
DTYPE_ALIASES: dict[str, str] = {"fp32": "fp32", "f32": "fp32", "float32": "fp32",
                                 "bf16": "bf16", "bfloat16": "bf16"}


def dtype_name(value: Any) -> str:
    """``"fp32"`` or ``"bf16"`` for a name, an alias or a ``torch.dtype``; ValueError otherwise."""
    text = str(value).removeprefix("torch.")
    if text not in DTYPE_ALIASES:
        raise ValueError(f"unknown dtype {value!r}; choose one of {', '.join(DTYPES)}")
    return DTYPE_ALIASES[text]


def torch_dtype(value: Any):
    """The ``torch.dtype`` for a dtype name or alias."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name(value)]


# ---- pipeline components ---------------------------------------------------------------------
# The parts of a Wan 2.2 pipeline this package can put on the mesh, by the names ``--component``
# (``check``, ``compile``) and reports use: the denoising DiT (every expert), the VAE
# (``AutoencoderKLWan``) and the UMT5 text encoder.
COMPONENTS: tuple[str, ...] = ("dit", "vae", "text-encoder")
DEFAULT_COMPONENT = "dit"


# Where the VAE runs (``--vae``). By default ``mesh`` on ``tt``, where a sharded decode turns minutes
# of host decode after denoising into seconds; ``host`` on the CPU backends, where a host decode is
# the reference itself and the mesh's virtual devices share the same cores (a sharded decode would
# only add its halo work and collectives to the same CPU time).
VAE_PLACEMENTS: tuple[str, ...] = ("mesh", "host")


def vae_placement(value: str | None, backend: str) -> str:
    """``--vae`` as given, else the backend's default (above)."""
    return value if value is not None else ("mesh" if backend == "tt" else "host")


# ---- padding ---------------------------------------------------------------------------------
# How the flat token dim is padded to SP x 32 and attention kept exact
# (``wan_sharding.dit.attention`` implements each; ``docs/design.md`` says what each costs).
PADDING_NAMES: tuple[str, ...] = ("mask", "slice", "none")
# The key mask keeps attention exact with no op per block; K/V slice-back adds two slices to every
# block (measured: docs/compile-only.md, "Padding: why `mask` is the default").
DEFAULT_PADDING = "mask"


def padding_name(value: Any) -> str:
    """A known padding mode name, unchanged; ValueError naming the choices otherwise."""
    if value not in PADDING_NAMES:
        raise ValueError(f"unknown padding mode {value!r}; choose one of {', '.join(PADDING_NAMES)}")
    return value


# ---- executing backends ----------------------------------------------------------------------
# Backends that run a forward on CPU virtual devices here (the commands' defaults).
CPU_BACKENDS: tuple[str, ...] = ("xla", "jax")
# Every backend a command can run a forward on: the CPU ones, and ``tt`` on Tenstorrent devices
# (with Tenstorrent's stack; without it the command says what is missing and exits 1).
EXECUTING_BACKENDS: tuple[str, ...] = (*CPU_BACKENDS, "tt")


# ---- what ran ----------------------------------------------------------------------------------


def settings_line(backend: str, patches: Any = (), cache: str | None = "none", cfg: int = 1,
                  places: dict[str, str] | None = None) -> str:
    """The line ``check``, ``compile``, ``generate`` and ``profile`` print before their results: the
    backend, and the options that change the model or the loop, each named even when off
    (``patches: none``), so an output says what produced it; ``places``: where the pipeline's other
    components run (``{"text encoder": "host", "vae": "mesh"}``), for the commands that run them."""
    line = (f"backend: {backend}; patches: {', '.join(patches) or 'none'}; cache: {cache or 'none'}; "
            f"cfg: {cfg}{' (cond and uncond as one program, one per half of the mesh)' if cfg == 2 else ''}")
    return line + "".join(f"; {name}: {where}" for name, where in (places or {}).items())
