"""The GPU kit: posttrain beside TRL 1.16 on one NVIDIA GPU, in two calls of under 5 minutes each.

Usage: bash bench/gpu/run.sh --call 1|2 [--dry-run] [--work DIR] [--deadline SECONDS]   (run.sh calls this file)
       python bench/gpu/kit.py --check-wheels     (the wheel list against bench/gpu/offline/wheels, and their size)

Each call is a list of parts, each a subprocess with its own time budget (cut to what the call's deadline leaves; a
part that fails or runs out of time shows its one-line reason in the table, and the others still run). Both calls
start with versions, wheels and model (each skipped when the machine, still warm, has it from the first call):
  versions    what is installed, and one sentence per package outside posttrain's declared bounds (pyproject.toml);
  wheels      installs bench/gpu/offline/wheels (only what the machine lacks: requirements.txt) offline into
              bench/gpu/site-packages (--dry-run: checks the list, the files and that pip would install them on
              CPython 3.12 manylinux; installs nothing);
  model       bench/make_qwen_shape.py: Qwen2.5-1.5B's shape with random weights, saved in bf16 (--dry-run: 2 layers,
              hidden 64, float32);
call 1:
  generation  bench/gpu/decode.py, timed on its own: posttrain's decode (growing, and fixed shapes replayed from a CUDA
              graph) beside transformers' generate, 64 rows x 1,024 tokens: tokens/s, ms/token, peak allocated and
              reserved memory, and a profiler summary of one decode step;
  grpo, sft, dpo  TRL's anchors and posttrain's bench/*_step.py, the same flags, through bench/gpu/on_device.py: bf16
              weights through TRL's model_init_kwargs, bf16 autocast, gradient checkpointing on; GRPO 64 rollouts x
              1,024 tokens (--dry-run: CPU, float32, small);
call 2:
  tests       pytest -m gpu tests/test_gpu.py tests/test_fixed_shape_decode.py (--dry-run: the first with
              POSTTRAIN_GPU_TESTS_ON_CPU=1, on the CPU);
  fsdp2       posttrain's GRPO step under accelerate's FSDP2 (posttrain/accelerate_configs/fsdp2.yaml), one process;
  packed      bench/gpu/packed_rows.py: packed rows against each rollout alone, under every attention kernel present;
  logprobs    bench/gpu/logprob_paths.py: the output layer's log-probs four ways (whole logits, TRL's two, posttrain's);
  longest     the longest GRPO completion each side trains (8 completions, one step), lengths tried from the small end
              up to the first CUDA out-of-memory; it gets what time is left.
Then it prints the call's table. Every part's output is kept in WORK/logs/PART.log.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH = os.path.join(ROOT, "bench")
OFFLINE = os.path.join(HERE, "offline")
WHEELS = os.path.join(OFFLINE, "wheels")
ANCHOR_COPIES = os.path.join(OFFLINE, "anchors")
# the wheels' install folder; its name must hold "site-packages": dill (which datasets hashes functions with) pickles
# a module from anywhere else by value, and pyarrow's cannot be ("Can't pickle <class 'MonthDayNano'>")
SITE = os.path.join(HERE, "site-packages")
REQUIREMENTS = os.path.join(HERE, "requirements.txt")
WHEELS_LIMIT_MIB = 64
ANCHORS = ("trl_grpo.py", "trl_sft.py", "trl_dpo.py")
PIP_TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi",
              "none", "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform",
              "manylinux_2_24_x86_64", "--platform", "manylinux_2_28_x86_64"]
IMPORTS_NEEDED = ("trl", "datasets", "transformers", "pyarrow", "pandas", "rich", "pytest")


@dataclasses.dataclass(frozen=True)
class Mode:
    """What the kit runs: on a GPU, or --dry-run on a CPU (same parts, small sizes)."""

    name: str
    device: str
    precision: str
    deadline_s: float  # each call's
    weights: str = "fp32"  # the dtype the weights load in (on_device.py --weights: TRL's model_init_kwargs)
    model_flags: tuple = ()
    grpo: tuple = ()
    sft: tuple = ()
    dpo: tuple = ()
    decode: tuple = ()  # bench/gpu/decode.py's --rows and --tokens
    packed_rows: str = "4,16"
    logprob_positions: int = 8192
    longest_lengths: tuple = ()
    longest_flags: tuple = ()
    budgets: dict = dataclasses.field(default_factory=dict)  # part -> (nominal seconds, minimum seconds)


CHECKPOINTING = ("--gradient-checkpointing",)
GPU = Mode(
    name="gpu", device="cuda", precision="bf16", deadline_s=285, weights="bf16",
    model_flags=("--layers", "28", "--hidden", "1536", "--intermediate", "8960", "--heads", "12", "--kv-heads", "2",
                 "--dtype", "bfloat16"),  # Qwen2.5-1.5B
    grpo=("--completion", "1024", "--steps", "2", "--batch", "64", "--gens", "8", *CHECKPOINTING),
    sft=("--steps", "3", "--batch", "8", "--seq", "1024", *CHECKPOINTING),
    dpo=("--steps", "3", "--pairs", "8", "--prompt", "512", "--chosen", "256", "--rejected", "256", *CHECKPOINTING),
    decode=("--rows", "64", "--tokens", "1024"), packed_rows="4,16",
    logprob_positions=8192, longest_lengths=(1024, 2048, 4096, 8192, 16384),
    longest_flags=("--steps", "1", "--batch", "8", "--gens", "8", *CHECKPOINTING),
    budgets={"versions": (30, 5), "wheels": (60, 10), "model": (90, 30), "generation": (70, 30), "grpo": (90, 40),
             "sft": (30, 15), "dpo": (30, 15), "tests": (90, 30), "fsdp2": (60, 25), "packed": (30, 10),
             "logprobs": (25, 10), "longest": (10**6, 40)})

DRY_RUN = Mode(
    name="dry-run", device="cpu", precision="fp32", deadline_s=290,
    model_flags=("--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
                 "--vocab", "8192"),
    grpo=("--completion", "16", "--steps", "2", "--batch", "8", "--gens", "4", *CHECKPOINTING),
    sft=("--steps", "2", "--batch", "4", "--seq", "64", *CHECKPOINTING),
    dpo=("--steps", "2", "--pairs", "2", "--prompt", "32", "--chosen", "16", "--rejected", "16", *CHECKPOINTING),
    decode=("--rows", "4", "--tokens", "16"), packed_rows="4",
    logprob_positions=256, longest_lengths=(16, 32), longest_flags=("--steps", "1", "--batch", "8", "--gens", "8"),
    budgets={"versions": (30, 5), "wheels": (60, 10), "model": (60, 15), "generation": (60, 15), "grpo": (60, 20),
             "sft": (60, 15), "dpo": (60, 15), "tests": (150, 30), "fsdp2": (90, 30), "packed": (40, 10),
             "logprobs": (40, 10), "longest": (10**6, 30)})

SETUP = ("versions", "wheels", "model")
CALLS = {1: SETUP + ("generation", "grpo", "sft", "dpo"), 2: SETUP + ("tests", "fsdp2", "packed", "logprobs", "longest")}
SIDES = ("trl", "posttrain")
LONGEST_MIN_TRY_S = 15  # a try with less time than this left is not started


# ---------------------------------------------------------------- running parts


@dataclasses.dataclass
class Finished:
    """A subprocess that ended: exit status (None when stopped at its budget), outputs, seconds."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


class Clock:
    """The kit's deadline, and each part's share of what it leaves."""

    def __init__(self, mode: Mode, deadline_s: float, parts: tuple = CALLS[1]):
        self.mode, self.start, self.deadline_s, self.parts = mode, time.monotonic(), deadline_s, parts

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.deadline_s - self.elapsed()

    def budget(self, part: str, runs: int = 1) -> float:
        """Seconds one run of `part` may take: its nominal budget, cut so that every later part keeps its minimum;
        when that leaves less than its own minimum, its minimum (the parts come in order of importance); 0 when not
        even that is left. `runs`: the part's runs still to come, this one included (its minimum is kept for each of
        the others)."""
        nominal, minimum = self.mode.budgets[part]
        later = self.parts[self.parts.index(part) + 1:]
        reserve = sum(self.mode.budgets[p][1] for p in later) + (runs - 1) * minimum
        allowed = min(nominal, self.left() - reserve)
        if allowed >= minimum:
            return allowed
        return float(minimum) if self.left() >= minimum else 0.0


def run_command(cmd: list[str], timeout: float, env: dict, log_path: str) -> Finished:
    """Run `cmd` in the repository root in a session of its own; at `timeout` seconds the whole session (launchers'
    children included) is killed. Both outputs are kept in `log_path`."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(timeout, 1))
        code = proc.returncode
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # ended in the meantime
            pass
        out, err = proc.communicate()
        code = None
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n--- stdout\n{out}\n--- stderr\n{err}\n--- exit {code}\n\n")
    return Finished(code, out, err, time.monotonic() - start)


def json_lines(text: str) -> list[dict]:
    """The JSON objects printed one per line in `text`."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return found


EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")
LAUNCHER_ERRORS = ("CalledProcessError", "ChildFailedError")
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torchrun's prefix on a process's lines


def one_line_reason(finished: Finished, budget: float) -> str:
    """Why a run gave no result, in one line: its time budget, the last exception it printed (a launcher's own
    'child failed' excluded), or its last line."""
    if finished.timed_out:
        return f"stopped at its time budget ({budget:.0f} s)"
    lines = [RANK_PREFIX.sub("", line).strip() for line in finished.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if EXCEPTION_LINE.match(line) and not any(e in line for e in LAUNCHER_ERRORS)]
    if "out of memory" in finished.stderr and not any("out of memory" in e for e in errors):
        errors = [line for line in lines if "out of memory" in line]
    text = errors[-1] if errors else (lines[-1] if lines else f"exit status {finished.returncode}, nothing printed")
    return text[:220]


def ran_out_of_memory(finished: Finished) -> bool:
    """Whether a run that gave no result stopped at CUDA's out-of-memory error (torch.OutOfMemoryError)."""
    return not finished.timed_out and ("OutOfMemoryError" in finished.stderr or
                                       "CUDA out of memory" in finished.stderr)


@dataclasses.dataclass
class Result:
    """A part's outcome: `data` when it produced its figures, else `reason` (one line)."""

    data: object = None
    reason: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.data is not None


# ---------------------------------------------------------------- environment


def anchors_dir() -> str | None:
    """Where TRL's anchor scripts are: $SHARED, the copies fetch_wheels.sh made, or ../shared/bench."""
    for folder in (os.environ.get("SHARED"), ANCHOR_COPIES, os.path.join(ROOT, "..", "shared", "bench")):
        if folder and all(os.path.isfile(os.path.join(folder, a)) for a in ANCHORS):
            return os.path.abspath(folder)
    return None


def child_env(with_site: bool, extra: dict | None = None) -> dict:
    """The environment of every part: the repository (and the installed wheels) importable, the hub off, the
    anchors where posttrain's bench scripts look for make_rows()."""
    paths = ([SITE] if with_site else []) + [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if anchors_dir():
        env["SHARED"] = anchors_dir()
    env.update(extra or {})
    return env


def read_requirements() -> dict[str, str]:
    """normalised name -> pinned version, from bench/gpu/requirements.txt."""
    pins = {}
    for line in open(REQUIREMENTS):
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise SystemExit(f"{REQUIREMENTS}: {line!r} is not pinned: write it as name==version.")
            pins[normalise(name)] = version.strip()
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def check_wheels() -> dict:
    """The wheel list against the folder: {"listed", "missing": [name==version], "unlisted": [files], "total_mib"
    (every file in the folder), "limit_mib"}."""
    pins = read_requirements()
    files = sorted(os.listdir(WHEELS)) if os.path.isdir(WHEELS) else []
    found = {}
    for file in files:
        if file.endswith(".whl"):
            name, version = file.split("-")[:2]
            found[(normalise(name), version)] = file
    missing = [f"{n}=={v}" for n, v in pins.items() if (n, v) not in found]
    unlisted = [file for key, file in found.items() if pins.get(key[0]) != key[1]]
    total = sum(os.path.getsize(os.path.join(WHEELS, f)) for f in files)
    return {"folder": os.path.relpath(WHEELS, ROOT), "listed": len(pins), "present": len(pins) - len(missing),
            "missing": missing, "unlisted": unlisted, "total_mib": round(total / 2**20, 1),
            "limit_mib": WHEELS_LIMIT_MIB}


RECOMPRESS_MIN_BYTES = 1 << 20  # smaller wheels gain too little to be worth a pass


def recompress_wheel(path: str) -> tuple[int, int]:
    """Rewrite a wheel's zip entries with LZMA instead of deflate, in place: the same files, bytes, names, dates and
    permissions (so the same RECORD and hashes), about a quarter smaller for pyarrow's and pandas' compiled
    libraries. A wheel is a zip file, and pip reads any compression Python's zipfile reads. Returns (bytes before,
    after); a wheel already in LZMA is left as it is."""
    before = os.path.getsize(path)
    with zipfile.ZipFile(path) as source:
        if all(info.compress_type == zipfile.ZIP_LZMA for info in source.infolist()):
            return before, before
        partial = path + ".partial"
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_LZMA) as target:
            for info in source.infolist():
                entry = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                entry.external_attr, entry.create_system = info.external_attr, info.create_system
                target.writestr(entry, source.read(info), compress_type=zipfile.ZIP_LZMA)
    with zipfile.ZipFile(partial) as written:
        bad = written.testzip()
    if bad is not None:
        os.remove(partial)
        raise SystemExit(f"recompressing {path} gave a bad entry {bad}: keep the downloaded wheel and report it.")
    os.replace(partial, path)
    return before, os.path.getsize(path)


def recompress_wheels() -> None:
    """recompress_wheel on every wheel of the folder over RECOMPRESS_MIN_BYTES, saying what each saved."""
    for file in sorted(os.listdir(WHEELS)):
        path = os.path.join(WHEELS, file)
        if file.endswith(".whl") and os.path.getsize(path) > RECOMPRESS_MIN_BYTES:
            before, after = recompress_wheel(path)
            print(f"{file}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB", flush=True)


def wheels_problem(check: dict) -> str:
    """One sentence on what is wrong with the wheels folder, or ''."""
    if not os.path.isdir(WHEELS):
        return (f"{check['folder']} is missing: run bash bench/gpu/fetch_wheels.sh on a machine with the package index "
                "and bring bench/gpu/offline with the working tree.")
    if check["missing"]:
        return (f"{check['folder']} lacks {', '.join(check['missing'])}: run bash bench/gpu/fetch_wheels.sh again on a "
                "machine with the package index.")
    if check["total_mib"] >= WHEELS_LIMIT_MIB:
        return (f"the wheels take {check['total_mib']} MiB, not under the {WHEELS_LIMIT_MIB} MiB that travel with the "
                f"tree: remove {', '.join(check['unlisted']) or 'a package from bench/gpu/requirements.txt'}.")
    return ""


VERSIONS = ("torch", "transformers", "accelerate", "peft", "trl", "datasets", "pyarrow", "pytest")


def print_versions() -> None:
    """(run in a part's environment) One JSON line: the versions imported, the device, and one sentence per
    installed package outside posttrain's declared bounds."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement

    found = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        try:
            found[name] = md.version(name)
        except md.PackageNotFoundError:
            found[name] = None
    try:
        from posttrain import __version__ as posttrain_version

        found["posttrain"] = posttrain_version
    except ImportError:
        found["posttrain"] = None
    import torch

    found["cuda"] = torch.version.cuda
    found["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    found["bf16"] = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["peft"]]
    found["outside_bounds"] = [
        f"{r.name} {found[r.name]} is outside posttrain's declared bounds ({r.specifier}): the kit runs what it can, "
        "and a failure below may come from that." for r in declared
        if found.get(r.name) and r.specifier and not r.specifier.contains(found[r.name], prereleases=True)]
    print(json.dumps(found))


# ---------------------------------------------------------------- the kit


class Kit:
    def __init__(self, mode: Mode, work: str, deadline_s: float, call: int = 1):
        self.mode, self.work, self.call = mode, work, call
        self.clock = Clock(mode, deadline_s, CALLS[call])
        self.logs = os.path.join(work, "logs")
        shutil.rmtree(self.logs, ignore_errors=True)
        os.makedirs(self.logs)
        self.model_dir = os.path.join(work, "model")
        self.results: dict[str, Result] = {}
        self.site_ready = False
        self.threads = str(min(8, os.cpu_count() or 2)) if mode.device == "cuda" else "2"

    # -- helpers

    def say(self, text: str) -> None:
        print(f"[{self.clock.elapsed():5.0f} s] {text}", flush=True)

    def env(self, **extra) -> dict:
        return child_env(self.site_ready, extra)

    def python(self, args: list[str], part: str, budget: float, log: str | None = None, **env) -> Finished:
        return run_command([sys.executable, *args], budget, self.env(**env),
                           os.path.join(self.logs, f"{log or part}.log"))

    def record(self, key: str, result: Result) -> Result:
        self.results[key] = result
        state = f"done in {result.seconds:.0f} s" if result.ok else f"no result: {result.reason}"
        self.say(f"{key}: {state}")
        return result

    def skipped(self, key: str) -> Result:
        minimum = self.mode.budgets[key.split("-")[0]][1]
        return self.record(key, Result(reason=f"skipped: less than its minimum ({minimum} s) was left of the "
                                              f"{self.clock.deadline_s:.0f} s deadline"))

    # -- parts

    def versions(self) -> None:
        budget = self.clock.budget("versions")
        finished = self.python([__file__, "--versions"], "versions", budget)
        lines = json_lines(finished.stdout)
        result = Result(lines[-1], seconds=finished.seconds) if lines else Result(
            reason=one_line_reason(finished, budget), seconds=finished.seconds)
        self.record("versions", result)
        if result.ok:
            for sentence in result.data["outside_bounds"]:
                self.say(sentence)

    def wheels(self) -> None:
        check = check_wheels()
        problem = wheels_problem(check)
        budget = self.clock.budget("wheels")
        if self.mode.name == "dry-run":
            self.record("wheels", self.pip_would_install(check, problem, budget))
            return
        if problem:
            if self.imports_work(budget):  # everything already installed on this machine: go on without the wheels
                self.record("wheels", Result({**check, "installed": "nothing (all importable already)"}))
            else:
                self.record("wheels", Result(reason=problem))
            return
        self.record("wheels", self.install_offline(check, budget))

    def pip_would_install(self, check: dict, problem: str, budget: float) -> Result:
        """--dry-run: pip's resolver, offline, on the listed wheels for CPython 3.12 manylinux, installing nothing."""
        if problem:
            return Result(reason=problem)
        target = tempfile.mkdtemp(prefix="kit-pip-")
        finished = self.python(["-m", "pip", "install", "--dry-run", "--no-index", "--no-deps", "--only-binary=:all:",
                                "--disable-pip-version-check", "--find-links", WHEELS, "--target", target,
                                *PIP_TARGET, "-r", REQUIREMENTS], "wheels", budget)
        shutil.rmtree(target, ignore_errors=True)
        if finished.returncode != 0:
            return Result(reason=one_line_reason(finished, budget), seconds=finished.seconds)
        return Result({**check, "installed": "nothing (dry run: pip would install every listed wheel on CPython "
                                             "3.12 manylinux x86_64)"}, seconds=finished.seconds)

    def install_offline(self, check: dict, budget: float) -> Result:
        """pip install --no-index --no-deps --target bench/gpu/site-packages (or, without pip, the wheels unpacked
        there); skipped when the folder already holds exactly these wheels."""
        stamp = hashlib.sha256((open(REQUIREMENTS).read() + "".join(sorted(os.listdir(WHEELS)))).encode()).hexdigest()
        stamp_file = os.path.join(SITE, ".kit-stamp")
        if os.path.isfile(stamp_file) and open(stamp_file).read() == stamp:
            self.site_ready = True
            return Result({**check, "installed": f"already in {os.path.relpath(SITE, ROOT)}"})
        shutil.rmtree(SITE, ignore_errors=True)
        finished = self.python(["-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
                                "--quiet", "--find-links", WHEELS, "--target", SITE, "-r", REQUIREMENTS], "wheels",
                               budget)
        how = f"offline with pip into {os.path.relpath(SITE, ROOT)}"
        if finished.returncode != 0 and "No module named pip" in finished.stderr:
            unpack_wheels(WHEELS, SITE, read_requirements())
            how = f"unpacked into {os.path.relpath(SITE, ROOT)} (this Python has no pip)"
        elif finished.returncode != 0:
            return Result(reason=one_line_reason(finished, budget), seconds=finished.seconds)
        self.site_ready = True
        if not self.imports_work(max(self.clock.budget("wheels"), 10)):
            return Result(reason=self.import_problem, seconds=finished.seconds)
        open(stamp_file, "w").write(stamp)
        return Result({**check, "installed": how}, seconds=finished.seconds)

    def imports_work(self, budget: float) -> bool:
        """Whether the packages the parts need import here; the failure's one line is kept in import_problem."""
        code = "import " + ", ".join(IMPORTS_NEEDED)
        finished = self.python(["-c", code], "wheels", budget)
        self.import_problem = (f"after the install, `{code}` fails: {one_line_reason(finished, budget)} (add the "
                               "missing package to bench/gpu/requirements.txt and fetch the wheels again)")
        return finished.returncode == 0

    def model(self) -> None:
        budget = self.clock.budget("model")
        flags = list(self.mode.model_flags)
        stamp_file = os.path.join(self.model_dir, "kit-flags.json")
        if os.path.isfile(stamp_file) and json.load(open(stamp_file))["flags"] == flags:
            self.record("model", Result(json.load(open(stamp_file))["built"]))
            return
        shutil.rmtree(self.model_dir, ignore_errors=True)
        finished = self.python([os.path.join(BENCH, "make_qwen_shape.py"), self.model_dir, *flags], "model", budget)
        lines = json_lines(finished.stdout)
        if finished.returncode != 0 or not lines:
            self.record("model", Result(reason=one_line_reason(finished, budget), seconds=finished.seconds))
            return
        json.dump({"flags": flags, "built": lines[-1]}, open(stamp_file, "w"))
        self.record("model", Result(lines[-1], seconds=finished.seconds))

    def script(self, side: str, kind: str) -> str:
        """The bench script of `side` for `kind` (grpo, sft, dpo)."""
        if side == "trl":
            return os.path.join(anchors_dir() or ANCHOR_COPIES, f"trl_{kind}.py")
        return os.path.join(BENCH, f"{kind}_step.py")

    def on_device(self, side: str, kind: str, flags: list[str]) -> list[str]:
        return [os.path.join(HERE, "on_device.py"), "--device", self.mode.device, "--precision", self.mode.precision,
                "--weights", self.mode.weights, self.script(side, kind), self.model_dir, *flags, "--threads",
                self.threads]

    def device_flags(self) -> list[str]:
        return ["--device", self.mode.device, "--precision", self.mode.precision, "--weights", self.mode.weights,
                "--threads", self.threads]

    def json_part(self, part: str, script: str, args: list[str], key: str) -> None:
        """A part that runs one of bench/gpu's scripts on the model and records the `key` object of its JSON line."""
        budget = self.clock.budget(part)
        if not budget:
            self.skipped(part)
            return
        if not self.results["model"].ok:
            self.record(part, Result(reason="no model (see the model part)"))
            return
        finished = self.python([os.path.join(HERE, script), self.model_dir, *args], part, budget)
        lines = [line[key] for line in json_lines(finished.stdout) if key in line]
        self.record(part, Result(lines[-1], seconds=finished.seconds) if finished.returncode == 0 and lines
                    else Result(reason=one_line_reason(finished, budget), seconds=finished.seconds))

    def generation(self) -> None:
        self.json_part("generation", "decode.py", [*self.mode.decode, *self.device_flags()], "decode")

    def packed(self) -> None:
        args = ["--device", self.mode.device, "--weights", self.mode.weights, "--rows", self.mode.packed_rows,
                "--threads", self.threads]
        self.json_part("packed", "packed_rows.py", args, "packed_rows")

    def bench_run(self, key: str, finished: Finished, budget: float) -> Result:
        """A bench script's JSON line merged with on_device.py's, or why there is none."""
        lines = json_lines(finished.stdout)
        figures = [line for line in lines if "s_per_step" in line]
        kit = [line["kit"] for line in lines if "kit" in line]
        if finished.returncode != 0 or not figures or not kit:
            return Result(reason=one_line_reason(finished, budget), seconds=finished.seconds)
        return Result({**figures[-1], **kit[-1]}, seconds=finished.seconds)

    def steps(self, kind: str) -> None:
        flags = list(getattr(self.mode, kind))
        for i, side in enumerate(SIDES):
            key = f"{kind}-{side}"
            budget = self.clock.budget(kind, runs=len(SIDES) - i)
            if not budget:
                self.skipped(key)
                continue
            if not self.results["model"].ok:
                self.record(key, Result(reason="no model (see the model part)"))
                continue
            if (side == "trl" or kind != "grpo") and not anchors_dir():  # posttrain's SFT and DPO read their rows
                whose = "TRL's anchor scripts" if side == "trl" else f"TRL's anchor trl_{kind}.py (its make_rows)"
                self.record(key, Result(reason=f"{whose} were not found: run bash bench/gpu/fetch_wheels.sh (it "
                                               "copies the anchors to bench/gpu/offline/anchors) or set SHARED."))
                continue
            finished = self.python(self.on_device(side, kind, flags), kind, budget, log=key)
            self.record(key, self.bench_run(key, finished, budget))

    def logprobs(self) -> None:
        budget = self.clock.budget("logprobs")
        if not budget:
            self.skipped("logprobs")
            return
        built = self.results["model"].data or {}
        finished = self.python([os.path.join(HERE, "logprob_paths.py"), "--device", self.mode.device, "--precision",
                                self.mode.precision, "--positions", str(self.mode.logprob_positions), "--hidden",
                                str(built.get("hidden", 896)), "--vocab", str(built.get("embedding", 151936)),
                                "--threads", self.threads], "logprobs", budget)
        lines = json_lines(finished.stdout)
        self.record("logprobs", Result(lines[-1], seconds=finished.seconds) if finished.returncode == 0 and lines
                    else Result(reason=one_line_reason(finished, budget), seconds=finished.seconds))

    def fsdp2(self) -> None:
        budget = self.clock.budget("fsdp2")
        if not budget:
            self.skipped("fsdp2")
            return
        if not self.results["model"].ok:
            self.record("fsdp2", Result(reason="no model (see the model part)"))
            return
        launch = ["-m", "accelerate.commands.launch", "--config_file",
                  os.path.join(ROOT, "posttrain", "accelerate_configs", "fsdp2.yaml"), "--num_processes", "1",
                  "--num_machines", "1", "--main_process_port", "0", "--mixed_precision",
                  "bf16" if self.mode.precision == "bf16" else "no"]
        finished = self.python(launch + self.on_device("posttrain", "grpo", list(self.mode.grpo)), "fsdp2", budget,
                               OMP_NUM_THREADS=self.threads)
        result = self.bench_run("fsdp2", finished, budget)
        if result.ok and result.data["distributed_type"] != "FSDP":
            result = Result(reason=f"accelerate ran it as {result.data['distributed_type']}, not FSDP",
                            seconds=result.seconds)
        self.record("fsdp2", result)

    def tests(self) -> None:
        budget = self.clock.budget("tests")
        if not budget:
            self.skipped("tests")
            return
        extra = {"POSTTRAIN_GPU_TESTS_ON_CPU": "1"} if self.mode.name == "dry-run" else {}
        files = ["tests/test_gpu.py", "tests/test_fixed_shape_decode.py"]
        finished = self.python(["-m", "pytest", *files, "-q", "-rfEs", "-p", "no:cacheprovider"], "tests", budget,
                               **extra)
        summary = [line.strip("= ") for line in finished.stdout.splitlines() if re.search(r"\d+ (passed|failed|"
                                                                                          r"skipped|error)", line)]
        failed = [line.split(" - ")[0].replace("FAILED ", "").replace("ERROR ", "")
                  for line in finished.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        if finished.timed_out or not summary:
            self.record("tests", Result(reason=one_line_reason(finished, budget), seconds=finished.seconds))
            return
        self.record("tests", Result({"summary": summary[-1], "failed": failed, "passed": finished.returncode == 0},
                                    seconds=finished.seconds))

    def longest(self) -> None:
        """Each side in turn, with half of what is left (the second side gets what the first did not use)."""
        for i, side in enumerate(SIDES):
            key = f"longest-{side}"
            share, minimum = self.clock.left() / (len(SIDES) - i), self.mode.budgets["longest"][1]
            if share < minimum <= self.clock.left():  # too short to share: this side takes what there is
                share = self.clock.left()
            if share < minimum or not self.results["model"].ok:
                self.record(key, Result(reason="no model (see the model part)" if not self.results["model"].ok
                                        else f"skipped: {share:.0f} s were left for it"))
                continue
            if side == "trl" and not anchors_dir():
                self.record(key, Result(reason="TRL's anchor scripts were not found (see the GRPO row)."))
                continue
            self.record(key, self.ascending_lengths(side, time.monotonic() + share))

    def ascending_lengths(self, side: str, until: float) -> Result:
        """Try the mode's completion lengths from the small end, up to the first that runs out of memory (or fails,
        or finds the time spent). Returns the tries in order."""
        tries, start = [], time.monotonic()
        for length in self.mode.longest_lengths:
            budget = until - time.monotonic()
            if budget < LONGEST_MIN_TRY_S:
                tries.append({"completion": length, "outcome": "not tried: the time budget was spent"})
                break
            flags = [*self.mode.longest_flags, "--completion", str(length)]
            finished = self.python(self.on_device(side, "grpo", flags), "longest", budget, log=f"longest-{side}")
            run = self.bench_run("longest", finished, budget)
            if run.ok:
                tries.append({"completion": length, "outcome": "trained", "s_per_step": run.data["s_per_step"],
                              "peak_gpu_mib": run.data.get("peak_gpu_mib"),
                              "peak_reserved_mib": run.data.get("peak_reserved_mib"),
                              "peak_rss_mib": run.data.get("peak_rss_mib")})
                continue
            tries.append({"completion": length,
                          "outcome": "out of memory" if ran_out_of_memory(finished) else run.reason})
            break
        trained = [t["completion"] for t in tries if t["outcome"] == "trained"]
        return Result({"longest": max(trained) if trained else None, "tries": tries},
                      seconds=time.monotonic() - start)

    # -- the whole run

    def run(self) -> int:
        self.say(f"posttrain GPU kit, call {self.call} ({', '.join(CALLS[self.call])}), {self.mode.name}: "
                 f"{self.mode.device}, {self.mode.precision}; work folder {self.work}; deadline "
                 f"{self.clock.deadline_s:.0f} s")
        self.versions()
        stop = self.wrong_machine()
        if stop:
            self.say(stop)
            return 2
        self.wheels()
        if self.site_ready:  # what the parts import now
            self.versions()
        self.model()
        for part in CALLS[self.call][len(SETUP):]:
            if part in ("grpo", "sft", "dpo"):
                self.steps(part)
            else:
                getattr(self, part)()
        print()
        print(Table(self).render(), flush=True)
        return 0

    def wrong_machine(self) -> str:
        """One sentence when this machine cannot run the mode asked for, else ''."""
        versions = self.results["versions"]
        if not versions.ok:
            return f"the kit cannot read this Python's packages: {versions.reason}"
        if self.mode.device == "cuda" and versions.data["device"] == "cpu":
            return ("torch sees no CUDA device here: run the kit on the GPU machine, or bash bench/gpu/run.sh "
                    "--dry-run to exercise it on this CPU.")
        if self.mode.device == "cuda" and not versions.data["bf16"]:
            return (f"{versions.data['device']} has no bfloat16 support, and the kit measures bf16 steps: run it on an "
                    "Ampere or newer GPU (H100 class).")
        return ""


def unpack_wheels(folder: str, target: str, pins: dict[str, str]) -> None:
    """Without pip: unzip each listed wheel into `target` (what pip --target does for these wheels, scripts aside)."""
    os.makedirs(target, exist_ok=True)
    for file in os.listdir(folder):
        name, version = file.split("-")[:2]
        if file.endswith(".whl") and pins.get(normalise(name)) == version:
            with zipfile.ZipFile(os.path.join(folder, file)) as wheel:
                wheel.extractall(target)


# ---------------------------------------------------------------- the table


def number(value, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


class Table:
    """The kit's report, from its results: plain text, one section per part."""

    def __init__(self, kit: Kit):
        self.kit, self.mode, self.results = kit, kit.mode, kit.results
        versions = self.results["versions"].data or {}
        self.versions = versions
        self.trl = f"TRL {versions.get('trl') or '?'}"

    def why_not(self, key: str) -> str:
        """Why the part `key` has no figures ('not run', or its one-line reason); '' when it has them."""
        result = self.results.get(key)
        return "" if result is not None and result.ok else (result.reason if result else "not run")

    def render(self) -> str:
        if self.kit.call == 1:
            sections = [self.header(), self.generation(), self.steps(("grpo", "sft", "dpo"))]
        else:
            sections = [self.header(), self.tests(), self.steps(("fsdp2",)), self.packed(), self.logprobs(),
                        self.longest()]
        return "\n\n".join(s for s in sections + [self.footer()] if s)

    def header(self) -> str:
        v, dry = self.versions, self.mode.name == "dry-run"
        title = (f"posttrain GPU kit, call {self.kit.call}, DRY RUN on the CPU (float32, a small model of the same kind):"
                 " every part ran, its figures are not GPU measurements" if dry else
                 f"posttrain GPU kit, call {self.kit.call}, on {v.get('device', '?')}: bf16 weights (TRL's "
                 "model_init_kwargs dtype), bf16 autocast, gradient checkpointing on")
        built = self.results["model"].data
        model = (f"model: {'a small variant of ' if dry else ''}Qwen2.5-1.5B's shape, {built['params_m']}M parameters, "
                 f"{built['layers']} layers, hidden {built['hidden']}, vocabulary {built['embedding']:,} "
                 "(random weights)" if built else f"model: none ({self.results['model'].reason})")
        names = ("python", "torch", "transformers", "accelerate", "peft", "trl", "datasets", "pyarrow", "pytest",
                 "posttrain")
        versions = " | ".join(f"{n} {v.get(n) or 'missing'}" for n in names)
        if v.get("cuda"):
            versions += f" | CUDA {v['cuda']}"
        lines = [title, model, "versions: " + versions]
        lines += v.get("outside_bounds", [])
        wheels = self.results.get("wheels")
        if wheels is not None:
            lines.append(f"wheels: {wheels.data['present']}/{wheels.data['listed']} listed wheels present, "
                         f"{wheels.data['total_mib']} MiB (limit {wheels.data['limit_mib']} MiB); installed: "
                         f"{wheels.data['installed']}" if wheels.ok else f"wheels: {wheels.reason}")
        return "\n".join(lines)

    def steps(self, kinds: tuple) -> str:
        peak = "peak GPU MiB allocated / reserved" if self.mode.device == "cuda" else "peak RSS MiB (CPU)"
        lines = ["Training steps: each side's own bench script, the same rows and flags (s/step = train()'s wall / "
                 "steps, as the anchors report it; steady = median of steps 2..N; tok/s as the anchors count them: "
                 "GRPO completion tokens, SFT and DPO every token of the rows)",
                 f"| workload | side | s/step | steady s/step | {peak} | tok/s | posttrain / TRL |",
                 "|---|---|---|---|---|---|---|"]
        for kind in kinds:
            if kind == "fsdp2":
                lines.append(self.step_row(f"GRPO under FSDP2, one process, {' '.join(self.mode.grpo)}", "fsdp2",
                                           "posttrain"))
                continue
            workload = f"{kind.upper()} {' '.join(getattr(self.mode, kind))}"
            for side in SIDES:
                lines.append(self.step_row(workload if side == "trl" else "", kind, side))
        return "\n".join(lines)

    def step_row(self, workload: str, kind: str, side: str) -> str:
        key = "fsdp2" if kind == "fsdp2" else f"{kind}-{side}"
        label = "posttrain (FSDP2)" if kind == "fsdp2" else (self.trl if side == "trl" else "posttrain")
        if self.why_not(key):
            return f"| {workload} | {label} | {self.why_not(key)} | | | | |"
        d = self.results[key].data
        peak = (f"{number(d.get('peak_gpu_mib'))} / {number(d.get('peak_reserved_mib'))}" if self.mode.device == "cuda"
                else number(d.get("peak_rss_mib")))
        tokens = d.get("completion_tok_per_s", d.get("tok_per_s"))
        return (f"| {workload} | {label} | {d['s_per_step']:.3f} | {number(d.get('step_s_median'), 3)} | "
                f"{peak} | {number(tokens)} | {self.ratio(kind, side)} |")

    def ratio(self, kind: str, side: str) -> str:
        """posttrain / TRL (the FSDP2 row: / posttrain unsharded) of s/step and peak memory."""
        if side == "trl":
            return ""
        mine = self.results.get("fsdp2" if kind == "fsdp2" else f"{kind}-posttrain")
        other = self.results.get("grpo-posttrain" if kind == "fsdp2" else f"{kind}-trl")
        if not (mine and mine.ok and other and other.ok):
            return "-"
        key = "peak_gpu_mib" if self.mode.device == "cuda" else "peak_rss_mib"
        parts = [f"s/step {mine.data['s_per_step'] / other.data['s_per_step']:.2f}"]
        if mine.data.get(key) and other.data.get(key):
            parts.append(f"peak {mine.data[key] / other.data[key]:.2f}")
        return ", ".join(parts) + (" (of unsharded posttrain)" if kind == "fsdp2" else "")

    def generation(self) -> str:
        if self.why_not("generation"):
            return f"Generation: {self.why_not('generation')}"
        d = self.results["generation"].data
        lines = [f"Generation timed on its own: {d['rows']} rows x {d['tokens']} tokens each (min_new_tokens), "
                 f"{d['precision']} run, {d['weights']} weights, on {d['device']}",
                 "| decoder | s | ms/token | tokens/s | peak MiB allocated / reserved |", "|---|---|---|---|---|"]
        names = {"posttrain": "posttrain (lean decoder, growing shapes)",
                 "posttrain_static": "posttrain, cache_implementation=static (fixed shapes, a CUDA graph on CUDA)",
                 "transformers_generate": "transformers generate (TRL's in-process path)"}
        for key, name in names.items():
            p = d.get(key, {})
            if "error" in p:
                lines.append(f"| {name} | {p['error']} | | | |")
                continue
            lines.append(f"| {name} | {p['s']:.2f} | {p['ms_per_token']:.2f} | {number(p['tokens_per_s'])} | "
                         f"{number(p['peak_allocated_mib'])} / {number(p['peak_reserved_mib'])} |")
        prof = d.get("step_profile", {})
        if "error" in prof:
            lines.append(f"One decode step under the profiler: {prof['error']}")
        else:
            top = "; ".join(f"{t['name']} x{t['count_per_step']} {t['ms_per_step']} ms" for t in prof["top"])
            lines.append(f"One decode step under the profiler (the growing lean decoder): {prof['kernels_per_step']} "
                         f"{'kernels' if self.mode.device == 'cuda' else 'operators'} per step, host "
                         f"{prof['cpu_ms_per_step']} ms, device {number(prof['device_ms_per_step'], 3)} ms; "
                         f"costliest: {top}")
        return "\n".join(lines)

    def packed(self) -> str:
        if self.why_not("packed"):
            return f"Packed rows against alone: {self.why_not('packed')}"
        d = self.results["packed"].data
        lines = [f"Packed rows against each rollout alone (GRPO's log-prob pass), {d['weights']} weights on "
                 f"{d['device']}: max |log-prob difference| over completion tokens",
                 "| attention kernel | layouts kept apart | rows: packed taken, max abs diff |", "|---|---|---|"]
        for kernel, p in d.items():
            if kernel in ("device", "weights"):
                continue
            if "error" in p:
                lines.append(f"| {kernel} | {p['error']} | |")
                continue
            kept = ", ".join(k for k, v in p["layouts"].items() if v) or "none (padded rows)"
            runs = "; ".join(f"{n}: {'packed' if r['packed_taken'] else 'padded'}, {r['max_abs_diff']:.2e}"
                             for n, r in p.items() if n != "layouts")
            lines.append(f"| {kernel} | {kept} | {runs} |")
        return "\n".join(lines)

    def logprobs(self) -> str:
        if self.why_not("logprobs"):
            return f"Log-probs through the output layer: {self.why_not('logprobs')}"
        d = self.results["logprobs"].data
        names = {"whole-logits": "whole logits, log_softmax + gather", "trl-selective":
                 f"{self.trl} selective_log_softmax on whole logits", "trl-fused-head":
                 f"{self.trl} fused LM head (ChunkedLogProbFunction)", "posttrain": "posttrain chunked_token_logprobs"}
        lines = [f"Log-probs with gradient through the output layer: {d['positions']:,} positions x {d['vocab']:,} "
                 f"vocabulary, hidden {d['hidden']}, {d['precision']} on {d['device']} (whole logits: "
                 f"{d['whole_logits_mib']:,} MiB); errors against float64 on the same inputs",
                 "| path | seconds | peak extra GPU MiB | max abs err log-prob | max rel err d/dh | max rel err d/dW |",
                 "|---|---|---|---|---|---|"]
        for key, name in names.items():
            p = d.get(key, {})
            if "error" in p:
                lines.append(f"| {name} | {p['error']} | | | | |")
                continue
            lines.append(f"| {name} | {p['seconds']:.4f} | {number(p['peak_extra_mib'])} | {p['max_abs_err_logp']:.2e} "
                         f"| {p['max_rel_err_grad_h']:.2e} | {p['max_rel_err_grad_w']:.2e} |")
        return "\n".join(lines)

    def longest(self) -> str:
        lengths = ", ".join(str(n) for n in self.mode.longest_lengths)
        lines = [f"Longest GRPO completion each side trains: 8 completions of one prompt, one step, "
                 f"{self.mode.precision}, lengths tried from the small end: {lengths}",
                 "| side | longest that trained | tries, in order |", "|---|---|---|"]
        for side in SIDES:
            key, label = f"longest-{side}", self.trl if side == "trl" else "posttrain"
            if self.why_not(key):
                lines.append(f"| {label} | - | {self.why_not(key)} |")
                continue
            data = self.results[key].data
            tries = "; ".join(self.describe_try(t) for t in data["tries"]) or "none"
            lines.append(f"| {label} | {number(data['longest'])} | {tries} |")
        return "\n".join(lines)

    def describe_try(self, attempt: dict) -> str:
        if attempt["outcome"] != "trained":
            return f"{attempt['completion']}: {attempt['outcome']}"
        peak = (f"{number(attempt['peak_gpu_mib'])} / {number(attempt.get('peak_reserved_mib'))} MiB GPU allocated / "
                "reserved" if self.mode.device == "cuda"
                else f"{number(attempt['peak_rss_mib'])} MiB RSS")
        return f"{attempt['completion']}: trained ({attempt['s_per_step']:.1f} s, {peak})"

    def tests(self) -> str:
        where = ", on the CPU: POSTTRAIN_GPU_TESTS_ON_CPU=1" if self.mode.name == "dry-run" else ""
        title = f"Tests (tests/test_gpu.py{where}, tests/test_fixed_shape_decode.py)"
        if self.why_not("tests"):
            return f"{title}: {self.why_not('tests')}"
        data = self.results["tests"].data
        failed = f"; failed: {', '.join(data['failed'])}" if data["failed"] else ""
        return f"{title}: {data['summary']}{failed}"

    def footer(self) -> str:
        return (f"Kit time: {self.kit.clock.elapsed():.0f} s of a {self.kit.clock.deadline_s:.0f} s deadline; "
                f"logs in {self.kit.logs}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="run every part on this CPU, small, in float32")
    ap.add_argument("--work", default=None, help="folder for the model and the logs (default: under the temp folder)")
    ap.add_argument("--call", type=int, choices=sorted(CALLS), default=None,
                    help="which of the kit's two calls to run (each under 5 minutes; the module's docstring)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the call (GPU 285, dry run 290)")
    ap.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--check-wheels", action="store_true",
                    help="check bench/gpu/offline/wheels against requirements.txt and its size, and exit")
    ap.add_argument("--recompress-wheels", action="store_true",
                    help="rewrite the large wheels of bench/gpu/offline/wheels with LZMA (fetch_wheels.sh does it)")
    args = ap.parse_args()
    if args.recompress_wheels:
        recompress_wheels()
        return 0
    if args.versions:
        print_versions()
        return 0
    if args.check_wheels:
        check = check_wheels()
        print(json.dumps(check))
        problem = wheels_problem(check)
        if problem:
            print(problem, file=sys.stderr)
        return 1 if problem else 0
    mode = DRY_RUN if args.dry_run else GPU
    work = args.work or os.path.join(tempfile.gettempdir(), "posttrain-gpu-kit", mode.name)
    os.makedirs(work, exist_ok=True)
    if args.call is None:
        ap.error("--call 1 or --call 2: the kit runs in two calls of under 5 minutes each (the module's docstring)")
    return Kit(mode, work, args.deadline or mode.deadline_s, args.call).run()


if __name__ == "__main__":
    sys.exit(main())
