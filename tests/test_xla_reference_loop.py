import subprocess
import sys
from pathlib import Path

from wan_sharding.jobs.launch import worker_env


def test_specs_drop_into_the_reference_mark_sharding_loop():
    """``for tensor, spec in specs.items(): xs.mark_sharding(tensor, mesh, spec)`` on a torch-xla
    mesh with the reference recipe's axis names, then SP; output equals the unsharded model."""
    script = Path(__file__).with_name("xla_reference_loop.py")
    proc = subprocess.run([sys.executable, str(script)], env=worker_env("xla", 8),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["SHARDING"].startswith("{devices=[4,1,2]")  # to_q rows split 4 ways over "model"
    assert float(lines["MAXABS"]) < 1e-4
