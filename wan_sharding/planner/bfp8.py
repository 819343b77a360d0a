"""bfp8 collectives: what tt-xla's ``enable_activation_dtype_lowering`` does to the bytes and to the values.

tt-mlir's TTNN pass ``TTNNCCLActivationDtypeLowering`` (tt-mlir #8701; tt-xla's compile option
``enable_activation_dtype_lowering``, #5396) runs a ``matmul -> [reshape / slice / collective]* ->
add`` chain in bfp8 (``BFP_BFloat8``): the row-parallel projections' partial sums cross the fabric
in Tenstorrent's block floating point. ``BFP_BFloat8`` keeps one 8-bit exponent per block of 16
values (a row of a 16x16 tile face) and a sign and 7 mantissa bits per value: 1 byte a value plus
1/16 for the exponent, against 2 for bf16 (tenstorrent/tt-metal ``tt_metal/api/tt-metalium/
bfloat8.hpp``, ``pack_fp32_vec_as_bfp8_tiles``).

:func:`bfp8_round` emulates that rounding on the CPU (values scaled to the block's largest
exponent, rounded to nearest, 7 bits kept), and :func:`emulate_bfp8_collectives` applies it, on one
model instance, where the lowering does: each TP shard's partial sum of a row-parallel projection is
rounded before the sum (the all-reduce), and the reduced sum once more, before the bias and the
residual add. :data:`BYTES_FACTOR` is what the planner's fabric model charges for such a collective.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

BLOCK = 16  # values sharing one exponent
MANTISSA_BITS = 7  # magnitude bits kept per value (sign apart)
BYTES_FACTOR = (1 + 1 / BLOCK) / 2  # bfp8 bytes over bf16 bytes: 0.53

# The row-parallel projections of a Wan block (``WAN_TP_TABLE``): their outputs are the partial
# sums the all-reduces carry.
ROW_PARALLEL = ("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2")


def bfp8_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as ``BFP_BFloat8`` stores it: blocks of 16 values along the last dim (zero-padded
    to a multiple of 16) share the exponent of their largest value; each value keeps 7 bits of its
    magnitude at that scale, rounded to nearest, and its sign. Same dtype and shape as ``x``."""
    flat = x.float()
    width = flat.shape[-1]
    pad = (-width) % BLOCK
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.unflatten(-1, (-1, BLOCK))
    top = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.floor(torch.log2(torch.where(top > 0, top, torch.ones_like(top))))
    step = torch.exp2(exponent - (MANTISSA_BITS - 1))  # the largest value keeps 7 bits, hidden one included
    q = torch.clamp(torch.round(blocks / step), -(2 ** MANTISSA_BITS - 1), 2 ** MANTISSA_BITS - 1) * step
    out = torch.where(top > 0, q, torch.zeros_like(q)).flatten(-2)[..., :width]
    return out.to(x.dtype)


def _split_linear_forward(linear: torch.nn.Linear, tp: int) -> Callable[[torch.Tensor], torch.Tensor]:
    weight_parts = linear.weight.chunk(tp, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [bfp8_round(torch.nn.functional.linear(xs, w)) for xs, w in zip(x.chunk(tp, dim=-1), weight_parts)]
        out = bfp8_round(torch.stack(parts).sum(0))  # the all-reduce, in bfp8
        return out + self.bias if self.bias is not None else out

    return forward


def emulate_bfp8_collectives(dit: torch.nn.Module, tp: int) -> Callable[[], None]:
    """Give every block's row-parallel projections (:data:`ROW_PARALLEL`) a forward (an instance
    attribute) that computes the ``tp`` shards' partial sums, rounds each and their sum with
    :func:`bfp8_round`, and adds the bias after: what the all-reduce carries under
    ``enable_activation_dtype_lowering``. Returns the function that restores the model."""
    modules = dict(dit.named_modules())
    linears = [modules[f"blocks.{i}.{name}"] for i in range(len(dit.blocks)) for name in ROW_PARALLEL]
    for linear in linears:
        if linear.in_features % tp:
            raise ValueError(f"{linear.in_features} input features do not split over TP {tp}")
    for linear in linears:
        linear.forward = types.MethodType(_split_linear_forward(linear, tp), linear)

    def restore() -> None:
        for linear in linears:
            del linear.forward

    return restore
