"""docs/operations.md describes every command and option that exists, and the docs name no
option that does not: the command reference lists each command's options, and every
`dflash-ipc ...` command line in docs/operations.md and README.md uses options of that command."""

import os
import re

import click
import pytest

from dflash_ipc.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPERATIONS = os.path.join(ROOT, "docs", "operations.md")
README = os.path.join(ROOT, "README.md")
OPTION = re.compile(r"(?<![\w-])(--[a-z][\w-]*|-o)(?![\w-])")
# Flags of other programs that the docs show (SGLang, vLLM, TensorBoard, Slurm).
OTHER_TOOLS = {"--speculative-algorithm", "--speculative-draft-model-path", "--speculative-config", "--model-path",
               "--speculative-draft-window-size",
               "--logdir", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--exclusive"}


def commands(group=main, path=()) -> dict[str, set[str]]:
    """'bench eval' -> its option names (--help left out)."""
    out = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(commands(cmd, (*path, name)))
        else:
            out[" ".join((*path, name))] = {o for p in cmd.params if isinstance(p, click.Option)
                                            for o in (*p.opts, *p.secondary_opts)}
    return out


COMMANDS = commands()
ALL_OPTIONS = set().union(*COMMANDS.values(), {"--help"})


def read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def reference_bullets() -> list[str]:
    """The bullets of the "Command reference" section, each joined into one line."""
    text = read(OPERATIONS).split("\n## Command reference\n", 1)[1].split("\n## ", 1)[0]
    return [" ".join(b.split()) for b in re.split(r"\n- ", text)[1:]]


def named(bullet: str) -> list[str]:
    """The commands a bullet is about: its bold `dflash-ipc ...` names."""
    return [c for c in COMMANDS if re.search(rf"\*\*`dflash-ipc {re.escape(c)}(?=[ `])", bullet)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_reference_describes_every_option_of_every_command(command):
    bullets = [b for b in reference_bullets() if command in named(b)]
    assert bullets, f"docs/operations.md, Command reference: no entry for `dflash-ipc {command}`"
    mentioned = set(OPTION.findall(" ".join(bullets)))
    cmd = main
    for part in command.split():
        cmd = cmd.commands[part]
    for param in cmd.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert mentioned & set(param.opts), f"`dflash-ipc {command}`: {param.opts} is not in the reference"


def test_the_reference_names_no_option_its_commands_lack():
    for bullet in reference_bullets():
        allowed = set().union(*(COMMANDS[c] for c in named(bullet)))
        assert named(bullet), bullet[:80]
        assert set(OPTION.findall(bullet)) <= allowed, (named(bullet), set(OPTION.findall(bullet)) - allowed)


def command_lines(text: str):
    """(command, the text after it) of every `dflash-ipc ...` / `bin/dflash-up ...` in code:
    fenced blocks (continuation lines joined) and inline code spans."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    names = sorted(COMMANDS, key=len, reverse=True)  # 'bench eval' before 'eval'
    for line in lines:
        for m in re.finditer(r"bin/dflash-up|dflash-ipc((?: [a-z]+){1,2})?", line):
            if m.group(0) == "bin/dflash-up":
                command, end = "up", m.end()
            else:
                words = (m.group(1) or "").split()
                command = next((c for c in names if words[:len(c.split())] == c.split()), None)
                end = m.start(1) + len(" " + command) if command else m.end()
            if command is not None:
                yield command, re.split(r"\s#|\||&&|;|\$\(", line[end:])[0]


@pytest.mark.parametrize("path", [OPERATIONS, README])
def test_command_lines_in_the_docs_use_options_of_their_command(path):
    seen = 0
    for command, rest in command_lines(read(path)):
        unknown = set(OPTION.findall(rest)) - COMMANDS[command]
        assert not unknown, f"{os.path.basename(path)}: `dflash-ipc {command}{rest}` uses {unknown}"
        seen += 1
    assert seen > 5


def benchmark_options(text: str) -> set[str]:
    """Options of the benchmarks/ scripts that ``text`` runs (``python3 -m benchmarks.NAME``), as
    their argparse calls declare them."""
    options = set()
    for name in set(re.findall(r"python3? -m benchmarks\.(\w+)", text)):
        options |= set(re.findall(r'add_argument\(\s*"(--[\w-]+)"', read(os.path.join(ROOT, "benchmarks", f"{name}.py"))))
    return options


@pytest.mark.parametrize("path", [OPERATIONS, README])
def test_every_option_the_docs_name_exists(path):
    text = read(path)
    named_options = set(OPTION.findall(text)) - {"-o"}
    assert named_options - ALL_OPTIONS - OTHER_TOOLS - benchmark_options(text) == set()


def test_a_benchmarks_options_are_read_from_its_own_argparse_calls():
    options = benchmark_options("`python3 -m benchmarks.matvec qwen3-1.7b --sweep`")
    assert {"--sweep", "--grid", "--write", "--compile-workers"} <= options and "--values" not in options
