import json
import subprocess
import sys

from wan_sharding.cli import main


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
