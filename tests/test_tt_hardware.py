"""The ``tt`` backend on real Tenstorrent devices (marker ``tt``; ``pytest -m tt``).

Runs, on the mesh preset that matches this machine's chips (1x4 QuietBox, 2x4 LoudBox, 8x4
Galaxy; ``WAN_SHARDING_TT_MESH`` overrides; with ``--rank-binding NAME --hosts ...``, the
binding's global mesh over several hosts, through tt-xla's distributed runtime): the PCC matrix (the tiny DiT sharded on the chips
against the unsharded one on the CPU, held to the hardware PCC table), the pipeline PCC (a tiny
Wan 2.2 pipeline with both experts sharded, and restored exactly by ``remove()``) and a warm
profile (the forward compiled once into one dynamo graph, warm iterations faster than the first).
Every test runs in worker processes, as the commands do.

Writes the first-run report (``wan_sharding.jobs.first_run``): one JSON file, at the end, with the
stack's versions, the chips found, PCC per mesh and dtype, compile and warm seconds and dynamo
graphs per forward, and which tests passed (``results/tt-first-run-<mesh>.json``;
``WAN_SHARDING_TT_REPORT`` overrides).

Skipped, with the reason, unless Tenstorrent's torch stack is installed (``tt_torch`` and
torch-xla, looked up without importing either here) and the machine shows a Tenstorrent device
(``/dev/tenstorrent``).
"""

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest

from wan_sharding.backends.tt import TT_DEVICE_DIR, tt_device_present, tt_stack_missing

SKIP_REASON = tt_stack_missing() or (
    None if tt_device_present() else f"no Tenstorrent device on this machine ({TT_DEVICE_DIR} is absent or empty)")

pytestmark = [pytest.mark.tt, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]



@pytest.fixture(scope="module")
def launch(request) -> tuple:
    """``(mesh preset or None, distributed launch or None)`` from the run's options (checked once
    already, in conftest.py's pytest_configure)."""
    from conftest import launch_options

    from wan_sharding.jobs.first_run import marker_launch

    return marker_launch(launch_options(request.config))


@pytest.fixture(scope="module")
def distributed(launch):
    """The multi-host launch (a DistributedLaunch as JSON), or None on one host."""
    return launch[1]


# Run in a worker-like process: how many chips torch-xla sees, and what it says they are.
PROBE = """
import json, torch_xla.runtime as xr
xr.set_device_type("TT")
chips = {"devices": xr.global_runtime_device_count()}
try:
    chips["attributes"] = [{k: str(v) for k, v in a.items()} for a in xr.global_runtime_device_attributes()]
except Exception as e:  # an older or newer torch-xla without it: say so, the count is what matters
    chips["attributes"] = f"unavailable: {type(e).__name__}: {e}"
print("CHIPS " + json.dumps(chips))
"""


@pytest.fixture(scope="module")
def chips(distributed) -> dict:
    from wan_sharding.jobs.launch import worker_env

    proc = subprocess.run([sys.executable, "-c", PROBE], env=worker_env("tt", 0, distributed), capture_output=True,
                          text=True, timeout=600)
    found = re.findall(r"^CHIPS (.*)$", proc.stdout, re.M)
    assert proc.returncode == 0 and found, f"cannot count the Tenstorrent chips:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    info = json.loads(found[-1])
    info["device_nodes"] = sorted(e.name for e in os.scandir(TT_DEVICE_DIR))
    return info


@pytest.fixture(scope="module")
def tt_mesh(chips, launch) -> str:
    """The mesh preset for the chips torch-xla sees (``WAN_SHARDING_TT_MESH`` or the rank binding's
    overrides)."""
    from wan_sharding.mesh import mesh_for_device_count

    return launch[0] or mesh_for_device_count(chips["devices"]).name


@pytest.fixture(scope="module")
def report(tt_mesh, chips):
    """The first-run report, written once when the module's tests are done."""
    from wan_sharding.jobs.first_run import FirstRunReport, default_path

    r = FirstRunReport(tt_mesh, chips)
    yield r
    path = r.write(default_path(tt_mesh))
    print(f"\nfirst-run report: {path}")


@contextlib.contextmanager
def outcome(report, test: str):
    """Record whether the assertions inside passed (the report keeps the figures either way)."""
    try:
        yield
    except BaseException as e:
        report.outcome(test, False, " ".join(str(e).split())[:500])
        raise
    report.outcome(test, True)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pcc_matrix_on_tenstorrent_devices(tt_mesh, distributed, report, dtype):
    from wan_sharding.jobs.check import Case, run_in_subprocess
    from wan_sharding.jobs.pcc import HARDWARE_PCC_THRESHOLDS

    cases = [Case(length=length, dtype=dtype, padding=padding)
             for length in ("aligned", "padded") for padding in ("mask", "slice")]
    with outcome(report, f"pcc_matrix[{dtype}]"):
        results = run_in_subprocess("tt", tt_mesh, cases, timeout=3600, distributed=distributed)
        report.add(f"pcc_{dtype}", [{k: r.get(k) for k in ("mesh", "case", "dtype", "padding", "length", "tokens",
                                                          "padded_tokens", "pcc", "max_abs", "threshold", "ok",
                                                          "seconds")} for r in results])
        assert len(results) == len(cases)
        rows = "\n".join(f"{r['case']}: PCC {r['pcc']:.6f} max|diff| {r['max_abs']:.2e}" for r in results)
        assert all(r["threshold"] == HARDWARE_PCC_THRESHOLDS[dtype] for r in results)
        assert all(r["ok"] for r in results), f"below the hardware {dtype} PCC threshold on {tt_mesh}:\n{rows}"
        assert all(r["mesh"] == tt_mesh and r["backend"] == "tt" for r in results)


def test_pipeline_pcc_on_tenstorrent_devices(tt_mesh, distributed, report):
    from wan_sharding.jobs.generate import compare_in_subprocess
    from wan_sharding.jobs.pcc import pcc_thresholds

    with outcome(report, "pipeline_pcc"):
        [r] = compare_in_subprocess("tt", [tt_mesh], timeout=3600, distributed=distributed)
        threshold = pcc_thresholds("tt", pipeline=True)[r["dtype"]]
        report.add("pipeline", {**{k: r.get(k) for k in ("mesh", "dtype", "steps", "pcc", "max_abs", "seconds",
                                                          "bit_identical_after_remove")}, "threshold": threshold})
        assert r["pcc"] >= threshold, r
        assert set(r["swapped"]) == {"transformer", "transformer_2"}
        assert r["restored_objects"] and r["restored_params"] and r["restored_config"], r
        assert r["bit_identical_after_remove"], r


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_warm_profile_on_tenstorrent_devices(tt_mesh, distributed, report, dtype):
    from wan_sharding.jobs.profile import TT_NOTE, run_profile

    params = {"backend": "tt", "mesh": tt_mesh, "what": ["dit"], "variant": "t2v-a14b", "warmup": 2, "iters": 3,
              "padding": "mask", "resolution": "tiny", "latent": None, "dtype": dtype, "distributed": distributed}
    with outcome(report, f"warm_profile[{dtype}]"):
        run = run_profile(params, echo=False, timeout=3600)
        assert run.ok, run.output[-4000:]
        [r] = run.results
        report.add(f"profile_{dtype}", {k: r.get(k) for k in (
            "mesh", "dtype", "tokens", "padded_tokens", "first_iter_s", "compile_s", "median_s", "min_s", "max_s",
            "compiles", "dynamo_graphs", "graph_breaks")} | {"graphs_per_forward": r.get("dynamo_graphs")})
        assert r["compiles"] == 1, r  # one torch.compile for the first iteration; warm ones reuse it
        assert r["dynamo_graphs"] == 1, r  # ... and it is one graph (graph_breaks is reported: a break before any op makes no graph)
        assert r["median_s"] < r["first_iter_s"], r
        assert r["note"] == TT_NOTE
