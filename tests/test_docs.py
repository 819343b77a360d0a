"""The README and the docs stay honest: what they quote can be run, and what they name exists.

- Every ``wan-sharding ...`` command line quoted in ``README.md`` and ``docs/*.md`` (in a code
  block, or as inline code) parses with the CLI's own parser and passes the command's own input
  checks (:func:`wan_sharding.cli.parse_and_validate`: no worker starts, nothing is written).
- Every ``docs/...`` and ``results/...`` path they name exists, and so does every relative link.
- Every topic page is linked from both the README and ``docs/README.md``, and each page starts
  with what a user runs (a code block before any second-level section).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages a user reads for one topic: each linked from the README and from docs/README.md.
TOPICS = ["check.md", "pipelines.md", "caching.md", "compile-only.md", "compile-hardware.md", "tt-backend.md", "patches.md", "planner.md",
          "meshes.md", "serving.md", "bad-inputs.md", "design.md", "hardware-facts.md", "tt-mlir-notes.md", "results.md",
          "layout.md", "text-encoder.md", "pipeline-stages.md", "lora.md"]
# What commands write (named in example output, made by the command, not kept in git): generate's,
# compile's and submit's default --out, serve's --store, and the report `pytest -m tt` writes on hardware.
OUTPUT_DIRS = ("results/generate", "results/compile/", "results/submit", "results/serve", "results/tt-first-run-")


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)


def _command_lines(text: str) -> list[str]:
    """``wan-sharding`` invocations: lines of code blocks (continuations joined, prompts and trailing
    comments dropped) and inline code spans that start with the command."""
    found = []
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"^\s*\$\s+", "", line)
            m = re.match(r"^\s*(?:\S*/)?wan-sharding(\s.*)?$", line)
            if m:
                found.append("wan-sharding" + (m.group(1) or ""))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    found += [m.group(1) for m in re.finditer(r"`((?:\S*/)?wan-sharding(?: [^`]*)?)`", prose)]
    out = []
    for cmd in found:
        cmd = re.sub(r"\s+#.*$", "", cmd).strip()
        cmd = re.sub(r"^\S*/wan-sharding", "wan-sharding", cmd)
        if "<" in cmd or cmd.split()[1:2] in (["<command>"], ["..."]):
            continue  # a pattern (`wan-sharding <command>: error: ...`), not a command line
        if re.match(r"^wan-sharding(?: [a-z]+)?: ", cmd):
            continue  # a line the command prints (`wan-sharding serve: listening on ...`)
        out.append(cmd)
    return out


def _all_commands() -> list[tuple[str, str]]:
    cmds = []
    # docs/bad-inputs.md quotes commands that must be refused; tests/test_bad_inputs.py runs those.
    for page in (p for p in PAGES if p.name != "bad-inputs.md"):
        for cmd in _command_lines(page.read_text()):
            if (page.name, cmd) not in cmds:
                cmds.append((page.relative_to(ROOT).as_posix(), cmd))
    return cmds


COMMANDS = _all_commands()


def test_the_docs_quote_commands() -> None:
    # The extraction must find what the README shows, or the check below checks nothing.
    readme = [c for p, c in COMMANDS if p == "README.md"]
    assert "wan-sharding" in readme and len(COMMANDS) >= 30, COMMANDS
    assert {c.split()[1] for _, c in COMMANDS if len(c.split()) > 1} >= {
        "check", "specs", "meshes", "generate", "profile", "compile", "sysdesc", "plan"}


@pytest.fixture()
def plan_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch directory to run in, with a real plan where a quoted command reads one (the docs
    write it with `plan --write` first): the 2x4 Wormhole recommendation kept in results/."""
    from wan_sharding import ShardingPlan

    monkeypatch.chdir(tmp_path)
    rec = json.loads((ROOT / "results" / "plan_2x4_wormhole_b0_480p.json").read_text())["recommended"]
    ShardingPlan.from_dict(rec["plan"]).save(tmp_path / "plan.json")
    from wan_sharding.lora.tiny import write_adapter  # the LoRA files docs/lora.md's commands load (tiny T2V)
    from wan_sharding.models import build_dit

    for name, seed in (("distill_high", 0), ("distill_low", 1)):
        write_adapter(tmp_path / f"{name}.safetensors", build_dit("t2v-a14b", seed=seed), rank=4)
    return tmp_path


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}:{c}" for p, c in COMMANDS])
def test_every_quoted_command_parses_and_validates(page: str, command: str, plan_files: Path) -> None:
    from wan_sharding.cli import UsageError, parse_and_validate

    argv = shlex.split(command)[1:]
    if "--write" in argv:  # the plan a quoted `plan --write` makes is not there yet (it is refused otherwise)
        (plan_files / argv[argv.index("--write") + 1]).unlink(missing_ok=True)
    before = sorted(p.name for p in plan_files.iterdir())
    try:
        parse_and_validate(argv)
    except UsageError as e:
        pytest.fail(f"{page}: `{command}` is refused: {e}")
    except SystemExit as e:  # --help exits 0 after printing; anything else is a refusal
        if e.code != 0:
            pytest.fail(f"{page}: `{command}` does not parse (exit {e.code})")
    assert sorted(p.name for p in plan_files.iterdir()) == before, "validation wrote something"


def test_parse_and_validate_refuses_what_main_refuses() -> None:
    # The check above can fail: the same entry point refuses a bad value and an unknown option.
    from wan_sharding.cli import UsageError, parse_and_validate

    with pytest.raises(UsageError, match="ROWSxCOLS"):
        parse_and_validate(["plan", "--mesh", "2by4"])
    with pytest.raises(SystemExit):
        parse_and_validate(["generate", "--no-such-option"])
    with pytest.raises(UsageError, match="4k"):
        parse_and_validate(["generate", "--frames", "8"])


# A path right after another project's name is that project's (tt-xla `docs/source/...`).
OTHER_REPOS = re.compile(r"(?:tt-xla|tt-mlir|tt-metal|tt-inference-server|diffusers)(?:'s)?[\s`(]*$")


def _named_paths(text: str) -> set[str]:
    return {m.group(0).rstrip(".,:;)") for m in re.finditer(r"(?<![\w/.-])(?:docs|results)/[\w.*<>/-]*[\w*>]", text)
            if not OTHER_REPOS.search(text[max(0, m.start() - 40):m.start()])}


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_named_paths_and_links_exist(page: Path) -> None:
    text = page.read_text()
    missing = []
    for name in sorted(_named_paths(text)):
        if name.startswith(OUTPUT_DIRS):
            continue
        pattern = re.sub(r"<[^>]+>", "*", name)
        if not (list(ROOT.glob(pattern)) if "*" in pattern else (ROOT / name).exists()):
            missing.append(name)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
            missing.append(f"link {target}")
    assert not missing, f"{page.relative_to(ROOT)} names what does not exist: {missing}"


def test_every_topic_has_its_page_linked_from_both_indexes() -> None:
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "README.md").read_text()
    for topic in TOPICS:
        assert (ROOT / "docs" / topic).exists(), topic
        assert f"](docs/{topic})" in readme, f"README.md does not link docs/{topic}"
        assert f"]({topic})" in index, f"docs/README.md does not link {topic}"
    assert len(readme.splitlines()) <= 200, "the README is for five minutes: move the topic to docs/"


# Reference pages (design, figures, compiler notes) are read, not run; every other page is a task.
REFERENCE = ("design.md", "hardware-facts.md", "tt-mlir-notes.md")


@pytest.mark.parametrize("topic", [t for t in TOPICS if t not in REFERENCE])
def test_each_page_starts_with_what_a_user_runs(topic: str) -> None:
    text = (ROOT / "docs" / topic).read_text()
    first_section = text.find("\n## ")
    head = text if first_section < 0 else text[:first_section]
    assert "```" in head, f"docs/{topic} should open with the command or code a user runs"


def test_the_readme_example_runs_with_and_without_its_environment_line(tmp_path: Path) -> None:
    """The README's Python example, run as a user would (a fresh process, a clean environment:
    no JAX or XLA settings), writes its video and imports the sharding API from ``wan_sharding``
    alone: as written, and without its ``os.environ.update(...)`` line, where the package sets JAX
    up for the CPU devices itself (no Tenstorrent plugin log). Both run at once."""
    import os
    import subprocess
    import sys

    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.M | re.S)
    assert len(blocks) == 1, "the README has one Python example"
    example = blocks[0]
    imports = re.findall(r"^from (wan_sharding\S*) import", example, flags=re.M)
    assert "wan_sharding" in imports and set(imports) <= {"wan_sharding", "wan_sharding.pipeline.tiny"}
    bare = "\n".join(line for line in example.splitlines() if not line.startswith("os.environ.update("))
    assert len(bare.splitlines()) == len(example.splitlines()) - 1, "the example sets its environment in one line"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}  # the example sets them
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    runs = {}
    for name, code in (("as-written", example), ("no-env-line", bare)):
        (tmp_path / name).mkdir()
        runs[name] = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path / name, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, err[-3000:])
        assert (tmp_path / name / "wan_sharded.gif").stat().st_size > 1000, name
        assert "No chips detected" not in err and "Unable to initialize backend" not in err, (name, err[-3000:])


# ---- figures and sample outputs -----------------------------------------------------------------


def _figures():
    """``scripts/docs_figures.py`` (the docs' figure blocks, rendered from results/)."""
    import importlib.util

    import sys

    if "docs_figures" not in sys.modules:
        spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "scripts" / "docs_figures.py")
        sys.modules["docs_figures"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["docs_figures"])
    return sys.modules["docs_figures"]


def test_every_figure_block_is_what_its_results_give() -> None:
    """Each table and sentence between ``<!-- figures:NAME -->`` marks is exactly what
    ``scripts/docs_figures.py`` renders from ``results/*.json`` now: an edited figure, or a re-run
    whose page was not rewritten, fails here."""
    figures = _figures()
    assert len(figures.BLOCKS) >= 6 and {b.page for b in figures.BLOCKS.values()} >= {"docs/planner.md",
                                                                                       "docs/check.md"}
    assert figures.stale() == [], "run: .venv/bin/python scripts/docs_figures.py"


@pytest.mark.parametrize("name", ["plan-480p", "plan-cfg-split", "plan-model", "fuzz", "profile", "serve"])
def test_an_edited_figure_is_caught(name: str) -> None:
    """The check above can fail: a copy of the page with one figure of the block changed is stale."""
    figures = _figures()
    page = figures.BLOCKS[name].page
    text = (ROOT / page).read_text()
    body = next(m["body"] for m in figures.MARK.finditer(text) if m["name"] == name)
    edited = re.sub(r"\d+\.\d+", lambda m: f"{float(m.group()) + 1:.{len(m.group().split('.')[1])}f}", body, count=1)
    assert edited != body
    assert figures.stale(texts={page: text.replace(body, edited)}) == [f"{page}: {name}"]


def test_a_rerun_that_only_refreshes_the_date_rewrites_nothing(tmp_path: Path) -> None:
    """A benchmark's result (``docs_figures.write_result``) and the pages quoting it
    (``docs_figures.update``) are left untouched, file and mtime, by a re-run whose figures are the
    same; a changed figure is written."""
    import os

    figures = _figures()
    path = tmp_path / "stages.json"
    assert figures.write_result(path, {"date": "2026-12-04", "rows": [1.5]})
    os.utime(path, ns=(1, 1))
    assert not figures.write_result(path, {"date": "2026-12-06", "rows": [1.5]})
    assert path.stat().st_mtime_ns == 1 and json.loads(path.read_text())["date"] == "2026-12-04"
    assert figures.write_result(path, {"date": "2026-12-06", "rows": [1.6]})
    assert json.loads(path.read_text()) == {"date": "2026-12-06", "rows": [1.6]}
    root = tmp_path / "root"  # a copy of the repository's pages and results: every block matches
    for page in {b.page for b in figures.BLOCKS.values()} | {"results"}:
        (root / page).parent.mkdir(parents=True, exist_ok=True)
        if page == "results":
            shutil.copytree(ROOT / "results", root / "results")
        else:
            shutil.copy(ROOT / page, root / page)
            os.utime(root / page, ns=(1, 1))
    assert figures.update(root=root) == []
    assert all((root / b.page).stat().st_mtime_ns == 1 for b in figures.BLOCKS.values())


def test_profile_what_vae_prints_the_rows_of_its_page() -> None:
    """``profile --what vae`` prints the columns of docs/vae.md's CPU table, and for the rows
    ``scripts/bench_vae.py`` got from it (``results/vae.json``) the very cells the page shows; the
    page names the latent and the command; ``profile --help`` offers the VAE."""
    import subprocess
    import sys

    from wan_sharding.jobs.vae_profile import format_vae_row

    figures = _figures()
    page = (ROOT / "docs" / "vae.md").read_text()
    block = next(m["body"] for m in figures.MARK.finditer(page) if m["name"] == "vae-cpu")
    rows = json.loads((ROOT / "results" / "vae.json").read_text())["cpu"]
    header = next(line for line in block.splitlines() if line.startswith("| VAE"))
    for r in rows:
        printed = format_vae_row(r).splitlines()
        assert f"latent {' x '.join(map(str, r['latent']))}" in printed[0]
        assert [c for c in re.split(r"\s{2,}", printed[1]) if c] == [c.strip() for c in header.strip("|").split("|")]
        cells = [c.strip() for c in next(line for line in block.splitlines()
                                         if line.startswith(f"| {r['vae']} | {r['mesh']} |")).strip("|").split("|")]
        assert [c for c in re.split(r"\s{2,}", printed[2].strip()) if c] == cells
    latent = ",".join(map(str, rows[0]["latent"]))
    assert f"--what vae --latent {latent}" in page and f"--latent {latent} --warmup" in block
    import argparse

    from wan_sharding.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    help_text = " ".join(sub.choices["profile"].format_help().split())  # what profile --help prints, unwrapped
    assert "or of the VAE's decode beside the host's" in help_text and "vae: the VAE's decode" in help_text


def _sample_outputs() -> list[tuple[str, str, str]]:
    """(page, command, the line after it) for every ``$ .../wan-sharding ...`` line in a code block."""
    found = []
    for page in PAGES:
        for block in _code_blocks(page.read_text()):
            lines = block.splitlines()
            for line, after in zip(lines, lines[1:] + [""]):
                m = re.match(r"^\$ \S*wan-sharding(\s.*)?$", line)
                if m:
                    found.append((page.relative_to(ROOT).as_posix(), "wan-sharding" + (m.group(1) or ""), after))
    return found


def _command_word(command: str) -> str:
    words = command.split()
    return words[1] if len(words) > 1 and not words[1].startswith("-") else "check"


# the samples of the commands that print a settings line first (not with --json)
SAMPLES = [s for s in _sample_outputs() if _command_word(s[1]) in ("check", "generate", "profile")
           and "--json" not in s[1].split()]


def test_the_docs_show_sample_outputs_of_the_commands_that_print_settings() -> None:
    assert {_command_word(c) for _, c, _ in SAMPLES} == {"check", "generate", "profile"}


@pytest.mark.parametrize("page,command,first", SAMPLES, ids=[f"{p}:{c}" for p, c, _ in SAMPLES])
def test_a_documented_output_starts_as_the_command_prints(page: str, command: str, first: str,
                                                          plan_files: Path) -> None:
    """A sample output of check, generate or profile starts with the settings line that command
    prints (``cli.args.settings_for``, which the runs in tests/test_cli.py and tests/test_pipeline.py
    check against what the commands print)."""
    from wan_sharding.cli import parse_and_validate
    from wan_sharding.cli.args import settings_for

    assert first == settings_for(parse_and_validate(shlex.split(command)[1:])), f"{page}: `{command}`"
