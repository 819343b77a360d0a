"""Installing the package into Tenstorrent's environment must not replace Tenstorrent's stack.

tt-xla's ``python_package/requirements.txt`` (tenstorrent/tt-xla main, 2026-08-21) pins what its
environment has; the pins that matter are stated below by hand from that file. The check is
offline, from metadata only: every base requirement of this package (``pyproject.toml``
``[project].dependencies``), and every requirement of those reached through the metadata of what
is installed here (at the versions the base pins), must accept tt-xla's pinned version of any
package tt-xla pins. A conflict is a pip resolution that would replace Tenstorrent's torch (or
its torch-xla, or JAX) in that environment. The ``cpu`` extra holds the CPU stack's pins and is
not checked (it is what ``scripts/install.sh`` installs, not what a tt-xla environment gets).
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
# tt-xla python_package/requirements.txt (main, 2026-08-21): the torch and torch-xla wheels are URL
# pins (torch-2.11.0+cpu from download.pytorch.org, torch_xla-2.9.0+gited8a445 from Tenstorrent's
# index, both cp312); the rest plain pins.
TT_XLA_PINS = {
    "torch": "2.11.0+cpu", "torch-xla": "2.9.0+gited8a445", "jax": "0.7.1", "jaxlib": "0.7.1",
    "nanobind": "2.10.2", "tt-lang": "1.1.5.dev20260704+light",
    # the TTNN / tracy tools' pins
    "networkx": "3.6.1", "graphviz": "0.21", "seaborn": "0.13.2", "pyyaml": "6.0.3", "click": "8.3.1",
    "pandas": "3.0.0", "websockets": "16.0",
}
# Conflicts with those tools' pins that no choice of this package's can avoid, stated so that any
# other one fails the test: every huggingface-hub that diffusers 0.42.1 accepts (>= 1.32) needs
# click >= 8.4.2 (so does tt-xla's own dev environment, venv/requirements-dev.txt, whose unpinned
# diffusers needs the same huggingface-hub). Installing the package upgrades click there.
KNOWN_TOOL_CONFLICTS = ["huggingface-hub {hub} requires click<9.0.0,>=8.4.2, tt-xla has click 8.3.1"]
TT_XLA_PYTHON = "3.12"
# What the CPU stack pins (the `cpu` extra), which must not be base requirements.
STACK = {"torch-xla", "jax", "jaxlib", "jax-tt-plugin", "torchax", "flax"}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def marker_env() -> dict[str, str]:
    """The tt-xla environment's markers: Python 3.12 on Linux x86_64."""
    return {**default_environment(), "python_version": TT_XLA_PYTHON, "python_full_version": f"{TT_XLA_PYTHON}.0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}


def conflicts(requirements: list[str], pins: dict[str, str] = TT_XLA_PINS) -> list[str]:
    """Every requirement in ``requirements``, or reached from them through the installed
    distributions' metadata (when the installed version is the one required), that does not accept
    the version ``pins`` has for its package: ``"<who> requires <requirement>, tt-xla has <version>"``."""
    env, found, seen = marker_env(), [], set()
    todo = [("wan_sharding", Requirement(r)) for r in requirements]
    while todo:
        who, req = todo.pop()
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        pinned = pins.get(name)
        if pinned is not None and not req.specifier.contains(Version(pinned), prereleases=True):
            found.append(f"{who} requires {req}, tt-xla has {name} {pinned}")
        if name in seen or pinned is not None:  # a package tt-xla pins is tt-xla's: not ours to follow
            continue
        seen.add(name)
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue
        if req.specifier and not req.specifier.contains(dist.version, prereleases=True):
            continue  # another version would be installed there: its metadata is not here
        todo += [(f"{name} {dist.version}", Requirement(r)) for r in dist.requires or ()
                 if "extra ==" not in r]
    return sorted(found)


def test_base_requirements_resolve_against_tt_xla_torch_2_11():
    base = project()["dependencies"]
    hub = distribution("huggingface-hub").version
    assert conflicts(base) == [c.format(hub=hub) for c in KNOWN_TOOL_CONFLICTS]
    # The check can fail: the CPU pins would replace tt-xla's torch (Tenstorrent's torch-xla build,
    # 2.9.0 with a local label, does satisfy ==2.9.0).
    assert conflicts(["torch==2.9.0", "torch-xla==2.9.0"]) == [
        "wan_sharding requires torch==2.9.0, tt-xla has torch 2.11.0+cpu"]
    # ... and so would a dependency that pins torch (found through its installed metadata)
    assert conflicts(["torch>=2.9"], {**TT_XLA_PINS, "torch": "2.8.0"}) == [
        "wan_sharding requires torch>=2.9, tt-xla has torch 2.8.0"]


def test_the_cpu_stack_is_an_extra_and_python_3_12_is_accepted():
    from packaging.specifiers import SpecifierSet

    meta = project()
    named = {canonicalize_name(Requirement(r).name) for r in meta["dependencies"]}
    assert not named & STACK, "torch-xla and the JAX stack come from the environment, not the base requirements"
    assert all(not re.search(r"==", r) for r in meta["dependencies"] if Requirement(r).name == "torch")
    cpu = {canonicalize_name(Requirement(r).name): str(Requirement(r).specifier) for r in meta["optional-dependencies"]["cpu"]}
    assert cpu == {"torch": "==2.9.0", "torch-xla": "==2.9.0", "jax": "==0.7.1", "jaxlib": "==0.7.1",
                   "jax-tt-plugin": "==0.1.3", "torchax": "==0.0.13", "flax": "==0.12.0",
                   "transformers": "==5.24.0"}
    assert f"{TT_XLA_PYTHON}.0" in SpecifierSet(meta["requires-python"])
    # the README's first command installs the extra
    assert '-e "$root[cpu,dev]"' in (ROOT / "scripts" / "install.sh").read_text()
