"""How a sharded result is compared with the unsharded one, and what counts as a match."""

from __future__ import annotations

from typing import Any

# One DiT forward, sharded vs unsharded: sharding and exact padding change only the order of
# floating-point reductions.
PCC_THRESHOLDS: dict[str, float] = {"fp32": 0.99999, "bf16": 0.99}
# Final latents of a whole denoising loop: the reordering compounds over steps, a little looser.
PIPELINE_PCC_THRESHOLDS: dict[str, float] = {"fp32": 0.9999, "bf16": 0.99}


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
