"""Compile the sharded Wan DiT through the real tt-mlir compiler, without Tenstorrent hardware.

The pieces, caller to worker and back:

- :mod:`.request`: :class:`CompileRequest` (what to compile), :class:`CompileResult`, :func:`latent_for`;
- :mod:`.runner`: :func:`compile_many` / :func:`compile_dit` (descriptor, environment, worker
  processes through :func:`wan_sharding.workers.run_worker`);
- :mod:`.worker` and :mod:`.lowering`: the worker process and the compile it runs;
- :mod:`.sysdesc`: the system descriptors tt-mlir compiles against;
- :mod:`.ttnn_ir`: the one parser of the TTNN text tt-mlir exports;
- :mod:`.bill`: that text read against the design (per-block bill, tile alignment, padding cost);
- :mod:`.report`: the reports ``wan-sharding compile`` prints (:func:`compile_reports`);
- :mod:`.xla_lowering` + :mod:`.shardy`: the torch-xla frontend (the lowering hardware compiles) and
  its GSPMD -> Shardy converter;
- :mod:`.composites`: the StableHLO composites tt-xla's torch plugin marks (``--composites``);
- :mod:`.options`: tt-mlir compile options as tt-xla's plugin reads them (``--compile-options``).
"""

from .bill import (DATA_MOVEMENT_OPS, BillEntry, BlockBill, DesignBytes, attention_report, bill_from_files, bill_ok,
                   bill_problems, collective_table, design_bill, design_bytes, masked_attention_per_block,
                   padding_cost, per_block_bill, split_ops, tile_alignment)
from .report import (EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_OK, base_depth, build_report, compile_reports,
                     format_report, padding_report, report_exit_code)
from .request import FRONTENDS, CompileError, CompileRequest, CompileResult, latent_for
from .runner import check_plugin, compile_dit, compile_many, prepare_descriptor, private_tmpdir, worker_env
from .shardy import ShardyError, gspmd_to_shardy
from .ttnn_ir import COLLECTIVES, Collective, IRError, Op, TensorType, TTNNModule, ttir_attention

__all__ = [
    "COLLECTIVES", "DATA_MOVEMENT_OPS", "EXIT_CHECK_FAILED", "EXIT_ERROR", "EXIT_OK", "FRONTENDS", "BillEntry",
    "BlockBill", "Collective", "CompileError", "CompileRequest", "CompileResult", "DesignBytes", "IRError", "Op",
    "ShardyError", "TTNNModule", "TensorType", "attention_report", "base_depth", "bill_from_files", "bill_ok",
    "bill_problems", "build_report", "check_plugin", "collective_table", "compile_dit", "compile_many",
    "compile_reports", "design_bill", "design_bytes", "format_report", "gspmd_to_shardy", "latent_for",
    "masked_attention_per_block", "padding_cost", "padding_report", "per_block_bill", "prepare_descriptor",
    "private_tmpdir", "report_exit_code", "split_ops", "tile_alignment", "ttir_attention", "worker_env",
]
