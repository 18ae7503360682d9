"""Figures of the trainers' house, for the structure issues' notes:

    python tools/house_figures.py [--root posttrain]

- lines of each trainer package (every module in it);
- protected names crossing the training/ boundary: `_names` defined in training/ that the trainer packages use, and
  `self._names` that training/ uses but only the trainer packages define (a template method's holes);
- constructors and functions taking more than five positional values (the keyword-only rule).
"""

import argparse
import ast
import os
import re

TRAINER_PACKAGES = ("grpo", "rloo", "distillation", "sft", "dpo", "reward", "kto")


def _modules(folder: str):
    for base, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(base, name)


def _defined(paths) -> set:
    """Names defined by `def`/`class` or assigned as attributes (self.x = ...) or class attributes in these files."""
    names = set()
    for path in paths:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    if isinstance(target, ast.Name):
                        names.add(target.id)
    return names


def _attributes_used(paths) -> set:
    used = set()
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                used.add(node.attr)
    return used


def _protected(names) -> set:
    return {n for n in names if re.fullmatch(r"_[a-z][a-z0-9_]*", n)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="posttrain")
    root = parser.parse_args().root
    training = list(_modules(os.path.join(root, "training")))
    trainers = [p for pkg in TRAINER_PACKAGES if os.path.isdir(os.path.join(root, pkg))
                for p in _modules(os.path.join(root, pkg))]
    for pkg in TRAINER_PACKAGES:
        folder = os.path.join(root, pkg)
        if os.path.isdir(folder):
            lines = sum(len(open(p).read().splitlines()) for p in _modules(folder))
            print(f"lines {pkg}: {lines}")
    in_training, in_trainers = _defined(training), _defined(trainers)
    used_by_trainers = _protected(in_training) & _attributes_used(trainers)
    holes = (_protected(_attributes_used(training)) & _protected(in_trainers)) - _protected(in_training)
    print(f"protected names of training/ the trainer packages use: {len(used_by_trainers)}")
    print("  " + " ".join(sorted(used_by_trainers)))
    print(f"protected names training/ uses that only the trainer packages define: {len(holes)}")
    print("  " + " ".join(sorted(holes)))
    wide = []
    for path in _modules(root):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(positional) > 5:
                    wide.append(f"{path}:{node.lineno} {node.name} ({len(positional)})")
    print(f"functions taking more than five positional values: {len(wide)}")
    for line in wide:
        print("  " + line)


if __name__ == "__main__":
    main()
