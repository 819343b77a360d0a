"""The text encoder's PCC check: the sharded UMT5 encoder against the unsharded one, in the check
job's own worker (``python -m wan_sharding.jobs.check``; its cases are written ``text-encoder:...``).

:func:`run_case` is the worker side of one case; ``wan_sharding.jobs.check`` starts the worker and
grades every result by the suite's one rule (:func:`~wan_sharding.jobs.pcc.grade`). A case is a
dtype and a batch of prompts given as their valid token counts over the tiny prompt length (16):
the rest of each row is padding ids with a zero attention mask, as the Wan pipelines' tokenizer
call makes them (``padding="max_length"``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import PROMPT_TOKENS
from .pcc import compare, save_pair

ENCODER_CASE_PREFIX = "text-encoder:"  # how an encoder's case is written among the check worker's cases


@dataclass(frozen=True)
class EncoderCase:
    """One check of the encoder: ``dtype``; ``valid``: each prompt's token count, ``"+"``-joined
    (``"11"``: one prompt of 11 tokens and 5 padding; ``"11+16"``: a batch of two, one unpadded)."""

    dtype: str = "fp32"
    valid: str = "11"

    def rows(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.valid.split("+"))

    @property
    def padded(self) -> bool:
        return any(n < PROMPT_TOKENS["tiny"] for n in self.rows())

    @classmethod
    def parse(cls, text: str) -> "EncoderCase":
        return cls(*text.removeprefix(ENCODER_CASE_PREFIX).split(":"))

    def __str__(self) -> str:
        return f"{ENCODER_CASE_PREFIX}{self.dtype}:{self.valid}"


# What ``check --component text-encoder`` runs per dtype: a prompt with padding tokens in its mask,
# one without, and a batch of both (the pipelines encode a list of prompts as one batch).
ROWS = ("11", "16", "11+16")


def cases_for(dtype: str) -> list[EncoderCase]:
    return [EncoderCase(dtype, rows) for rows in ROWS]


def run_case(backend_name: str, mesh_name: str, case: EncoderCase, save: Path | None = None,
             plan: Any = None) -> dict[str, Any]:
    """Build the tiny UMT5 encoder, run it unsharded and sharded (on ``plan``, else the preset
    ``mesh_name``) on this process's devices, compare. Worker side: the check job's worker calls it."""
    import torch

    from ..models import build_text_encoder, text_encoder_inputs
    from ..options import torch_dtype
    from ..text_encoder import shard_text_encoder

    encoder = build_text_encoder("tiny", dtype=torch_dtype(case.dtype))
    ids, mask = text_encoder_inputs("tiny", valid=case.rows())
    with torch.no_grad():
        reference = encoder(ids, mask).last_hidden_state
    start = time.perf_counter()
    sharded = copy.deepcopy(encoder)  # the device move acts on the copy: the reference stays as it was
    handle = shard_text_encoder(sharded, plan if plan is not None else mesh_name, backend_name)
    backend = handle.backend
    try:
        with torch.no_grad():
            program = backend.compile(sharded, handle.placed, ids, mask)  # the collectives of what ran
            out = backend.to_host(program())
            collectives = backend.collective_counts(program)
            again = handle(ids, mask).last_hidden_state  # the handle, as the pipeline calls it
        seconds = time.perf_counter() - start
        specs = handle.specs
    finally:
        handle.remove()
    value, max_abs = compare(reference, out)
    result = {
        "component": "text-encoder", "backend": backend_name, "mesh": mesh_name,
        "plan": None if plan is None else plan.name, "case": str(case), "dtype": case.dtype, "valid": list(case.rows()),
        "tokens": PROMPT_TOKENS["tiny"], "shape": list(out.shape), "pcc": value, "max_abs": max_abs,
        "handle_matches_program": bool(torch.equal(again, out)), "seconds": round(seconds, 2),
        "params": specs.counts(), "collectives": collectives,
        "restored": sharded.encoder.embed_tokens.weight is sharded.shared.weight
        and all(p.device.type == "cpu" for p in sharded.parameters()),
    }
    if save is not None:
        result["saved"] = save_pair(save, f"text-encoder-{backend_name}-{mesh_name}-{case.dtype}-{case.valid}",
                                    reference, out)
    return result
