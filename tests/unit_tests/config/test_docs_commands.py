"""Every ``./run_train.sh`` command in the README and docs/ passes the launcher's pre-flight
(``python -m torchtitan.config.manager --check`` with ``WORLD_SIZE=NGPU``), so a renamed flag
or a changed rule cannot leave a page showing a command that no longer starts. Commands the
docs show being refused (a ``$`` prompt with the error below it, or a ``refused`` comment)
must still be refused; commands that name the reader's own files (an HF folder, a dataset)
may fail only for that file."""

import re
import shlex
import sys
from pathlib import Path

import pytest

from torchtitan.config import manager

REPO = Path(__file__).resolve().parents[3]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _commands() -> list[tuple[str, str]]:
    """``(page:line, command)`` for each ``run_train.sh`` line in a code block, continuation
    lines joined and comments dropped."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        in_block, i = False, 0
        while i < len(lines):
            line = lines[i]
            if line.lstrip().startswith("```"):
                in_block = not in_block
            elif in_block and "run_train.sh" in line and not line.lstrip().startswith("#"):
                where, command = f"{page.relative_to(REPO)}:{i + 1}", line
                while re.search(r"\\\s*(#.*)?$", command):
                    i += 1
                    command = re.sub(r"\\\s*(#.*)?$", " ", command) + lines[i]
                found.append((where, command))
            i += 1
    return found


def _split(command: str) -> tuple[dict[str, str], list[str], bool] | None:
    """Environment, arguments, and whether the docs show it refused; ``None``: not a launch
    (prose naming the script, a shell loop's variable, ``--help``)."""
    refused = command.lstrip().startswith("$ ") or re.search(r"#.*refused", command)
    command = re.sub(r"\s#.*$", "", command.strip().removeprefix("$ ")).rstrip(" &")
    command = command.replace("[", "").replace("]", "")  # an optional flag, shown in brackets
    if "$" in command:
        return None
    words = shlex.split(command)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words or not words[0].endswith("/run_train.sh") or "--help" in words:
        return None
    return env, words[1:], bool(refused)


CASES = [(where, parts) for where, command in _commands() if (parts := _split(command))]


def test_the_docs_show_launch_commands():
    assert len(CASES) > 100  # the extraction still finds them
    assert sum(refused for _, (_, _, refused) in CASES) >= 5


@pytest.mark.parametrize("where, parts", CASES, ids=[where for where, _ in CASES])
def test_a_documented_command_passes_the_pre_flight(where, parts, monkeypatch, capsys):
    env, args, refused = parts
    monkeypatch.chdir(REPO)  # run_train.sh starts the run in the repository
    monkeypatch.setenv("WORLD_SIZE", env.get("NGPU", "1"))
    if "PYTHONPATH" in env:
        monkeypatch.setattr(sys, "path", [str(REPO / env["PYTHONPATH"]), *sys.path])
    select = [
        w for key in ("MODULE", "CONFIG") if key in env for w in (f"--{key.lower()}", env[key])
    ]
    if env.get("COMM_MODE"):
        select += ["--comm.mode", env["COMM_MODE"]]
    try:
        code = manager.main(["--check", *select, *args])
    except SystemExit as e:  # tyro's own parse errors
        code = e.code
    error = capsys.readouterr().err.strip()
    if refused:
        assert code == 2, f"{where}: the docs show this refused, but it passes"
        return
    missing = re.search(r"(\S+?):? (?:does not exist|nothing there)", error)
    if code != 0 and missing:
        assert not missing[1].startswith("tests/"), f"{where}: a bundled file is missing: {error}"
        return  # the reader's own file (an HF folder, a dataset, a TOML)
    assert code == 0, f"{where}: {error[-500:]}"
