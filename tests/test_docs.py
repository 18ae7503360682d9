"""The Python examples in the README and docs/ run on their own: every name they use is imported or defined in the
same block (a block that uses `load_dataset` without importing it fails with NameError when pasted)."""

import ast
import builtins
import pathlib
import re

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
