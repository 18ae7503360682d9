"""Check posttrain's vLLM manifest (posttrain/generation/vllm_api.json) against vLLM's source, never importing vLLM.

    python tools/check_vllm_api.py [--version 0.33.0 | --all-in-window] [--wheel PATH] [--write]

vLLM can't be installed next to posttrain's CPU stack, so the wheel is fetched with `pip download --no-deps` (pip's
cache makes reruns cheap) unless --wheel is given, opened as a zip, and only the .py members the manifest leads to are
parsed with `ast`. The manifest is the spec: its keys say what to extract (signatures, dataclass/msgspec/pydantic
fields, Literal values, `@router.get/post` routes, `vllm serve` flags) and --write refreshes their values with what
every checked version holds. A version holds the manifest when all it lists is still there in the same form (new
optional parameters, fields, routes or flags are no difference). Each difference is one line; any exits 1.
Standard library only, plus posttrain's vllm_compat (loaded from its file, without torch) for the signature rule it
shares with the installed-package check. Without --version or --all-in-window: the newest version in the manifest's "checked".
"""

import argparse
import importlib.util
import ast
import json
import operator
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "posttrain" / "generation" / "vllm_api.json"


def _vllm_compat():
    """posttrain/generation/vllm_compat.py itself, loaded from its file: its package's __init__ imports torch."""
    sys.path.insert(0, str(ROOT))  # for posttrain.errors, which needs nothing heavy
    spec = importlib.util.spec_from_file_location("posttrain_vllm_compat", MANIFEST.with_name("vllm_compat.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_compat = _vllm_compat()
parsed_signature, signature_gaps = _compat.parsed_signature, _compat.signature_gaps
PIP = [sys.executable, "-m", "pip"]
TARGET = ["--platform", "manylinux_2_28_x86_64", "--python-version", "3.12"]
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _version_key(version: str) -> tuple:
    """(0, 8, 5) for "0.8.5.post1": release numbers only."""
    return tuple(int(p) for p in re.findall(r"\d+", re.split(r"rc|\.post|\+", version)[0])[:3])


def in_window(version: str, window: str) -> bool:
    """`version` meets every clause of `window` (">=0.33,<0.34"); "<=0.33" and "==0.33" cover 0.33.x."""
    ops, key = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}, \
        _version_key(version)
    return all(ops[op](key[:len(_version_key(bound))] if op in ("<=", "==") else key, _version_key(bound))
               for op, bound in re.findall(r"(>=|<=|==|>|<)\s*([\w.]+)", window))


def window_versions(window: str) -> list[str]:
    """vLLM's released versions inside `window`, oldest first (`pip index versions vllm`)."""
    out = subprocess.run([*PIP, "index", "versions", "vllm", *TARGET], capture_output=True, text=True, check=True)
    listed = re.search(r"Available versions: (.*)", out.stdout).group(1).split(", ")
    return sorted((v for v in listed if in_window(v, window)), key=_version_key)


def download(version: str, dest: str) -> Path:
    """The vLLM `version` wheel, through pip and its cache."""
    subprocess.run([*PIP, "download", "-q", "--no-deps", "--only-binary=:all:", *TARGET, f"vllm=={version}", "-d",
                    dest], check=True)
    return next(Path(dest).glob(f"vllm-{version}-*.whl"))


def _statements(body):
    """Module-level statements, including those under `if TYPE_CHECKING:` and `try:`."""
    for node in body:
        if isinstance(node, (ast.If, ast.Try)):
            yield from _statements(node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body])
        else:
            yield node


def _name(node) -> str:
    """The last dotted name of a Name, Attribute, call or subscript: `typing.Generic[T]` -> Generic."""
    while isinstance(node, (ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


class Wheel:
    """A vLLM wheel's .py members, parsed on first use, and lookups that follow `from X import Y`."""

    def __init__(self, path):
        self.zip, self.version, self.trees = zipfile.ZipFile(path), Path(path).name.split("-")[1], {}
        self.members = set(self.zip.namelist())

    def tree(self, module: str):
        base = module.replace(".", "/")
        path = next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.members), None)
        if path and path not in self.trees:
            self.trees[path] = ast.parse(self.zip.read(path))
        return self.trees.get(path)

    def lookup(self, module: str, name: str, depth: int = 0):
        """(module, node) defining `name` as seen from `module` (a class, function or assignment), or None."""
        tree = self.tree(module)
        for node in _statements(tree.body if tree and depth < 8 else []):
            if isinstance(node, (ast.ClassDef, *FUNCTIONS)) and node.name == name:
                return module, node
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(_name(t) == name for t in targets):
                return module, node
            for alias in node.names if isinstance(node, ast.ImportFrom) else []:
                if (alias.asname or alias.name) == name:
                    return self.lookup(self._absolute(module, node), alias.name, depth + 1)
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module
        package = module if f"{module.replace('.', '/')}/__init__.py" in self.members else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package

    def find(self, dotted: str):
        """(module, node) of a manifest path such as "vllm.entrypoints.llm.LLM", or None."""
        module, _, name = dotted.rpartition(".")
        return self.lookup(module, name) if self.tree(module) else None

    def bases(self, module: str, cls: ast.ClassDef) -> list:
        """(module, ClassDef) of `cls`, then of its bases defined in the wheel, depth first."""
        found = [(module, cls)]
        for base in cls.bases:
            hit = self.lookup(module, _name(base))
            if hit and isinstance(hit[1], ast.ClassDef) and hit[1] is not cls:
                found += [b for b in self.bases(*hit) if b not in found]
        return found

    def member(self, module: str, cls: ast.ClassDef, name: str):
        """The method `name` of `cls` or of the first base defining it, or None."""
        return next((n for _, k in self.bases(module, cls) for n in k.body
                     if isinstance(n, FUNCTIONS) and n.name == name), None)

    def where(self, name: str) -> str | None:
        """The member defining `class name`, by text: only to say where a symbol moved."""
        pattern = re.compile(rf"^class {re.escape(name)}\b".encode(), re.M)
        return next((m for m in sorted(self.members) if m.endswith(".py") and pattern.search(self.zip.read(m))), None)


def params(fn) -> list[str]:
    """A method's parameters in Python's syntax without default values, self or cls dropped:
    ["prompts", "sampling_params=", "*", "use_tqdm=", "**kwargs"]."""
    a = fn.args
    positional, skip = a.posonlyargs + a.args, 0 if any(_name(d) == "staticmethod" for d in fn.decorator_list) else 1
    first_default, tokens = len(positional) - len(a.defaults), []
    for i, arg in enumerate(positional[skip:], skip):
        tokens.append(arg.arg + "=" * (i >= first_default))
        tokens += ["/"] if i == len(a.posonlyargs) - 1 else []
    tokens += [f"*{a.vararg.arg}" if a.vararg else "*"] if a.vararg or a.kwonlyargs else []
    tokens += [arg.arg + "=" * (d is not None) for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    return tokens + ([f"**{a.kwarg.arg}"] if a.kwarg else [])


def _annotated(cls: ast.ClassDef):
    """(name, AnnAssign) of a class body's annotated attributes, ClassVar left out."""
    return [(n.target.id, n) for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)]


def dataclass_params(wheel: Wheel, module: str, cls: ast.ClassDef) -> list[str]:
    """A dataclass's __init__ parameters: bases' fields first; kw_only=True, KW_ONLY, field(default=...,
    default_factory=..., kw_only=..., init=False) honoured."""
    fields = {}
    for _, klass in reversed(wheel.bases(module, cls)):
        decorator = next((d for d in klass.decorator_list if _name(d) == "dataclass"), None)
        if decorator is None:
            continue
        kw_only = any(k.arg == "kw_only" and getattr(k.value, "value", 0) for k in getattr(decorator, "keywords", []))
        for name, node in _annotated(klass):
            if ast.unparse(node.annotation).endswith("KW_ONLY"):
                kw_only = True
                continue
            call = node.value if isinstance(node.value, ast.Call) and _name(node.value.func) == "field" else None
            options = {k.arg: getattr(k.value, "value", k.value) for k in call.keywords} if call else {}
            if options.get("init", True) is not False:
                default = bool({"default", "default_factory"} & set(options)) if call else node.value is not None
                fields[name] = (options.get("kw_only", kw_only), default)
    tokens = [n + "=" * d for n, (kw, d) in fields.items() if not kw]
    keyword = [n + "=" * d for n, (kw, d) in fields.items() if kw]
    return tokens + (["*", *keyword] if keyword else [])


def literal_values(node) -> list:
    """The values of every `Literal[...]` inside `node`, in order."""
    return [c.value for sub in ast.walk(node) if isinstance(sub, ast.Subscript) and _name(sub.value) == "Literal"
            for c in ast.walk(sub.slice) if isinstance(c, ast.Constant)]


def class_fields(wheel: Wheel, module: str, cls: ast.ClassDef) -> list[str]:
    """Public fields of a dataclass, msgspec Struct or pydantic model, bases first; else __init__'s parameters
    (RequestOutput); else the public methods of a protocol or abstract class (and __iter__)."""
    chain = [k for _, k in reversed(wheel.bases(module, cls))]
    names = [n for k in chain for n, _ in _annotated(k) if not n.startswith("_") and n != "model_config"]
    init = wheel.member(module, cls, "__init__")
    if not names and init:
        names = [t.rstrip("=") for t in params(init) if t not in ("*", "/") and not t.startswith("*")]
    if not names:
        names = [n.name for k in chain for n in k.body if isinstance(n, FUNCTIONS) and
                 (not n.name.startswith("_") or n.name == "__iter__")]
    return list(dict.fromkeys(names))


def route(wheel: Wheel, module: str, fn) -> dict:
    """The query and body parameters of a route function, FastAPI's way, and the Literal values they take."""
    found, a = {"query": [], "body": [], "values": {}}, fn.args
    defaults = [None] * (len(a.args) - len(a.defaults)) + a.defaults + a.kw_defaults
    for arg, default in zip(a.args + a.kwonlyargs, defaults):
        text = ast.unparse(arg.annotation) if arg.annotation else ""
        inner = arg.annotation.slice.elts if text.startswith("Annotated[") else [arg.annotation]
        markers = {_name(m) for m in inner[1:] + [default] if isinstance(m, ast.Call)}
        target = wheel.lookup(module, inner[0].id) if isinstance(inner[0], ast.Name) else None
        if text == "Request" or "Depends" in markers:
            continue
        if "Body" in markers:
            found["body"] += [arg.arg]
        elif "Query" not in markers and target and isinstance(target[1], ast.ClassDef):
            found["body"] = target[1].name  # a request model: its fields are the body
        else:
            found["query"].append(arg.arg)
        values = literal_values(arg.annotation) or (literal_values(target[1]) if target and not isinstance(
            target[1], ast.ClassDef) else [])
        found["values"].update({arg.arg: values} if values else {})
    bodies = {n.targets[0].id for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Await)
              and _name(n.value.value) == "json" and isinstance(n.targets[0], ast.Name)}
    for node in ast.walk(fn):  # keys read from `body = await raw_request.json()`: body.get("k") or body["k"]
        key = node.args[0] if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
            node.func.attr == "get" and getattr(node.func.value, "id", 0) in bodies and node.args else \
            node.slice if isinstance(node, ast.Subscript) and getattr(node.value, "id", 0) in bodies else None
        if isinstance(key, ast.Constant) and isinstance(found["body"], list) and key.value not in found["body"]:
            found["body"].append(key.value)
    return found


def routes(wheel: Wheel, wanted) -> dict:
    """path -> {method, query, body, values} of every `@router.<method>(path)` under vllm/entrypoints/ in `wanted`."""
    found = {}
    for member in sorted(m for m in wheel.members if m.startswith("vllm/entrypoints/") and m.endswith(".py")):
        if b"@router." not in wheel.zip.read(member):
            continue
        module = member[:-3].replace("/", ".").removesuffix(".__init__")
        for fn in (n for n in _statements(wheel.tree(module).body) if isinstance(n, FUNCTIONS)):
            for dec in fn.decorator_list:
                path = getattr(dec.args[0], "value", None) if isinstance(dec, ast.Call) and dec.args else None
                if path in wanted and _name(getattr(dec.func, "value", None)) == "router":
                    found.setdefault(path, {"method": dec.func.attr.upper(), **route(wheel, module, fn)})
    return found


def cli_flags(wheel: Wheel, classes: dict) -> set[str]:
    """Flags `vllm serve` takes: add_argument literals of the engine and frontend modules, the frontend config's
    fields dashed, and `--no-X` for the boolean ones (BooleanOptionalAction)."""
    flags, booleans = set(), set()
    for key in ("EngineArgs", "FrontendArgs"):
        module, cls = wheel.find(classes[key])
        flags |= {a.value for n in ast.walk(wheel.tree(module)) if isinstance(n, ast.Call) and
                  _name(n.func) == "add_argument" for a in n.args if str(getattr(a, "value", "")).startswith("--")}
        for _, klass in wheel.bases(module, cls):
            for name, node in _annotated(klass):
                flags |= {"--" + name.replace("_", "-")} if key == "FrontendArgs" else set()
                booleans |= {"--" + name.replace("_", "-")} if "bool" in ast.unparse(node.annotation) else set()
    return flags | {"--no-" + f[2:] for f in booleans & flags}


def fields(wheel: Wheel, hit, attr: str):
    """The names a "fields" key lists: a class's fields, a Literal alias's values, or (Class.attr) the Literal
    values of one attribute; None if missing."""
    if hit is None or not isinstance(hit[1], ast.ClassDef):
        return literal_values(hit[1].value) if hit and not attr else None
    if not attr:
        return class_fields(wheel, *hit)
    node = dict(_annotated(hit[1])).get(attr)
    return literal_values(node.annotation) if node else None


def signature(wheel: Wheel, hit, method: str):
    """A signatures key's parameters: a method's (through the bases), or a dataclass's constructor; None if gone."""
    if hit is None:
        return None
    if not method:
        return dataclass_params(wheel, *hit)
    member = wheel.member(*hit, method)
    return params(member) if member else None


def extract(wheel: Wheel, manifest: dict) -> dict:
    """What `wheel` holds for every key of `manifest`: the same shape, None where a symbol is missing."""
    classes = {k: p if wheel.find(p) else None for k, p in manifest["classes"].items()}
    found = {"classes": classes, "moved": {k: wheel.where(k) for k, p in classes.items() if p is None}}
    for section, read in (("signatures", signature), ("fields", fields)):
        found[section] = {}
        for key in manifest[section]:
            owner, _, member = key.partition(".")
            found[section][key] = read(wheel, wheel.find(manifest["classes"][owner]), member)
    got, cli = routes(wheel, set(manifest["routes"])), manifest["cli"]
    found["routes"] = {path: got.get(path) for path in manifest["routes"]}
    # where EngineArgs or FrontendArgs is missing, that is the difference reported, not every flag
    flags = cli_flags(wheel, manifest["classes"]) if classes["EngineArgs"] and classes["FrontendArgs"] else cli["flags"]
    envs = wheel.zip.read("vllm/envs.py").decode() if "vllm/envs.py" in wheel.members else ""
    found["cli"] = {"module": cli["module"] if wheel.tree(cli["module"]) else None,
                    "flags": [f for f in cli["flags"] if f in flags],
                    "env": {k: v for k, v in cli["env"].items() if k in envs}}
    return found


def differences(manifest: dict, found: dict) -> list[str]:
    """One line per thing the manifest lists that `found` lacks or changed."""
    lines = [f"{k}: not found at {p}" + (f" (now in {found['moved'][k]})" if found["moved"].get(k) else "")
             for k, p in manifest["classes"].items() if not found["classes"][k]]
    for key, tokens in manifest["signatures"].items():
        got = found["signatures"][key]
        lines += [f"{key}: gone"] if got is None else [f"{key}: {gap}" for gap in signature_gaps(tokens, got)]
    for key, names in manifest["fields"].items():
        got = found["fields"][key]
        lines += [f"{key}: gone"] if got is None else [f"{key}: '{n}' gone" for n in names if n not in got]
    for path, want in manifest["routes"].items():
        got = found["routes"][path]
        if got is None:
            lines.append(f"{want['method']} {path}: route gone")
            continue
        lines += [f"{path}: now {got['method']}, was {want['method']}"] * (got["method"] != want["method"])
        for part in ("query", "body"):
            if isinstance(want[part], str) or isinstance(got[part], str):
                lines += [f"{path}: {part} is now {got[part]!r}, was {want[part]!r}"] * (got[part] != want[part])
            else:
                lines += [f"{path}: {part} parameter '{n}' gone" for n in want[part] if n not in got[part]]
        lines += [f"{path}: {p}={v!r} gone" for p, vs in want["values"].items() for v in vs
                  if v not in got["values"].get(p, [])]
    cli = found["cli"]
    lines += [f"vllm serve: module {manifest['cli']['module']} gone"] * (cli["module"] is None)
    lines += [f"vllm serve: flag {f} gone" for f in manifest["cli"]["flags"] if f not in cli["flags"]]
    return lines + [f"vllm serve: environment variable {k} gone" for k in manifest["cli"]["env"] if k not in cli["env"]]


def meet(a, b, signature: bool = False):
    """What two versions' extractions both hold, in b's (the newer's) order; parameters kept only in the same kind,
    with a default only where both have one."""
    if isinstance(b, dict):
        return {k: meet(a[k], v, signature or k == "signatures") if k in a else v for k, v in b.items()}
    if not (isinstance(a, list) and isinstance(b, list)):
        return b
    if not signature:
        return [x for x in b if x in a]
    want, tokens = parsed_signature(a), []
    for name, (kind, default) in parsed_signature(b).items():
        if want.get(name, (None,))[0] == kind:
            tokens += ["*"] if kind == "keyword" and not any(t[:1] == "*" and t[:2] != "**" for t in tokens) else []
            prefix = {"*args": "*", "**kwargs": "**"}.get(kind, "")
            tokens.append(prefix + name + "=" * (default and want[name][1] and not prefix))
    return tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", help="a vLLM version (default: the newest in the manifest's `checked`)")
    parser.add_argument("--all-in-window", action="store_true", help="every released version in the window")
    parser.add_argument("--wheel", help="a vLLM wheel on disk (no download)")
    parser.add_argument("--manifest", default=str(MANIFEST), help="another manifest (tests)")
    parser.add_argument("--write", action="store_true", help="rewrite the manifest with what the versions hold")
    args = parser.parse_args(argv)
    manifest = json.loads(Path(args.manifest).read_text())
    versions = [None] if args.wheel else window_versions(manifest["window"]) if args.all_in_window else [
        args.version or max(manifest["checked"], key=_version_key)]
    failed, extractions = False, []
    with tempfile.TemporaryDirectory() as tmp:
        for version in versions:
            start = time.time()
            path = Path(args.wheel) if args.wheel else download(version, tmp)
            wheel = Wheel(path)
            found = extract(wheel, manifest)
            lines = differences(manifest, found)
            summary = f"{len(lines)} differences" if lines else "holds the manifest"
            print("".join(f"vllm {wheel.version}: {line}\n" for line in lines) +
                  f"vllm {wheel.version}: {summary} ({time.time() - start:.1f} s)", flush=True)
            failed = failed or bool(lines)
            extractions.append((wheel.version, found))
            if not args.wheel:
                path.unlink()  # pip's cache keeps a copy
    if not args.write:
        return int(failed)
    lacking = [v for v, f in extractions if any(None in f[k].values() for k in ("classes", "signatures", "fields",
                                                                                "routes"))]
    if lacking:
        print(f"not written: vllm {', '.join(lacking)} lacks a symbol the manifest lists; fix the manifest or window")
        return 1
    result = extractions[0][1]
    for _, found in extractions[1:]:
        result = meet(result, found)
    del result["moved"]
    written = {**manifest, **result, "cli": {**manifest["cli"], **result["cli"]},
               "checked": [v for v, _ in extractions]}
    Path(args.manifest).write_text(json.dumps(written, indent=1) + "\n")
    print(f"wrote {args.manifest}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as err:  # pip's own message is above
        sys.exit(f"check_vllm_api: `{' '.join(err.cmd[2:5])} ...` failed (exit {err.returncode}).")
