"""The text encoder's jobs: its PCC check cases, and the encoder stage timed on the host and on a mesh.

- The check: the sharded UMT5 encoder against the unsharded one, in the check job's own worker
  (``python -m wan_sharding.jobs.check``; its cases are written ``text-encoder:...``). :func:`run_case`
  is the worker side of one case; ``wan_sharding.jobs.check`` starts the worker and grades every
  result by the suite's one rule (:func:`~wan_sharding.jobs.pcc.grade`). A case is a dtype and a
  batch of prompts given as their valid token counts over the tiny prompt length (16): the rest of
  each row is padding ids with a zero attention mask, as the Wan pipelines' tokenizer call makes them
  (``padding="max_length"``).
- The stage timing (:func:`stage_timing_in_subprocess`, ``python -m wan_sharding.jobs.text_encoder``):
  a prompt pair (prompt and negative prompt, one call each, as the pipelines encode them) through the
  tiny encoder unsharded on the host and sharded on a CPU mesh, warm medians. CPU virtual devices:
  it compares the two on this host and predicts nothing about hardware.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import PROMPT_TOKENS
from ..runtime.workers import WorkerError, run_worker, worker_main
from .launch import prepare_worker, stall_seconds, worker_env
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


# ------------------------------------------------------------------------------ the stage, timed


def stage_timing_in_subprocess(backend: str, mesh: str, tokens: tuple[int, ...] = (16, 512), repeats: int = 5,
                               warmup: int = 2, timeout: float = 1200) -> list[dict[str, Any]]:
    """The encoder stage (a prompt pair) of the tiny encoder, host vs ``mesh`` on ``backend``, per
    prompt length in ``tokens``: one result each (medians of ``repeats`` warm pairs, seconds)."""
    from ..mesh import mesh_from_preset

    params = {"backend": backend, "mesh": mesh, "tokens": list(tokens), "repeats": repeats, "warmup": warmup}
    run = run_worker("wan_sharding.jobs.text_encoder", params, worker_env(backend, mesh_from_preset(mesh).num_devices),
                     label=f"{backend} text encoder timing on {mesh}", timeout=timeout, stall_s=stall_seconds(backend))
    if not run.ok:
        raise WorkerError(f"{backend} text encoder timing on {mesh} failed (exit {run.returncode}):\n{run.output[-4000:]}")
    return run.results


def _seconds(call: Any) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def _timing(params: dict[str, Any]):
    """The worker side of :func:`stage_timing_in_subprocess`."""
    import statistics

    import torch

    from ..models import build_text_encoder, text_encoder_inputs
    from ..text_encoder import shard_text_encoder

    prepare_worker(params["backend"])
    torch.set_grad_enabled(False)
    encoder = build_text_encoder("tiny")
    sharded = copy.deepcopy(encoder)
    handle = shard_text_encoder(sharded, params["mesh"], params["backend"])
    try:
        for tokens in params["tokens"]:
            # the pair as the pipelines encode it: the prompt (a few words), then the empty negative prompt
            pair = [text_encoder_inputs("tiny", tokens, valid=(min(11, tokens),)), text_encoder_inputs("tiny", tokens, valid=(1,))]
            host = lambda: [encoder(ids, mask).last_hidden_state for ids, mask in pair]  # noqa: E731
            mesh = lambda: [handle(ids, mask).last_hidden_state for ids, mask in pair]  # noqa: E731
            first_mesh, first_host = _seconds(mesh), _seconds(host)  # the mesh's first call compiles
            for _ in range(params["warmup"] - 1):
                host(), mesh()
            # interleaved, so a busy host (or a runtime's threads still spinning) slows both alike
            host_s, mesh_s = zip(*[(_seconds(host), _seconds(mesh)) for _ in range(params["repeats"])])
            value, max_abs = compare(torch.cat(host()), torch.cat(mesh()))
            yield {"backend": params["backend"], "mesh": params["mesh"], "tokens": tokens, "size": "tiny",
                   "pair_host_s": statistics.median(host_s), "pair_mesh_s": statistics.median(mesh_s),
                   "mesh_over_host": statistics.median(mesh_s) / statistics.median(host_s),
                   "first_pair_mesh_s": first_mesh, "first_pair_host_s": first_host,
                   "host_s": list(host_s), "mesh_s": list(mesh_s), "pcc": value, "max_abs": max_abs,
                   "params": handle.specs.counts()}
    finally:
        handle.remove()


if __name__ == "__main__":
    import sys

    from ..backends import BackendError

    sys.exit(worker_main(_timing, expected=(BackendError,)))
