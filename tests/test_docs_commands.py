"""The commands of README.md and docs/*.md work as written once the README's set-up has made `.venv`, and every
command without a config reads the trainer's default config and device.

The command lines are read from the Markdown: the lines of fenced shell blocks whose first word (after `VAR=value`
assignments) is a command, and inline code spans that start with an interpreter. Each python line runs the
project's interpreter, `.venv/bin/python` (a bare `python` finds no torch unless a venv is active: the README says
which one), and each python entry point exists and answers `--help` (imports and argument parsing only: one
subprocess for all of them, nothing trained).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import config_to_toml
from trainer import job_config
from trainer.device import device_type
from trainer.job_config import DEFAULT_CONFIG_FILE, load_command_config, load_config

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV = ".venv/bin/"
#: Interpreters and tools a bare name would take from whatever PATH the user has.
BARE = {"python", "python3", "pip", "pip3", "torchrun", "tensorboard", "pytest"}
#: What starts a command in an inline code span of the prose.
INTERPRETERS = {"python", "python3", "pip", "pip3"}
#: First words of a shell line that make it a command (the rest of a fenced block's lines are output or prose).
COMMANDS = BARE | {"bash", "source", "git", "srun", "sbatch", "cd"}
_FENCE = re.compile(r"^\s*```(\w*)\s*$")
_INLINE = re.compile(r"`([^`\n]+)`")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")


def _command_word(words: list[str]) -> str | None:
    """The command a shell line runs (after `VAR=value` assignments), or None when it is not a command."""
    word = next(itertools.dropwhile(_ASSIGNMENT.match, words), None)
    return word if word is not None and (word.startswith(("./", VENV)) or word in COMMANDS) else None


def _split(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote inside a larger example: read it word by word
        return line.split()


def doc_commands() -> list[tuple[str, str]]:
    """('file:line', command) of every command line of README.md and docs/*.md."""
    found = []
    for path in DOCS:
        rel = path.relative_to(REPO).as_posix()
        lines = path.read_text().splitlines()
        fence = None
        pending, start = "", 0
        for number, line in enumerate(lines, 1):
            opening = _FENCE.match(line)
            if opening and fence is None:
                fence = opening.group(1) or "sh"
                continue
            if opening and fence is not None:
                fence = None
                continue
            if fence in ("sh", "bash", "shell", "console"):
                text = line.strip()
                if not pending:
                    start = number
                if text.endswith("\\"):
                    pending += text[:-1] + " "
                    continue
                text, pending = pending + text, ""
                if _command_word(_split(text)):
                    found.append((f"{rel}:{start}", text))
            elif fence is None:
                # in prose, a span is a command when it starts with an interpreter (`torchrun` alone names the tool)
                for span in _INLINE.findall(line):
                    word = _command_word(span.split())
                    if word is not None and (word in INTERPRETERS or word.startswith(VENV)):
                        found.append((f"{rel}:{number}", span))
    return found


COMMAND_LINES = doc_commands()


def _entry_points(command: str) -> list[tuple[str, str]]:
    """('module' or 'script', name) of the python entry points a command line runs: `-m <module>` and the `.py`
    files it names (a script under `torch.distributed.run` counts too); placeholders (`<tool>`) are skipped."""
    words = _split(command)
    if any(words[i:i + 2] == ["-m", "pytest"] for i in range(len(words))):
        # pytest's arguments are test files it collects, not scripts that answer --help
        words = words[:words.index("pytest") + 1]
    points = []
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words) and words[i - 1].endswith(("python", "python3")):
            points.append(("module", words[i + 1]))
        elif word.endswith(".py") and "/" in word and not word.startswith("-"):
            points.append(("script", word))
    return [(kind, name) for kind, name in points if "<" not in name and "*" not in name]


def test_the_docs_name_commands():
    """Guards against a vacuous pass: the extraction finds the commands the README is known to hold."""
    commands = [c for _, c in COMMAND_LINES]
    assert len(commands) > 30, commands
    assert any(c.startswith("./run_train.sh") for c in commands)
    assert any("-m trainer.train --help" in c for c in commands)
    assert any("-m trainer.plot_memory" in c for c in commands)
    assert any("benchmarks/throughput.py" in c for c in commands)


def test_every_python_command_runs_the_projects_interpreter():
    """A bare `python`, `pip` or `tensorboard` (here `python -m trainer.train --help` failed with "No module named
    'torch'" after the README's set-up) is one the user's PATH chooses; `.venv/bin/...` is the one the set-up made."""
    bad = [f"{where}: {command}" for where, command in COMMAND_LINES if _command_word(_split(command)) in BARE]
    assert not bad, "commands in the docs must run the project's .venv (.venv/bin/python ...):\n" + "\n".join(bad)
    tools = {word for _, command in COMMAND_LINES for word in _split(command) if word.startswith(VENV)}
    missing = [tool for tool in tools if not (Path(sys.executable).parent / tool[len(VENV):]).exists()]
    assert not missing, f"the docs run tools the project's venv does not install: {missing}"


def test_every_documented_entry_point_answers_help():
    """Each `-m module` and script that a documented python command runs exists and prints its usage for `--help`
    with exit code 0: one subprocess imports and parses them all (nothing is trained; here `trainer.memory_plan`,
    `trainer.dry_run` and `benchmarks/memory_plan_check.py` did not know `--help`)."""
    points = sorted({p for _, command in COMMAND_LINES if VENV + "python" in command for p in _entry_points(command)})
    assert ("module", "trainer.train") in points and ("script", "benchmarks/throughput.py") in points, points
    missing = [name for kind, name in points if kind == "script" and not (REPO / name).is_file()]
    assert not missing, f"the docs name scripts that do not exist: {missing}"
    probe = (
        "import contextlib, io, json, runpy, sys\n"
        "results = {}\n"
        "for kind, name in json.loads(sys.argv[1]):\n"
        "    out = io.StringIO()\n"
        "    sys.argv = [name, '--help']\n"
        "    code = 0\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):\n"
        "            if kind == 'module':\n"
        "                runpy.run_module(name, run_name='__main__', alter_sys=True)\n"
        "            else:\n"
        "                runpy.run_path(name, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)\n"
        "    except BaseException as e:\n"
        "        code, _ = 1, out.write(f'{type(e).__name__}: {e}')\n"
        "    results[name] = [code, out.getvalue()[-400:]]\n"
        "print(json.dumps(results))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", probe, json.dumps(points)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    bad = {name: text for name, (code, text) in results.items() if code != 0 or not text.strip()}
    assert not bad, "entry points named in the docs that do not answer --help:\n" + json.dumps(bad, indent=1)


def test_the_readme_says_how_the_venv_is_made():
    """The commands assume `.venv`: the README's first commands make it, and it says so."""
    readme = (REPO / "README.md").read_text()
    assert "tools/ensure_venv.sh" in readme and ".venv/bin/python" in readme.split("## Launching")[0]


# One default for every command: the trainer's config (DEFAULT_CONFIG_FILE) and device.


@pytest.fixture
def marked_default(tmp_path, monkeypatch):
    """DEFAULT_CONFIG_FILE pointed at a copy of the debug config with a sequence length and a depth no other config
    has, so that what each command read shows in its output."""
    text = (REPO / DEFAULT_CONFIG_FILE).read_text().replace("seq_len = 256", "seq_len = 96")
    text += "\n"
    assert "seq_len = 96" in text
    marked = tmp_path / "marked.toml"
    marked.write_text(text.replace('flavor = "debugmodel"', 'flavor = "debugmodel"\nn_layers = 3'))
    monkeypatch.setattr(job_config, "DEFAULT_CONFIG_FILE", str(marked))
    return marked


def test_run_train_sh_relies_on_the_python_default():
    """run_train.sh names no config of its own: without CONFIG_FILE it passes none, and the trainer and preflight
    read DEFAULT_CONFIG_FILE."""
    script = (REPO / "run_train.sh").read_text()
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert ".toml" not in code, "run_train.sh must not hold a default config of its own"
    assert DEFAULT_CONFIG_FILE == "train_configs/debug_model.toml" and (REPO / DEFAULT_CONFIG_FILE).is_file()
    assert load_command_config([]) == load_config(["--job.config_file", DEFAULT_CONFIG_FILE])
    assert load_command_config(["--job.config_file", ""]) == load_config([])  # the dataclass defaults alone
    mine = load_command_config(["--job.config_file=train_configs/deepseek_v3_16b.toml"])
    assert mine.model.flavor == "16B"


def test_every_tool_without_a_config_reads_the_trainers_default(marked_default, capsys):
    """`trainer.plan` planned seq_len 2048 on cuda without a config while `./run_train.sh` trains the debug config on
    this machine's device: now the planner, the memory plan, the dry run, preflight and `trainer.job_config` all read
    DEFAULT_CONFIG_FILE, and the planners plan for `device_type()`."""
    from trainer.tools import dry_run, memory_plan, plan, preflight

    plan.main(["--ngpu", "1", "--device-memory", "80", "--json"])
    planned = json.loads(capsys.readouterr().out)
    assert planned["batch"][1] == 96 and planned["device"] == device_type(), planned["batch"]

    memory_plan.main(["--ngpu", "1", "--json"])
    mem = json.loads(capsys.readouterr().out)
    assert mem["ranks"][0]["microbatch"][1] == 96 and mem["device"] == device_type()
    assert mem["ranks"][0]["layers"] == [0, 1, 2]

    dry_run.main(["--ngpu", "1", "--json"])
    dry = json.loads(capsys.readouterr().out)
    assert dry["ranks"][0]["params"] == mem["ranks"][0]["params"]  # the 3-layer model of the marked config

    with pytest.raises(SystemExit) as stop:
        preflight.main(["--job.print_config", "true"])
    assert stop.value.code == preflight.NOTHING_TO_LAUNCH
    printed = capsys.readouterr().out
    assert "seq_len = 96" in printed and "n_layers = 3" in printed

    job_config.main([])
    assert capsys.readouterr().out == printed == config_to_toml(load_config(["--job.config_file",
                                                                            str(marked_default)]))


@pytest.mark.slow
def test_the_trainer_and_run_train_sh_without_a_config_read_the_default():
    """`python -m trainer.train` and `./run_train.sh` (CONFIG_FILE unset) print the same merged config as every tool
    reads without one (`--job.print_config`: the checks of a launch, no training)."""
    expected = config_to_toml(load_command_config([]))
    env = {k: v for k, v in os.environ.items() if k != "CONFIG_FILE"}
    for command in ([sys.executable, "-m", "trainer.train"], ["./run_train.sh"]):
        r = subprocess.run([*command, "--job.print_config", "true"], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout == expected, (command, r.stdout[:500])
