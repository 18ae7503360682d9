"""The Python examples in the README and docs/ run on their own: every name they use is imported or defined in the
same block (a block that uses `load_dataset` without importing it fails with NameError when pasted)."""

import ast
import builtins
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks():
    for page in PAGES:
        for number, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            yield pytest.param(block, id=f"{page.relative_to(ROOT)}-{number}")


def names_used_but_never_bound(source: str) -> list[str]:
    bound, used = set(dir(builtins)), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return sorted(used - bound)


def test_the_docs_have_python_examples():
    assert len(list(python_blocks())) >= 3


@pytest.mark.parametrize("block", list(python_blocks()))
def test_a_python_example_imports_or_defines_every_name_it_uses(block):
    assert names_used_but_never_bound(block) == []


def test_the_check_catches_a_name_used_without_its_import():
    assert names_used_but_never_bound("trainer = f(load_dataset('x'))\ndef f(d):\n    return d\n") == ["load_dataset"]


# a model's hub id in an example (a quoted 'org/name'); each distinct one runs as its own tiny local model
HUB_ID = re.compile(r"""(["'])([A-Za-z0-9][\w.-]*/[\w.-]+)\1""")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """hub id -> a tiny local model built by posttrain.testing.save_tiny (the docs' recipe for trying things offline),
    a seed of its own for each id (a distillation example's teacher differs from its student); a LLaVA id, a tiny
    LLaVA with its processor (save_tiny_vision)."""
    from posttrain.testing import save_tiny, save_tiny_vision

    built = {}

    def model_for(hub_id: str) -> str:
        if hub_id not in built:
            folder = str(tmp_path_factory.mktemp("model"))
            built[hub_id] = (save_tiny_vision(folder, seed=len(built)) if "llava" in hub_id.lower() else
                             save_tiny(folder, seed=len(built), hidden=32, layers=1))
        return built[hub_id]

    return model_for


@pytest.mark.parametrize("block", list(python_blocks()))
def test_a_python_example_runs_as_written_with_only_its_model_name_changed(block, tiny_models, tmp_path,
                                                                           monkeypatch):
    """Offline, in a folder of its own, each hub id replaced by a tiny local model's path and nothing else changed."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = HUB_ID.sub(lambda m: repr(tiny_models(m.group(2))), block)
    exec(compile(code, "<docs example>", "exec"), {"__name__": "__main__"})


def command_lines():
    """Each `posttrain <trainer> ...` line of the README's and docs' shell examples: (page, line)."""
    from posttrain.cli import TRAINERS

    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if "posttrain " not in line:
                    continue
                words = shlex.split(line.split(" #")[0])
                while words and "=" in words[0]:  # VARIABLE=value before the command
                    words.pop(0)
                if len(words) > 1 and words[0] == "posttrain" and words[1] in TRAINERS:
                    yield pytest.param(words[1:], id=f"{page.relative_to(ROOT)}:{' '.join(words[1:3])}")


@pytest.mark.parametrize("words", list(command_lines()))
def test_a_shell_example_parses_as_written(words, monkeypatch):
    """Every flag a shell example gives is a field or a launch flag of its command, and a config file it names from
    this repository parses (a user's own run.yaml is not here to read). Parsed, not run: they name GPUs, servers and
    hub models."""
    from posttrain.cli import parse_command

    command, argv = words[0], words[1:]
    monkeypatch.chdir(ROOT)
    if "--config" in argv and not (ROOT / argv[argv.index("--config") + 1]).exists():
        i = argv.index("--config")
        argv = argv[:i] + argv[i + 2:]
    parse_command(command, argv)


def test_the_shell_examples_are_found():
    assert len(list(command_lines())) >= 15


def test_every_relative_link_of_the_docs_reaches_a_file():
    pages = [*PAGES, ROOT / "CHANGELOG.md"]
    broken = [(str(page.relative_to(ROOT)), link) for page in pages
              for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text())
              if not link.startswith(("http://", "https://")) and not (page.parent / link).exists()]
    assert broken == []
