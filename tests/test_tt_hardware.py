"""The ``tt`` backend on real Tenstorrent devices (marker ``tt``; ``pytest -m tt``).

Runs, on the mesh preset that matches this machine's chips (1x4 QuietBox, 2x4 LoudBox, 8x4
Galaxy; ``WAN_SHARDING_TT_MESH`` overrides): the PCC matrix (the tiny DiT sharded on the chips
against the unsharded one on the CPU), the pipeline PCC (a tiny Wan 2.2 pipeline with both experts
sharded, and restored exactly by ``remove()``) and a warm profile (the forward compiled once, warm
iterations faster than the first). Every test runs in worker processes, as the commands do.

Skipped, with the reason, unless Tenstorrent's torch stack is installed (``tt_torch`` and
torch-xla, looked up without importing either here) and the machine shows a Tenstorrent device
(``/dev/tenstorrent``).
"""

import os
import re
import subprocess
import sys

import pytest

from wan_sharding.backends.tt import TT_DEVICE_DIR, tt_device_present, tt_stack_missing

SKIP_REASON = tt_stack_missing() or (
    None if tt_device_present() else f"no Tenstorrent device on this machine ({TT_DEVICE_DIR} is absent or empty)")

pytestmark = [pytest.mark.tt, pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")]

MESH_ENV = "WAN_SHARDING_TT_MESH"


@pytest.fixture(scope="module")
def tt_mesh() -> str:
    """The mesh preset for the chips torch-xla sees (probed in a worker-like subprocess)."""
    from wan_sharding.jobs.launch import worker_env
    from wan_sharding.mesh import mesh_for_device_count, preset_key

    if os.environ.get(MESH_ENV):
        return preset_key(os.environ[MESH_ENV])
    probe = "import torch_xla.runtime as xr; xr.set_device_type('TT'); print('DEVICES', xr.global_runtime_device_count())"
    proc = subprocess.run([sys.executable, "-c", probe], env=worker_env("tt", 0), capture_output=True, text=True,
                          timeout=600)
    found = re.findall(r"^DEVICES (\d+)$", proc.stdout, re.M)
    assert proc.returncode == 0 and found, f"cannot count the Tenstorrent chips:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return mesh_for_device_count(int(found[-1])).name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_pcc_matrix_on_tenstorrent_devices(tt_mesh, dtype):
    from wan_sharding.jobs.check import Case, run_in_subprocess

    cases = [Case(length=length, dtype=dtype, padding=padding)
             for length in ("aligned", "padded") for padding in ("mask", "slice")]
    results = run_in_subprocess("tt", tt_mesh, cases, timeout=3600)
    assert len(results) == len(cases)
    rows = "\n".join(f"{r['case']}: PCC {r['pcc']:.6f} max|diff| {r['max_abs']:.2e}" for r in results)
    assert all(r["ok"] for r in results), f"below the {dtype} PCC threshold on {tt_mesh}:\n{rows}"
    assert all(r["mesh"] == tt_mesh and r["backend"] == "tt" for r in results)


def test_pipeline_pcc_on_tenstorrent_devices(tt_mesh):
    from wan_sharding.jobs.generate import compare_in_subprocess
    from wan_sharding.jobs.pcc import PIPELINE_PCC_THRESHOLDS

    [r] = compare_in_subprocess("tt", [tt_mesh], timeout=3600)
    assert r["pcc"] >= PIPELINE_PCC_THRESHOLDS[r["dtype"]], r
    assert set(r["swapped"]) == {"transformer", "transformer_2"}
    assert r["restored_objects"] and r["restored_params"] and r["restored_config"], r
    assert r["bit_identical_after_remove"], r


def test_warm_profile_on_tenstorrent_devices(tt_mesh):
    from wan_sharding.jobs.profile import TT_NOTE, run_profile

    params = {"backend": "tt", "mesh": tt_mesh, "what": ["dit"], "variant": "t2v-a14b", "warmup": 2, "iters": 3,
              "padding": "mask", "resolution": "tiny", "latent": None, "dtype": "bf16"}
    run = run_profile(params, echo=False, timeout=3600)
    assert run.ok, run.output[-4000:]
    [r] = run.results
    assert r["compiles"] == 1, r  # one compile for the first iteration; warm ones reuse it
    assert r["median_s"] < r["first_iter_s"], r
    assert r["note"] == TT_NOTE
