"""Compile the sharded Wan DiT through the real tt-mlir compiler, without Tenstorrent hardware.

The pieces, caller to worker and back:

- :mod:`.request`: :class:`CompileRequest` (what to compile), :class:`CompileResult`, :func:`latent_for`;
- :mod:`.runner`: :func:`compile_many` / :func:`compile_dit` (descriptor, environment, worker
  processes through :func:`wan_sharding.runtime.workers.run_worker`);
- :mod:`.worker` and :mod:`.lowering`: the worker process and the compile it runs;
- :mod:`.sysdesc`: the system descriptors tt-mlir compiles against;
- :mod:`.ttnn_ir`: the one parser of the TTNN text tt-mlir exports;
- :mod:`.bill`: that text read against the design (per-block bill, tile alignment, padding cost);
- :mod:`.report`: the reports ``wan-sharding compile`` prints, as data (:func:`compile_reports`), and
  :mod:`.report_text` as text (:func:`format_report`);
- :mod:`.xla_lowering` + :mod:`.shardy`: the torch-xla frontend (the lowering hardware compiles) and
  its GSPMD -> Shardy converter;
- :mod:`.composites`: the StableHLO composites tt-xla's torch plugin marks (``--composites``);
- :mod:`.marking`: every argument marked parameter / constant / input, as tt-xla marks them
  (``--no-argument-marks`` turns it off);
- :mod:`.options`: tt-mlir compile options as tt-xla's plugin reads them (``--compile-options``).
"""

from .bill import BlockBill, bill_ok, per_block_bill
from .report import EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_OK, compile_reports, keep_cited, report_exit_code
from .report_text import format_report
from .request import FRONTENDS, CompileError, CompileRequest, CompileResult, latent_for
from .runner import compile_dit, compile_many
from .shardy import gspmd_to_shardy
from .ttnn_ir import TTNNModule

# What a user of compile-only needs: a request, the compile, its report, the per-block bill of the
# TTNN module tt-mlir wrote. The helpers stay in their modules (.bill, .ttnn_ir, .runner, ...).
__all__ = [
    "EXIT_CHECK_FAILED", "EXIT_ERROR", "EXIT_OK", "FRONTENDS", "BlockBill", "CompileError", "CompileRequest",
    "CompileResult", "TTNNModule", "bill_ok", "compile_dit", "compile_many", "compile_reports", "format_report",
    "gspmd_to_shardy", "keep_cited", "latent_for", "per_block_bill", "report_exit_code",
]
