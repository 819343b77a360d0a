import json
import subprocess
import sys
from pathlib import Path

from wan_sharding.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_meshes_lists_every_preset(capsys):
    assert main(["meshes"]) == 0
    out = capsys.readouterr().out
    assert "8x4" in out and "Galaxy" in out and "multiple of 256" in out


def test_specs_json_names_every_parameter(capsys):
    assert main(["specs", "--mesh", "2x4", "--variant", "i2v-a14b", "--size", "tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["specs"]["blocks.0.attn1.to_q.weight"] == ["tp", None]
    assert data["specs"]["patch_embedding.weight"] == [None] * 5
    assert sum(data["counts"].values()) == len(data["specs"])


def test_default_job_prints_pcc_per_mesh_and_backend():
    """The README's main command with no arguments runs `check`; one small slice of it here."""
    proc = subprocess.run([sys.executable, "-m", "wan_sharding.cli", "--meshes", "2x4", "--backends", "jax",
                           "--lengths", "padded"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("jax "))
    assert "105->128" in row and " mask " in row and "FAIL" not in row
    assert "all within bounds (fp32 PCC >= 0.99999, max|diff| <= 1e-04; bf16 PCC >= 0.99)" in proc.stdout
    # what ran first, then the table's header as the README shows it (tests/test_docs.py: the README's
    # settings line is what `wan-sharding` prints for its own arguments)
    lines = proc.stdout.splitlines()
    assert lines[0] == "backend: jax; patches: none; cache: none; cfg: 1; text encoder: host; vae: host"
    readme = (ROOT / "README.md").read_text().splitlines()
    assert lines[1] == next(line for line in readme if line.startswith("backend mesh"))


def test_the_settings_line_names_patches_cache_and_cfg(tmp_path):
    from wan_sharding.cli import parse_and_validate
    from wan_sharding.cli.args import settings_for

    args = parse_and_validate(["generate", "--patches", "exact", "--cache", "fbc", "--out", str(tmp_path)])
    assert settings_for(args) == ("backend: jax; patches: patchify, rope, qkv, rope_tables, prompt_kv, ffn_rows, adaln_norm; "
                                  "cache: fbc; cfg: 1; text encoder: host; vae: host")
    args = parse_and_validate(["check", "--cfg", "2", "--backends", "xla", "--patches", "qkv"])
    assert settings_for(args) == ("backend: xla; patches: qkv; cache: none; "
                                  "cfg: 2 (cond and uncond as one program, one per half of the mesh); "
                                  "text encoder: host; vae: host")
    # where the components run: as asked, and --vae's default per backend (mesh on tt)
    args = parse_and_validate(["check", "--backends", "jax", "tt", "--text-encoder", "mesh"])
    assert settings_for(args).endswith("; text encoder: mesh; vae: host (jax), mesh (tt)")
    # a component's own check runs that component on the mesh and nothing else
    args = parse_and_validate(["check", "--component", "vae", "--backends", "jax"])
    assert settings_for(args) == "backend: jax; patches: none; cache: none; cfg: 1; vae: mesh"
    args = parse_and_validate(["check", "--component", "text-encoder", "--backends", "jax", "tt"])
    assert settings_for(args) == "backend: jax, tt; patches: none; cache: none; cfg: 1; text encoder: mesh"
