"""Tests for the .ttsys system-descriptor generator (wan_sharding.compile.sysdesc).

The two plugin tests run JAX in a subprocess: with jax-tt-plugin installed, JAX's
backend initialisation depends on TT_COMPILE_ONLY_SYSTEM_DESC, so it must be set
before JAX starts and must not leak into this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wan_sharding.compile import sysdesc, ttsys
from wan_sharding.compile.sysdesc import (
    SystemDescriptorError,
    build_system_descriptor,
    check_chip_count,
    check_plugin_schema,
    read_system_descriptor,
    write_system_descriptor,
)

HASH_0_1_3 = "f0b54f1568f8f39c9910f4e652cd40fa551fdb1bf4172fab3710429031c23159"

needs_plugin = pytest.mark.skipif(
    sysdesc.installed_plugin_version() is None, reason="jax-tt-plugin is not installed"
)


# ------------------------------------------------------------------ round trip


@pytest.mark.parametrize("arch", ["wormhole_b0", "blackhole"])
@pytest.mark.parametrize("num_chips", [1, 8, 32])
def test_round_trip(arch: str, num_chips: int) -> None:
    data = build_system_descriptor(arch, num_chips)
    # Size-prefixed, identifier TTSY right after the root offset.
    assert int.from_bytes(data[:4], "little") == len(data) - 4
    assert data[8:12] == b"TTSY"

    d = read_system_descriptor(data)
    rows, cols = sysdesc.default_grid(num_chips)
    assert d["num_chips"] == num_chips
    assert d["archs"] == [arch] * num_chips
    assert d["chip_desc_indices"] == list(range(num_chips))
    assert len(d["chips"]) == num_chips  # one ChipDesc per chip, never shared
    assert d["chip_capabilities"] == [1] * num_chips  # HostMMIO
    assert d["coords"] == [(i // cols, i % cols) for i in range(num_chips)]
    assert d["channels"] == []
    assert d["cpus"] == [("Host", "x86_64-pc-linux")]
    assert d["schema_hash"] == HASH_0_1_3
    assert d["version"] == (0, 0, 3758)
    assert d["product_identifier"] == "unknown"

    # Every ChipDesc field survives the trip, compared with chips.json.
    ref = json.loads((Path(sysdesc.__file__).with_name("chips.json")).read_text())["chips"][arch]
    chip = d["chips"][-1]
    for name, kind in ttsys.CHIP_FIELDS:
        want = ref.get("grid_size_by_chips", {}).get(str(num_chips), ref[name]) if name == "grid_size" else ref[name]
        if kind == "dim2d":
            want = (want["y"], want["x"])
        elif kind == "dim2dvec":
            want = [(v["y"], v["x"]) for v in want]
        elif kind == "u16vec":
            want = [ttsys.DATA_TYPE[t] for t in want]
        assert chip[name] == want, name


@pytest.mark.parametrize("num_chips, grid", [(1, (10, 11)), (2, (10, 11)), (4, (10, 11)), (8, (10, 12)),
                                             (32, (10, 12))])
def test_blackhole_worker_grid_is_the_mock_boards(num_chips: int, grid: tuple[int, int]) -> None:
    """The compute-with-storage grid of the board tt-metal's mock device opens for this many
    Blackhole chips (docs/hardware-facts.md, "The worker grid": 2 of 14 Tensix columns harvested on
    the 1-, 2- and 4-chip boards, 1 on the 8-chip and Galaxy boards, less the dispatch column).
    tt-mlir refuses any other grid at optimization level >= 1; Wormhole n150 stays 8x8."""
    assert sysdesc.worker_grid("blackhole", num_chips) == grid
    chips = read_system_descriptor(build_system_descriptor("blackhole", num_chips))["chips"]
    assert {c["grid_size"] for c in chips} == {grid}
    assert sysdesc.worker_grid("wormhole_b0", num_chips) == (8, 8)


def test_default_grids() -> None:
    assert [sysdesc.default_grid(n) for n in (1, 2, 4, 8, 32, 6)] == [
        (1, 1), (1, 2), (1, 4), (2, 4), (8, 4), (1, 6)
    ]
    d = read_system_descriptor(build_system_descriptor("wormhole_b0", 8, grid=(1, 8)))
    assert d["coords"] == [(0, x) for x in range(8)]


def test_dram_sizes_match_chip_values() -> None:
    chips = json.loads(Path(sysdesc.__file__).with_name("chips.json").read_text())["chips"]
    for name, gb in (("wormhole_b0", 12), ("blackhole", 32)):
        c = chips[name]
        assert c["dram_gb"] == gb
        # Marketing GB vs. channels x channel size (BH: 31.875 GiB addressable).
        assert abs(c["num_dram_channels"] * c["dram_channel_size"] / 2**30 - gb) < 0.5


# ------------------------------------------------------------------- topology


@pytest.mark.parametrize(
    "grid, topology, n_links",
    [
        ((8, 4), "none", 0),
        ((8, 4), "line", 8 * 3 + 7 * 4),  # 52: open 2-D mesh
        ((8, 4), "ring", 8 * 4 + 7 * 4),  # 60: every row closed into a ring
        ((8, 4), "torus", 8 * 4 + 8 * 4),  # 64: wrap on both axes
        ((2, 4), "torus", 2 * 4 + 1 * 4),  # 12: a 2-long axis gets no extra wrap link
        ((1, 8), "line", 7),
        ((1, 8), "ring", 8),
        ((1, 2), "ring", 1),
        ((1, 1), "torus", 0),
    ],
)
def test_topology_channel_counts(grid: tuple[int, int], topology: str, n_links: int) -> None:
    n = grid[0] * grid[1]
    d = read_system_descriptor(
        build_system_descriptor("wormhole_b0", n, grid=grid, topology=topology)
    )
    assert len(d["channels"]) == n_links
    rows, cols = grid
    for d0, c0, d1, c1 in d["channels"]:
        (y0, x0), (y1, x1) = divmod(d0, cols), divmod(d1, cols)
        # Links only join grid neighbours (counting wrap-around).
        assert (y0 == y1 and (x1 - x0) % cols in (1, cols - 1)) or (
            x0 == x1 and (y1 - y0) % rows in (1, rows - 1)
        )
        assert c0 != c1  # east->west / south->north cores
    # No chip uses one ethernet core for two links.
    used = [(dev, core) for d0, c0, d1, c1 in d["channels"] for dev, core in ((d0, c0), (d1, c1))]
    assert len(used) == len(set(used))


def test_ring_wrap_link_on_row() -> None:
    d = read_system_descriptor(build_system_descriptor("blackhole", 4, topology="ring"))
    pairs = {(a, b) for a, _, b, _ in d["channels"]}
    assert pairs == {(0, 1), (1, 2), (2, 3), (3, 0)}


# --------------------------------------------------------------------- errors


def test_unknown_arch_lists_known() -> None:
    with pytest.raises(ValueError, match="wormhole_b0.*blackhole|blackhole.*wormhole_b0"):
        build_system_descriptor("grayskull", 1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="topology"):
        build_system_descriptor("wormhole_b0", 8, topology="mesh")
    with pytest.raises(ValueError, match="grid"):
        build_system_descriptor("wormhole_b0", 8, grid=(3, 3))
    with pytest.raises(ValueError):
        build_system_descriptor("wormhole_b0", 0)
    with pytest.raises(SystemDescriptorError, match="TTSY"):
        read_system_descriptor(b"\x00" * 32)


def test_chip_count_check() -> None:
    data = build_system_descriptor("wormhole_b0", 8)
    assert check_chip_count(data, (2, 4)) == 8
    assert check_chip_count(data, (1, 4)) == 8
    with pytest.raises(SystemDescriptorError, match=r"8x4 needs 32 chips .* has 8.*num_chips >= 32"):
        check_chip_count(data, (8, 4))


def test_unknown_plugin_version_is_a_clear_error() -> None:
    data = build_system_descriptor("wormhole_b0", 1)
    with pytest.raises(SystemDescriptorError, match=r"9\.9\.9.*0\.1\.3.*Fix"):
        check_plugin_schema(data, plugin_version="9.9.9")
    assert check_plugin_schema(data, plugin_version="0.1.3") == HASH_0_1_3


def test_write(tmp_path: Path) -> None:
    p = write_system_descriptor(tmp_path / "sub" / "bh4.ttsys", "blackhole", 4, topology="line")
    d = read_system_descriptor(p.read_bytes())
    assert (d["num_chips"], len(d["channels"]), d["archs"][0]) == (4, 3, "blackhole")


# ------------------------------------------------------- the real tt compiler

_PROBE = textwrap.dedent(
    """
    import time
    t0 = time.time()
    import jax, jax.numpy as jnp
    devs = jax.devices()
    print("DEVICES", len(devs), devs[0].platform, devs[0], flush=True)
    t1 = time.time()
    jax.jit(lambda x: x @ x).lower(jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)).compile()
    print("COMPILED in %.2fs (process %.2fs)" % (time.time() - t1, time.time() - t0), flush=True)
    """
)


def _run_plugin(desc: Path) -> subprocess.CompletedProcess[str]:
    from wan_sharding.runtime import scratch
    from wan_sharding.compile.runner import worker_env

    # A private TMPDIR: the plugin keeps its descriptor copy at a fixed path under it.
    tmp = scratch.worker_tmpdir()
    try:
        return subprocess.run([sys.executable, "-c", _PROBE], env=worker_env(desc, tmp), capture_output=True,
                              text=True, timeout=180)
    finally:
        scratch.remove(tmp)


@needs_plugin
def test_plugin_compiles_8_chip_wormhole(tmp_path: Path) -> None:
    desc = write_system_descriptor(tmp_path / "wh8.ttsys", "wormhole_b0", 8)
    check_plugin_schema(desc.read_bytes())
    r = _run_plugin(desc)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "DEVICES 8 tt" in out, out[-4000:]
    assert "COMPILED" in out, out[-4000:]


@needs_plugin
def test_wrong_schema_hash_rejected(tmp_path: Path) -> None:
    desc = write_system_descriptor(tmp_path / "bad.ttsys", "wormhole_b0", 8, schema_hash="0" * 64)
    # Our check catches it before JAX or the plugin start ...
    with pytest.raises(SystemDescriptorError, match="does not match.*Fix: regenerate"):
        check_plugin_schema(desc.read_bytes())
    # ... the plugin loads the file, makes the devices, and only fails at compile time.
    r = _run_plugin(desc)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    assert "DEVICES 8 tt" in out, out[-4000:]
    assert "system desc schema mismatch" in out, out[-4000:]


@needs_plugin
def test_carried_hash_is_in_installed_plugin() -> None:
    # Guards chips.json against a plugin upgrade: the carried hash must be one of the
    # candidates in the installed libtt.so (scan takes a few seconds).
    want = sysdesc.expected_schema_hash()
    assert want in sysdesc.schema_hash_candidates()
