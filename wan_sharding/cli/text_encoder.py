"""The text encoder's part of ``check`` and ``compile`` (``--component text-encoder``,
``check --text-encoder mesh``): its options' checks and its rows. The commands themselves stay in
:mod:`.check` and :mod:`.compile`, with a small branch each."""

from __future__ import annotations

import argparse
from typing import Any

from ..jobs.text_encoder import EncoderCase, cases_for
from .validate import UsageError

COMPONENT = "text-encoder"
# check's DiT-only options, by their flag: none of them means anything to the encoder
DIT_CHECK_OPTIONS = {"--variant": "variant", "--lengths": "lengths", "--padding": "padding", "--patches": "patches"}


def encoder_only(args: argparse.Namespace) -> bool:
    return getattr(args, "component", "dit") == COMPONENT


def validate_check(args: argparse.Namespace) -> None:
    """``check --component text-encoder``: refuse the DiT-only options (nothing is ignored quietly)."""
    if not encoder_only(args):
        return
    given = [flag for flag, attr in DIT_CHECK_OPTIONS.items() if getattr(args, attr) not in (None, [])]
    if given:
        raise UsageError(f"{', '.join(given)} {'is a' if len(given) == 1 else 'are'} DiT option{'s' * (len(given) > 1)}; "
                         "the text encoder's check has its own cases (prompts with and without padding tokens, and a "
                         "batch of both): leave them out with --component text-encoder, or check the DiT")


def check_cases(args: argparse.Namespace) -> list[EncoderCase]:
    """The encoder's cases for a ``check`` run: with ``--component text-encoder`` or
    ``--text-encoder mesh``, its rows at ``--dtype``; else none."""
    if encoder_only(args) or getattr(args, "text_encoder", "host") == "mesh":
        return cases_for(args.dtype)
    return []


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
