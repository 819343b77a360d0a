"""How a sharded result is compared with the unsharded one, and what counts as a match."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Sharded vs unsharded on CPU, one DiT forward or a whole denoising loop's final latents: sharding
# and exact padding change only the order of floating-point reductions. (Measured: fp32 PCC
# 0.99999999999 or closer, max |difference| 1e-6 for a forward, ~3e-6 after a tiny loop.)
PCC_THRESHOLDS: dict[str, float] = {"fp32": 0.99999, "bf16": 0.99}
# fp32 also bounds the largest element-wise |difference|: a padded key leaking into attention
# shows as ~1e-3 while PCC stays near 1. bf16 rounds at ~4e-3 of a value, so it is graded by PCC.
MAX_ABS_BOUNDS: dict[str, float] = {"fp32": 1e-4}

# On Tenstorrent chips (``tt``) against the CPU reference: the device computes in its own
# arithmetic (bf16 tiles, fp32 accumulation where it is kept, approximate exp/rsqrt), so the
# CPU-vs-CPU grades above do not apply. Tenstorrent's own figures (tt-xla, main 2026-08-21):
# 0.99 is its default for a model against the CPU (``tests/infra/evaluators/evaluation_config.py``,
# ``PccConfig.required_pcc``), asked of the Wan 2.2 TI2V-5B DiT (``tests/torch/models/wan2_2/
# test_wan_dit.py``); 0.97 is what its full-size Wan 2.2 I2V-A14B DiT test asks at 480p, bf16,
# sharded (``tests/torch/models/wan14b/test_wan_dit.py``). The tiny models of this package's tests
# use the default; the full-size figure is in the table for a run of the full model.
HARDWARE_PCC_THRESHOLDS: dict[str, float] = {"fp32": 0.99, "bf16": 0.99}
HARDWARE_FULL_SIZE_PCC: float = 0.97
# A whole loop on the chips: Tenstorrent publishes no figure; its full-size DiT grade is the floor.
HARDWARE_PIPELINE_PCC_THRESHOLDS: dict[str, float] = {"fp32": 0.97, "bf16": 0.97}


def pcc_thresholds(backend: str, pipeline: bool = False) -> dict[str, float]:
    """The PCC a ``backend``'s output must reach against the unsharded CPU reference, by dtype:
    the hardware table for ``tt`` (a whole loop's, with ``pipeline``), the CPU-vs-CPU one otherwise
    (a forward and a loop alike)."""
    if backend == "tt":
        return HARDWARE_PIPELINE_PCC_THRESHOLDS if pipeline else HARDWARE_PCC_THRESHOLDS
    return PCC_THRESHOLDS


@dataclass(frozen=True)
class Grade:
    """What counts as a match for one backend and dtype: a PCC floor and, where one applies, a bound
    on the largest element-wise |difference| (fp32 on CPU)."""

    pcc: float
    max_abs: float | None = None

    def passes(self, pcc_value: float, max_abs: float) -> bool:
        return pcc_value >= self.pcc and (self.max_abs is None or max_abs <= self.max_abs)

    def __str__(self) -> str:
        return f"PCC >= {self.pcc}" + ("" if self.max_abs is None else f", max|diff| <= {self.max_abs:.0e}")


def grade(backend: str, dtype: str, pipeline: bool = False) -> Grade:
    """The grade a ``backend``'s ``dtype`` output is held to against the unsharded CPU reference:
    on CPU the PCC table plus the fp32 max-abs bound, on ``tt`` the hardware PCC table alone (the
    chips' own arithmetic moves single elements further than reordering does)."""
    bound = None if backend == "tt" else MAX_ABS_BOUNDS.get(dtype)
    return Grade(pcc_thresholds(backend, pipeline)[dtype], bound)


def pcc(a: Any, b: Any) -> float:
    """Pearson correlation of two tensors or arrays, flattened, in float64."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(np.corrcoef(a, b)[0, 1])


def compare(reference: Any, other: Any) -> tuple[float, float]:
    """(PCC, largest element-wise |difference|) of two torch tensors, in float64."""
    ref64, out64 = reference.double(), other.double()
    return pcc(ref64, out64), float((ref64 - out64).abs().max())


def save_pair(directory: Any, name: str, reference: Any, sharded: Any) -> str:
    """Write a case's unsharded and sharded outputs (``{"reference", "sharded"}``) as
    ``directory/name.pt`` for a caller's own comparison; returns the path."""
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.pt"
    torch.save({"reference": reference, "sharded": sharded}, path)
    return str(path)
