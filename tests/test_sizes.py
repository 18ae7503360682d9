"""The tree stays easy to walk: no posttrain module over 450 lines, no function over 60, no constructor taking more
than five positional values (docs/design.md's rules). Counted as the files are written: docstrings and comments
included."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "posttrain"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_POSITIONAL = 5


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_longer_than_the_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert _modules() and not long, f"modules over {MAX_MODULE_LINES} lines (split them along a seam): {long}"


def _long_functions(paths, root) -> dict:
    long = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(root)}:{node.lineno} {node.name}"] = lines
    return long


def test_no_function_is_longer_than_the_limit():
    long = _long_functions(_modules(), PACKAGE.parent)
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_counter_finds_a_method_one_line_over(tmp_path):
    short = ["    def short(self):"] + ["        x = 1"] * (MAX_FUNCTION_LINES - 1)  # exactly the limit
    long = ["    def long(self):"] + ["        x = 1"] * MAX_FUNCTION_LINES  # one line over
    path = tmp_path / "m.py"
    path.write_text("\n".join(["class A:", *short, *long]) + "\n")
    start = 2 + MAX_FUNCTION_LINES
    assert _long_functions([path], tmp_path) == {f"m.py:{start} long": MAX_FUNCTION_LINES + 1}


def _wide_constructors(paths, root, exempt=()) -> dict:
    """Classes whose __init__ takes more than MAX_POSITIONAL positional values (self aside)."""
    wide = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in exempt:
                for init in (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"):
                    positional = [a.arg for a in init.args.posonlyargs + init.args.args][1:]
                    if len(positional) > MAX_POSITIONAL:
                        wide[f"{path.relative_to(root)}:{init.lineno} {node.name}"] = len(positional)
    return wide


def test_constructors_take_their_many_values_by_keyword():
    """TRL's trainer classes keep TRL's signatures (positional, as TRL's users may call them)."""
    from posttrain.registry import TRAINERS

    wide = _wide_constructors(_modules(), PACKAGE.parent, exempt={e.trainer_name for e in TRAINERS})
    assert not wide, f"constructors taking more than {MAX_POSITIONAL} positional values (put a * before the rest): {wide}"


def test_the_constructor_check_finds_six_positional_values(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("class A:\n    def __init__(self, a, b, c, d, e, *, f):\n        pass\n\n"
                    "class B:\n    def __init__(self, a, b, c, d, e, f=0):\n        pass\n")
    assert _wide_constructors([path], tmp_path) == {"m.py:6 B": 6}
