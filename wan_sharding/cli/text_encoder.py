"""The text encoder's part of ``check`` and ``compile`` (``--component text-encoder``,
``check --text-encoder mesh``): its options' checks and its rows. The commands themselves stay in
:mod:`.check` and :mod:`.compile`, with a small branch each."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..jobs.text_encoder import EncoderCase, cases_for
from .validate import UsageError, read_json_file

COMPONENT = "text-encoder"
# check's and compile's DiT-only options, by their flag: none of them means anything to the encoder
DIT_CHECK_OPTIONS = {"--variant": "variant", "--lengths": "lengths", "--padding": "padding", "--patches": "patches"}
DIT_COMPILE_OPTIONS = {"--variant": "variant", "--resolution": "resolution", "--latent": "latent",
                       "--padding": "padding", "--patches": "patches", "--plan": "plan", "--no-anchor": "no_anchor"}


def _refuse_dit_options(args: argparse.Namespace, options: dict[str, str], what: str) -> None:
    given = [flag for flag, attr in options.items() if getattr(args, attr, None) not in (None, [], False)]
    if given:
        raise UsageError(f"{', '.join(given)} {'is a' if len(given) == 1 else 'are'} DiT option{'s' * (len(given) > 1)}; "
                         f"{what}: leave {'it' if len(given) == 1 else 'them'} out with --component text-encoder")


def encoder_only(args: argparse.Namespace) -> bool:
    return getattr(args, "component", "dit") == COMPONENT


def validate_check(args: argparse.Namespace) -> None:
    """``check --component text-encoder``: refuse the DiT-only options (nothing is ignored quietly)."""
    if encoder_only(args):
        _refuse_dit_options(args, DIT_CHECK_OPTIONS, "the text encoder's check has its own cases (prompts with and "
                                                     "without padding tokens, and a batch of both)")


def validate_compile(args: argparse.Namespace) -> None:
    """``compile --component text-encoder``: refuse the DiT-only options; without it, ``--tokens``
    (the encoder's). Fills the DiT's defaults that were left out."""
    if encoder_only(args):
        _refuse_dit_options(args, DIT_COMPILE_OPTIONS, "the text encoder compiles its prompt (--tokens) on the "
                                                       "mesh's TP axis, with no latent, padding, plan or patch")
        if args.cfg != 1:
            raise UsageError("--cfg 2 splits the DiT's guidance branches; the text encoder encodes each prompt on the "
                             "whole mesh: leave --cfg out with --component text-encoder")
        args.mesh = args.mesh or "8x4"
        return
    for flag, value in (("--tokens", args.tokens), ("--vocab", args.vocab)):
        if value is not None:
            raise UsageError(f"{flag} is the text encoder's (its prompt length, its vocabulary); use it with --component "
                             "text-encoder")
    args.variant = args.variant or "t2v-a14b"
    if args.latent is None:
        args.resolution = args.resolution or "480p"


def compile_report(args: argparse.Namespace, out: Path | None) -> dict[str, Any]:
    """``compile --component text-encoder``: the encoder's request next to a 1-layer twin, and its
    report (the per-layer bill against one all-reduce per attention and per FFN)."""
    from ..compile import CompileRequest, compile_reports

    req = CompileRequest(
        component=COMPONENT, mesh=args.mesh, size=args.size, blocks=args.blocks, prompt_tokens=args.tokens, vocab=args.vocab,
        dtype=args.dtype, batch=args.batch, frontend=args.frontend,
        composites="none" if args.no_fused_sdpa else args.composites, compile_options=args.compile_options,
        mark_arguments=not args.no_argument_marks,
        out_dir=str(out / f"layers_{args.blocks or 'all'}") if out else None).validate()
    return compile_reports([req], args.arch, timeout=args.timeout, work_dir=out, verbose=args.verbose,
                           rank_binding=args.rank_binding)[0]


def check_cases(args: argparse.Namespace) -> list[EncoderCase]:
    """The encoder's cases for a ``check`` run: with ``--component text-encoder`` or
    ``--text-encoder mesh``, its rows at ``--dtype``; else none."""
    if encoder_only(args) or getattr(args, "text_encoder", "host") == "mesh":
        return cases_for(args.dtype)
    return []


def validate_pipeline(args: argparse.Namespace) -> None:
    """``generate`` / ``serve --text-encoder mesh``: the pipeline must have a text encoder to shard (a
    checkpoint saved without one is refused here, before any worker starts)."""
    if args.text_encoder != "mesh" or args.model is None:
        return  # the tiny pipeline holds one
    index = read_json_file(Path(args.model) / "model_index.json")  # a JSON object: model_dir checked it
    entry = index.get("text_encoder")
    if not isinstance(entry, list) or not entry or entry[0] is None:
        raise UsageError(f"--text-encoder mesh: {args.model} has no text encoder (its model_index.json names none); "
                         "load a checkpoint with its UMT5 text encoder, or leave --text-encoder at host")


def specs(size: str, mesh: Any) -> Any:
    """``specs --component text-encoder``: every parameter's spec of the UMT5 encoder of ``size``
    (on the meta device: no memory)."""
    from ..models import build_text_encoder
    from ..text_encoder import shard_text_encoder_specs

    return shard_text_encoder_specs(build_text_encoder(size, device="meta"), mesh)


def print_row(r: dict[str, Any], header: bool) -> None:
    """One text encoder row of ``check``."""
    if header:
        print(f"{'component':12} {'backend':7} {'mesh':9} {'dtype':5} {'prompt tokens':>13} "
              f"{'PCC':>12} {'max|diff|':>9}  params col/row/emb/rep  collectives")
    p = r["params"]
    prompts = "+".join(f"{n}/{r['tokens']}" for n in r["valid"])
    coll = ", ".join(f"{k} {v}" for k, v in (r.get("collectives") or {}).items()) or "-"
    print(f"{'text-encoder':12} {r['backend']:7} {r['mesh']:9} {r['dtype']:5} {prompts:>13} "
          f"{r['pcc']:12.9f} {r['max_abs']:9.2e}  {p['colwise']}/{p['rowwise']}/{p.get('embedding_colwise', 0)}/"
          f"{p['replicate']:<16} {coll}{'' if r['ok'] else '  <-- FAIL'}", flush=True)
