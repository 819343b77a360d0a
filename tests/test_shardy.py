"""Tests for the GSPMD -> Shardy text converter (wan_sharding.compile.shardy).

torch-xla runs only in subprocesses (one per mesh: torch-xla's mesh must use every device of
its process), started together so their start-up overlaps; the Tenstorrent plugin runs in one
more subprocess with the compile-only descriptor. This process only uses JAX on CPU (conftest),
to check the Shardy syntax against what JAX itself emits and that converted modules verify.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wan_sharding.compile import sysdesc
from wan_sharding.compile.shardy import (GspmdSharding, ShardyError, format_sdy_sharding, gspmd_to_shardy,
                                         mesh_op, parse_gspmd_sharding, parse_sdy_sharding, sdy_spec)

AXES = ("sp", "tp")
MESHES = {"1x1": (1, 1), "1x4": (1, 4), "2x4": (2, 4), "8x4": (8, 4)}

needs_plugin = pytest.mark.skipif(sysdesc.installed_plugin_version() is None,
                                  reason="jax-tt-plugin is not installed (the TT compile-only check needs it)")

# ----------------------------------------------------------------------------- torch-xla probe

# One probe per mesh: every spec the package marks (weights: Megatron col/row-wise, biases,
# replicated, FSDP-style; activations: replicated, L on SP, the sharded-D residual), for the
# default roles and for roles spanning both axes (a ShardingPlan with TP or SP over both), each
# in a module of its own so the argument / constraint is unambiguous. On 2x4, also a Linear pair
# with weights marked and activation constraints: the module the TT compile test compiles.
PROBE = textwrap.dedent(r"""
    import json, sys
    import numpy as np, torch
    from wan_sharding.backends.xla import enable_spmd
    enable_spmd()
    import torch_xla, torch_xla.core.xla_model as xm, torch_xla.distributed.spmd as xs
    from wan_sharding.plan import ShardingPlan

    shape = tuple(json.loads(sys.argv[1]))
    n = int(np.prod(shape))
    mesh = xs.Mesh(np.arange(n), shape, ("sp", "tp"))
    dev = torch_xla.device()
    roles = [ShardingPlan(mesh_shape=shape).mesh()]
    if n > 1:
        roles += [ShardingPlan(mesh_shape=shape, sp_axes=(), tp_axes=("sp", "tp")).mesh(),
                  ShardingPlan(mesh_shape=shape, sp_axes=("sp", "tp"), tp_axes=()).mesh()]
    cases = []
    for m in roles:
        sp, tp = m.sp_axis, m.tp_axis
        weights = [(tp, None), (None, tp), (tp,), (None,), (None, None), (None,) * 5,
                   (tp, sp), (sp, tp)]  # the last two: FSDP over SP on top of TP
        acts = [(None, None, None), (None, sp, None), (None, sp, tp)]
        for spec in weights:
            t = torch.zeros(*[64] * min(len(spec), 2), *[2] * (len(spec) - 2)).to(dev)
            xs.mark_sharding(t, mesh, spec)
            cases.append({"kind": "argument", "spec": spec, "text": xm.get_stablehlo([t * 2])})
        for spec in acts:
            x = torch.zeros(2, 64, 64).to(dev) * 2
            y = xs.annotate_custom_sharding(x, mesh, spec).global_tensor
            cases.append({"kind": "constraint", "spec": spec, "text": xm.get_stablehlo([y + 1])})
    linear_pair = None
    if shape == (2, 4):
        torch.manual_seed(0)
        up, down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)
        up.to(dev); down.to(dev)
        xs.mark_sharding(up.weight, mesh, ("tp", None)); xs.mark_sharding(up.bias, mesh, ("tp",))
        xs.mark_sharding(down.weight, mesh, (None, "tp")); xs.mark_sharding(down.bias, mesh, (None,))
        x = torch.randn(1, 128, 64).to(dev) * 1
        x = xs.annotate_custom_sharding(x, mesh, (None, None, None)).global_tensor
        x = xs.annotate_custom_sharding(x, mesh, (None, "sp", None)).global_tensor
        y = down(torch.nn.functional.gelu(up(x)))
        linear_pair = xm.get_stablehlo([y])
    print("RESULT " + json.dumps({"cases": cases, "linear_pair": linear_pair}))
""")


def _run_probes(meshes: dict[str, tuple[int, int]]) -> dict[str, dict]:
    from wan_sharding.jobs.launch import worker_env

    procs = {}
    for name, shape in meshes.items():
        env = worker_env("xla", shape[0] * shape[1])
        procs[name] = subprocess.Popen([sys.executable, "-c", PROBE, json.dumps(shape)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"torch-xla probe {name} failed:\n{stderr[-3000:]}"
        out[name] = json.loads(lines[-1][len("RESULT "):])
    return out


@pytest.fixture(scope="module")
def xla_modules() -> dict[str, dict]:
    """What torch-xla emitted, per mesh (all probes run at once)."""
    return _run_probes(MESHES)


def _expected(spec, shape) -> tuple[tuple[str, ...], ...]:
    """A torch-xla / PartitionSpec spec as Shardy dim shardings (size-1 axes dropped: they
    split nothing, and the converter never writes them)."""
    sizes = dict(zip(AXES, shape))
    dims = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        dims.append(tuple(a for a in axes if sizes[a] > 1))
    return tuple(dims)


_ARG_SDY = re.compile(r"%arg\d+: tensor<[^>]*> \{sdy\.sharding = #sdy\.sharding(<@mesh, \[.*?\]>)\}")
_CONSTRAINT = re.compile(r"sdy\.sharding_constraint %\S+ (<@mesh, \[.*?\]>) :")


def _verify_mlir(text: str) -> None:
    """The text parses and verifies with jaxlib's MLIR (StableHLO + Shardy dialects)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    with mlir.make_ir_context():
        assert ir.Module.parse(text).operation.verify()


# ------------------------------------------------------------------- the TT compile-only check

TT_WORKER = textwrap.dedent(r"""
    import json, sys, traceback
    import jax
    jax.devices()  # start the plugin now, while the caller still prepares the modules
    from wan_sharding.compile.shardy import compile_stablehlo_text
    for line in sys.stdin:
        req = json.loads(line)
        try:
            r = compile_stablehlo_text(open(req["module"]).read(), req["devices"], req["export"])
            print("RESULT " + json.dumps({"ok": True, **r._asdict()}), flush=True)
        except Exception as e:
            print("RESULT " + json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
""")


@needs_plugin
def test_converted_module_compiles_on_tt(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The converted Linear-pair module compiles on the TT PJRT client in compile-only mode (and
    the GSPMD original does not). First in the file on purpose: the plugin starts up (~20 s,
    mostly waiting) while the torch-xla probes run."""
    from wan_sharding.runtime import scratch
    from wan_sharding.compile.runner import prepare_descriptor, worker_env

    desc = prepare_descriptor(arch="wormhole_b0", num_chips=8, directory=tmp_path)
    tmp = scratch.worker_tmpdir()
    worker = subprocess.Popen([sys.executable, "-c", TT_WORKER], env=worker_env(desc, tmp), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        text = request.getfixturevalue("xla_modules")["2x4"]["linear_pair"]
        raw, converted = tmp_path / "gspmd.mlir", tmp_path / "shardy.mlir"
        raw.write_text(text)
        converted.write_text(gspmd_to_shardy(text, (2, 4), AXES))
        requests = "".join(json.dumps({"module": str(path), "devices": 8, "export": str(export)}) + "\n"
                           for path, export in ((raw, tmp_path / "raw"), (converted, tmp_path / "ir")))
        log, _ = worker.communicate(requests, timeout=300)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        scratch.remove(tmp)
    results = [json.loads(ln[len("RESULT "):]) for ln in log.splitlines() if ln.startswith("RESULT ")]
    assert len(results) == 2, log[-4000:]
    gspmd, shardy = results
    # As is, the plugin refuses GSPMD (if this starts passing, the converter may be unneeded).
    assert not gspmd["ok"] and "GSPMD presharded argument missing @Sharding custom call" in gspmd["error"]
    assert shardy["ok"], shardy.get("error", "") + "\n" + log[-4000:]
    ttnn = Path(shardy["ttnn_path"])
    assert ttnn.parent == tmp_path / "ir" / "irs"
    body = ttnn.read_text()
    assert '"ttnn.matmul"' in body
    assert any(f'"ttnn.{c}"' in body for c in ("all_reduce", "reduce_scatter", "all_gather"))
    assert "2x4" in body  # the mesh the shardings are on


@pytest.mark.parametrize("mesh", list(MESHES))
def test_round_trip_torch_xla(xla_modules, mesh: str) -> None:
    shape = MESHES[mesh]
    cases = xla_modules[mesh]["cases"]
    assert cases
    for case in cases:
        out = gspmd_to_shardy(case["text"], shape, AXES)
        assert "mhlo.sharding" not in out and "@Sharding" not in out
        assert mesh_op(shape, AXES) in out
        found = _ARG_SDY.findall(out) if case["kind"] == "argument" else _CONSTRAINT.findall(out)
        # (torch-xla passes the scalar of "t * 2" as a replicated rank-0 argument too)
        found = [f for f in found if len(parse_sdy_sharding(f)) == len(case["spec"])]
        assert len(found) == 1, (case["spec"], out)
        assert parse_sdy_sharding(found[0]) == _expected(case["spec"], shape), (case["spec"], case["text"])
    _verify_mlir(gspmd_to_shardy(cases[0]["text"], shape, AXES))


def test_forms_torch_xla_emits(xla_modules) -> None:
    """The GSPMD forms actually seen (so a torch-xla change in what it prints shows up here)."""
    seen = set()
    for mesh in MESHES:
        for case in xla_modules[mesh]["cases"]:
            for s in re.findall(r'mhlo\.sharding = "([^"]*)"', case["text"]):
                seen.add("replicated" if s == "{replicated}" else
                         "last_tile_dim_replicate" if "last_tile_dim_replicate" in s else
                         "iota" if "<=[" in s else "tiled")
    assert {"replicated", "tiled", "last_tile_dim_replicate"} <= seen


def test_linear_pair_converts_and_verifies(xla_modules) -> None:
    text = xla_modules["2x4"]["linear_pair"]
    out = gspmd_to_shardy(text, (2, 4), AXES)
    assert [parse_sdy_sharding(c) for c in _CONSTRAINT.findall(out)] == [((), (), ()), ((), ("sp",), ())]
    # Each constraint keeps the SSA name of the custom call it replaces, so every use stays valid
    # (the MLIR verifier below would also reject an undefined value).
    calls = re.findall(r"(%\w+) = stablehlo\.custom_call @Sharding\((%\w+)\)", text)
    assert re.findall(r"(%\w+) = sdy\.sharding_constraint (%\w+)", out) == calls and len(calls) == 2
    _verify_mlir(out)


# ------------------------------------------------------------------------ decoding, by hand


@pytest.mark.parametrize("text, rank, expected", [
    ("{replicated}", 3, ((), (), ())),
    ("{replicated}", 0, ()),
    ("{devices=[4,2]0,4,1,5,2,6,3,7}", 2, (("tp",), ("sp",))),
    ("{devices=[4,2]<=[2,4]T(1,0)}", 2, (("tp",), ("sp",))),  # the same, iota form
    ("{devices=[8,1]<=[8]}", 2, (("sp", "tp"), ())),
    ("{devices=[8,1]<=[2,4]T(1,0)}", 2, (("tp", "sp"), ())),
    ("{devices=[2,1,4]<=[8] last_tile_dim_replicate}", 2, (("sp",), ())),
    ("{devices=[2,1,4]<=[8] last_tile_dims={replicated}}", 2, (("sp",), ())),
    ("{devices=[1,4,2]<=[2,4]T(1,0) last_tile_dim_replicate}", 2, ((), ("tp",))),
    # replicated group listed in another order: the same set of devices per tile
    ("{devices=[4,1,2]4,0,5,1,6,2,7,3 last_tile_dim_replicate}", 2, (("tp",), ())),
    ('{devices=[2,4]<=[8] metadata={op_name="a{b}" source_file="x.py"}}', 2, (("sp",), ("tp",))),
    ("{devices=[1,1,8]<=[8] last_tile_dim_replicate}", 2, ((), ())),
])
def test_sdy_spec_decodes(text: str, rank: int, expected) -> None:
    assert sdy_spec(text, rank, (2, 4), AXES) == expected


@pytest.mark.parametrize("text", [
    "{maximal device=0}",
    "{manual}",
    "{devices=[2,1,4]<=[8] last_tile_dims={manual}}",
    "{devices=[8,1]0,2,1,3,4,6,5,7}",  # a permuted device list no axis order produces
    "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}",  # split over half of "tp"
    "{devices=[2,2,2]<=[8] last_tile_dim_replicate}",  # tp=4 cannot be split 2+2
    "{devices=[4,1]0,1,2,3}",  # only 4 of the mesh's 8 devices
    "{unknown}",
])
def test_unsupported_raises_with_the_string(text: str) -> None:
    with pytest.raises(ShardyError, match=re.escape(text)):
        sdy_spec(text, 2, (2, 4), AXES)
    module = f'module @m {{\n  func.func @main(%arg0: tensor<8x16xf32> {{mhlo.sharding = "{text}"}}) -> tensor<8x16xf32> {{\n' \
             f'    return %arg0 : tensor<8x16xf32>\n  }}\n}}\n'
    with pytest.raises(ShardyError, match=re.escape(text)) as e:
        gspmd_to_shardy(module, (2, 4), AXES)
    assert "argument %arg0 of @main" in str(e.value) and "\n" not in str(e.value)


def test_unsupported_in_constraint_names_the_op() -> None:
    module = ('module @m {\n  func.func @main(%arg0: tensor<8x16xf32>) -> tensor<8x16xf32> {\n'
              '    %0 = stablehlo.custom_call @Sharding(%arg0) {backend_config = "", mhlo.sharding = "{manual}"} '
              ': (tensor<8x16xf32>) -> tensor<8x16xf32>\n    return %0 : tensor<8x16xf32>\n  }\n}\n')
    with pytest.raises(ShardyError, match=r"\{manual\}.*custom_call @Sharding %0"):
        gspmd_to_shardy(module, (2, 4), AXES)


def test_rank_mismatch_raises() -> None:
    with pytest.raises(ShardyError, match="rank-3"):
        sdy_spec("{devices=[2,4]<=[8]}", 3, (2, 4), AXES)


def test_parse_forms() -> None:
    s = parse_gspmd_sharding("{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}")
    assert isinstance(s, GspmdSharding)
    assert (s.kind, s.tile_shape, s.replication, s.devices) == ("tiled", (4, 1), 2, (0, 4, 1, 5, 2, 6, 3, 7))
    t = parse_gspmd_sharding("{{replicated}, {devices=[1,8]<=[8]}}")
    assert isinstance(t, tuple) and [x.kind for x in t] == ["replicated", "tiled"]
    assert parse_gspmd_sharding("{maximal device=3}").maximal_device == 3
    with pytest.raises(ShardyError):
        parse_gspmd_sharding("replicated")


def test_other_ops_get_sharding_per_value() -> None:
    module = textwrap.dedent('''\
        module @m attributes {mhlo.is_dynamic = false} {
          func.func @main(%arg0: tensor<8x16xf32> {mhlo.sharding = "{replicated}"}) -> (tensor<8x16xf32> {mhlo.sharding = "{devices=[4,1,2]<=[2,4]T(1,0) last_tile_dim_replicate}"}) {
            %0 = stablehlo.add %arg0, %arg0 {mhlo.sharding = "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"} : tensor<8x16xf32>
            %1:2 = "stablehlo.optimization_barrier"(%0, %0) {mhlo.sharding = "{{devices=[4,2]<=[2,4]T(1,0)}, {replicated}}"} : (tensor<8x16xf32>, tensor<8x16xf32>) -> (tensor<8x16xf32>, tensor<8x16xf32>)
            return %1#0 : tensor<8x16xf32>
          }
        }
        ''')
    out = gspmd_to_shardy(module, (2, 4), AXES)
    assert 'sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{"sp"}, {}]>]>' in out
    assert 'sdy.sharding = #sdy.sharding_per_value<[<@mesh, [{"tp"}, {"sp"}]>, <@mesh, [{}, {}]>]>' in out
    assert '-> (tensor<8x16xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"tp"}, {}]>})' in out
    assert out.splitlines()[1] == '  sdy.mesh @mesh = <["sp"=2, "tp"=4]>'
    _verify_mlir(out)


def test_result_sharding_error_names_the_result() -> None:
    module = ('module @m {\n  func.func @f(%arg0: tensor<8xf32>) -> (tensor<8xf32>, tensor<8x16xf32> '
              '{mhlo.sharding = "{maximal device=1}"}) {\n  }\n}\n')
    with pytest.raises(ShardyError, match=r"result 1 of @f"):
        gspmd_to_shardy(module, (2, 4), AXES)


def test_module_level_gspmd_attributes_refused() -> None:
    module = 'module @m attributes {mhlo.spmd_output_sharding = "{replicated}"} {\n}\n'
    with pytest.raises(ShardyError, match="mhlo.spmd_output_sharding"):
        gspmd_to_shardy(module, (2, 4), AXES)


def test_already_shardy_refused() -> None:
    with pytest.raises(ShardyError, match="already"):
        gspmd_to_shardy('module @m {\n  sdy.mesh @mesh = <["x"=2]>\n}\n', (2,), ("x",))


def test_syntax_matches_what_jax_emits() -> None:
    """The mesh, argument sharding and constraint text are exactly JAX 0.7.1's Shardy output."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), AXES)
    x = jax.ShapeDtypeStruct((16, 32), np.float32, sharding=NamedSharding(mesh, P(("tp", "sp"), None)))
    f = lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P(None, "sp")))  # noqa: E731
    text = jax.jit(f).lower(x).as_text()
    assert mesh_op((2, 4), AXES) in text
    assert f"sdy.sharding = #sdy.sharding{format_sdy_sharding((('tp', 'sp'), ()))}" in text
    assert re.search(rf"sdy\.sharding_constraint %\d+ {re.escape(format_sdy_sharding(((), ('sp',))))} : tensor<16x32xf32>", text)
