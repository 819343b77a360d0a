"""Every row of docs/bad-inputs.md, run: the exit code (or exception), one line holding the excerpt,
no worker started, nothing on disk changed.

The command-line rows go through ``wan_sharding.cli.main`` in one fresh process (one interpreter
start for ~40 commands instead of one each: validation happens before any worker, so each row is
parsing and checks only), with ``subprocess.Popen`` made to fail loudly so a row that would start a
worker shows up; two more rows run as real ``python -m wan_sharding.cli`` processes.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from wan_sharding import ShardingError, apply_dit_sp_activation_sharding, shard_text_encoder, shard_vae
from wan_sharding.mesh import with_cfg
from wan_sharding.models import build_dit, build_text_encoder, build_vae
from wan_sharding.pipeline.tiny import PipelineUnavailable, load_pipeline
from wan_sharding.plan import PlanError, ShardingPlan

DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-inputs.md"
UNWRITABLE = "/proc/wan-sharding-no-such-dir"
ROW = re.compile(r"^\| `(?P<input>[^|]+)` \| (?P<exit>[^|]+?) \| `(?P<excerpt>[^|]+)` \|$")


def _rows(section: str) -> list[tuple[str, str, str]]:
    text = DOC.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [(m["input"], m["exit"], m["excerpt"]) for m in map(ROW.match, text.splitlines()) if m]


CLI_ROWS = _rows("Command line")
API_ROWS = _rows("Library")

# Runs in a fresh process: every argv through main(), its output captured; any Popen is a failure.
DRIVER = r'''
import contextlib, io, json, subprocess, sys
sys.modules["pjrt_plugin_tt"] = None  # as on a machine without Tenstorrent's plugin, wherever this runs
from wan_sharding.cli import main
started = []
def refuse(self, args, *a, **k):
    started.append(str(args))
    raise RuntimeError("a worker process was started")
subprocess.Popen.__init__ = refuse
results = []
for argv in json.loads(sys.stdin.read()):
    started.clear()
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    results.append({"rc": rc, "stderr": err.getvalue(), "stdout": out.getvalue(), "started": list(started)})
print(json.dumps(results))
'''


def _fixtures(root: Path) -> dict[str, str]:
    root.mkdir(exist_ok=True)
    (root / "a-file").write_text("keep me\n")
    bad = root / "bad-model"
    bad.mkdir()
    (bad / "model_index.json").write_text('{"_class_name": "WanPipeline",')  # cut short
    other = root / "sd-model"
    other.mkdir()
    (other / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    ShardingPlan().save(root / "plan-2x4.json")
    no_encoder = root / "wan-without-text-encoder"  # saved with prompt embeddings in its place
    no_encoder.mkdir()
    (no_encoder / "model_index.json").write_text('{"_class_name": "WanPipeline", "text_encoder": [null, null]}')
    outputs = root / "outputs"  # what earlier runs wrote: refused unless --overwrite
    (outputs / "blocks_2").mkdir(parents=True)
    for name in ("t2v-a14b-jax-2x4-mask.mp4", "t2v-a14b-jax-2x4-mask.json", "report.json", "plan.json",
                 "galaxy.ttsys"):
        (outputs / name).write_text("an earlier run's\n")
    from wan_sharding.lora.tiny import write_adapter
    from wan_sharding.models import build_dit

    write_adapter(root / "lora-5b.safetensors", build_dit("ti2v-5b"), rank=2)  # a LoRA for TI2V-5B's tiny expert
    return {"file": str(root / "a-file"), "dir": str(root), "unwritable": UNWRITABLE, "lora5b": str(root / "lora-5b.safetensors"),
            "badmodel": str(bad), "notwan": str(other), "plan": str(root / "plan-2x4.json"),
            "noencoder": str(no_encoder), "outputs": str(outputs)}


def _fill(text: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        text = text.replace("{" + k + "}", v)
    return text


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("WAN_SHARDING_DEBUG", None)
    for k in [k for k in env if k.startswith(("TT_DISTRIBUTED_", "TT_RUNTIME_", "TT_PJRT_", "TT_MLIR_"))]:
        env.pop(k)  # the worker binary looked for where a machine without the plugin has none
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(DOC.parents[1]), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    values = _fixtures(root)
    before = _tree(root)
    argvs = [shlex.split(_fill(row[0], values))[1:] for row in CLI_ROWS]
    argvs.append(["--debug", "profile", "--iters", "0"])
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(argvs), capture_output=True, text=True,
                          cwd=root, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    assert _tree(root) == before, "a bad input changed files on disk"
    assert Path(values["file"]).read_text() == "keep me\n"
    return values, dict(zip(range(len(argvs)), results))


@pytest.mark.parametrize("index", range(len(CLI_ROWS)), ids=[r[0].removeprefix("wan-sharding ") for r in CLI_ROWS])
def test_command_line_row(cli_results, index):
    values, results = cli_results
    _, exit_code, excerpt = CLI_ROWS[index]
    r = results[index]
    assert r["started"] == [], "a worker process was started"
    assert r["rc"] == int(exit_code), r
    lines = r["stderr"].splitlines()
    assert len(lines) == 1, r["stderr"]
    assert _fill(excerpt, values) in lines[0]
    if exit_code == "2":
        assert re.match(r"wan-sharding( [a-z]+)?: error: ", lines[0]), lines[0]
    assert r["stdout"] == ""


def test_debug_adds_the_traceback(cli_results):
    r = cli_results[1][len(CLI_ROWS)]
    assert r["rc"] == 2 and "Traceback (most recent call last)" in r["stderr"]
    assert r["stderr"].splitlines()[-1] == "wan-sharding profile: error: --iters 0: must be >= 1, got 0"


@pytest.mark.parametrize("argv,env", [
    (["plan", "--write", f"{UNWRITABLE}/p.json"], {}),  # refused before the planner runs
    (["generate", "--frames", "4"], {"WAN_SHARDING_DEBUG": "1"}),
])
def test_real_process_exit_code_and_output(tmp_path, argv, env):
    proc = subprocess.run([sys.executable, "-m", "wan_sharding.cli", *argv], capture_output=True, text=True,
                          cwd=tmp_path, env={**_env(), **env}, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert lines[-1].startswith(f"wan-sharding {argv[0]}: error: ")
    assert (len(lines) == 1) != bool(env) and ("Traceback" in proc.stderr) == bool(env)
    assert list(tmp_path.iterdir()) == []


# ---- library rows ------------------------------------------------------------------------------


class _Api:
    """The names a library row may use; remembers the models it made to check them afterwards."""

    def __init__(self, root: Path):
        self.root = root
        self.fresh: list = []  # plain models: must still carry no hook
        self.sharded: list = []  # (model, hook count, handle): must be as SP left them

    def plan(self, drop: str | None = None, **fields):
        data = {**ShardingPlan().to_dict(), **fields}
        data.pop(drop, None)
        return data

    def write(self, text: str) -> str:
        path = self.root / f"plan-{len(list(self.root.iterdir()))}.json"
        path.write_text(text)
        return str(path)

    def dit(self):
        model = build_dit("t2v-a14b")
        self.fresh.append(model)
        return model

    def encoder(self, **overrides):
        model = build_text_encoder(**overrides)
        self.fresh.append(model)
        return model

    def vae(self):
        model = build_vae("wan2.1")
        self.fresh.append(model)
        return model

    def sp_dit(self):
        model = build_dit("t2v-a14b")
        handle = apply_dit_sp_activation_sharding(model, "2x4", backend="jax", padding="mask")
        self.sharded.append((model, _hooks(model), handle))
        return model

    def names(self) -> dict:
        return {"ShardingPlan": ShardingPlan, "plan": self.plan, "write": self.write, "dit": self.dit,
                "load_pipeline": load_pipeline,
                "sp_dit": self.sp_dit, "apply_dit_sp_activation_sharding": apply_dit_sp_activation_sharding,
                "encoder": self.encoder, "shard_text_encoder": shard_text_encoder,
                "copy": copy, "pickle": pickle, "vae": self.vae, "shard_vae": shard_vae, "with_cfg": with_cfg}


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("expr,error,excerpt", API_ROWS, ids=[r[0] for r in API_ROWS])
def test_library_row(tmp_path, expr, error, excerpt):
    api = _Api(tmp_path)
    values = {"dir": str(tmp_path), **{k: v for k, v in _fixtures(tmp_path / "fixtures").items() if k != "dir"}}
    with pytest.raises((PlanError, ShardingError, PipelineUnavailable)) as info:
        eval(_fill(expr, values), api.names())
    assert type(info.value).__name__ == error
    message = str(info.value)
    assert "\n" not in message and _fill(excerpt, values) in message
    assert all(_hooks(m) == 0 for m in api.fresh)  # refused before the model was touched
    for model, hooks, handle in api.sharded:  # the original keeps exactly its SP hooks
        assert _hooks(model) == hooks
        handle.remove()


def test_the_other_tests_the_table_names_exist():
    text = DOC.read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert named
    for path, name in named:
        assert re.search(rf"^def {name}\(", (DOC.parents[1] / path).read_text(), re.M), f"{path}::{name}"
