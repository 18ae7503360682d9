"""Sharded training through accelerate's own FSDP1, FSDP2 and DeepSpeed ZeRO-2/ZeRO-3 paths, on 2 gloo processes (CPU).

Each case runs `posttrain grpo|rloo|sft|dpo|reward|kto|distillation` as a user launches it (`accelerate launch --config_file <shipped config>`),
with the test-only patch of tests/accelerate_on_cpu.py that lets accelerate select FSDP or DeepSpeed without a GPU.
ZeRO-3 runs with the shipped zero3.yaml's settings and, in `zero3-all`, with every parameter partitioned
(`stage3_param_persistence_threshold: 0`: DeepSpeed keeps parameters under 100k elements whole by default, which
is every parameter of the tiny test model). FSDP1 runs as `fsdp1-cpu`: the shipped fsdp1.yaml without its
RAM-efficient loading (torch's FSDP1 builds the other processes' weights from the main one's only on a GPU,
sync_module_states). GRPO's two
processes sample completions of different lengths (the model's EOS is likely at some positions: one process's
decode ends long before the other's); GRPO and RLOO (beta > 0) DPO and KTO have a reference model, sharded as the policy (mixed
toward the policy every step, sync_ref_model, and restored from the checkpoint). `grpo-lora` trains a LoRA adapter
(no dropout, so that the runs compare), its weights sharded with the rest: the saved adapter holds all 8 LoRA
weights whole, and resuming loads it back into the shards. `grpo-vlm` and `sft-vlm` train a tiny LLaVA (loaded by path,
its processor with AutoProcessor) on image rows under FSDP2 and ZeRO-3 (and SFT under DDP): GRPO samples each process's
image prompts with their pixels (a row samples the same beside any rows), and resuming restores its buffered image
rows.
Every run a strategy's tests need runs in one launch of two processes (and the resumes in a second, fresh one): on the
tiny model a launch's time is mostly imports. Against one process with the same global batch (SGD with momentum, so the
comparison is not amplified by Adam's normalisation):
  - every step's loss and metrics are equal, and the weights after 2 steps equal to float rounding;
  - the saved model loads with `from_pretrained` (plain names, tied weights once) and gives the same logits;
  - resuming from the step-1 checkpoint (optimizer state included) gives the uninterrupted run's weights bit for
    bit.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(ROOT, "posttrain", "accelerate_configs")
pytestmark = [pytest.mark.multiproc, pytest.mark.sharded]
# the logs tests/multiproc_sharded.py writes while these are set: each log-prob pass's path, each shared pass
PATH_LOG, SHARED_LOG = "POSTTRAIN_TEST_PATH_LOG", "POSTTRAIN_TEST_SHARED_LOG"


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
                TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")


@pytest.fixture(scope="session")
def workload(tmp_path_factory, tokenizer):
    """A tiny model whose EOS embedding is long (GRPO's completions end at 1 to 16 tokens) and each command's data:
    16 prompts, 16 prompt-completion pairs, 16 preference pairs."""
    from posttrain.testing import tiny_model

    root = tmp_path_factory.mktemp("sharded")
    model = tiny_model(tokenizer, hidden=32, layers=2)
    with torch.no_grad():
        row = model.model.embed_tokens.weight[tokenizer.eos_token_id]
        row.mul_(4.0 / row.norm())
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    teacher = tiny_model(tokenizer, seed=7, hidden=64, layers=2)  # distillation's: wider, the same vocabulary
    teacher.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    rows = {"grpo": lambda a, b, i: {"prompt": f"{a}+{b}="}, "rloo": lambda a, b, i: {"prompt": f"{a}+{b}="},
            "distillation": lambda a, b, i: {"prompt": f"{a}+{b}="},
            "sft": lambda a, b, i: {"prompt": f"{a}+{b}=", "completion": str(a + b) * (1 + i % 3)},
            "dpo": lambda a, b, i: {"prompt": f"{a}+{b}=", "chosen": str(a + b) * (1 + i % 3),
                                    "rejected": str(a + b + 1)},
            "reward": lambda a, b, i: {"prompt": f"{a}+{b}=", "chosen": str(a + b) * (1 + i % 3),
                                       "rejected": str(a + b + 1) + "x" * (i % 2)},
            "kto": lambda a, b, i: {"prompt": f"{a}+{b}=", "completion": str(a + b + i % 3) * (1 + i % 2),
                                    "label": i % 3 == 0}}
    for command, row in rows.items():
        with open(root / f"{command}.jsonl", "w") as f:
            for i in range(16):
                f.write(json.dumps(row(*divmod(i, 4), i)) + "\n")
    # the vision-language runs: a tiny LLaVA loaded by path (its processor with AutoProcessor), saved image datasets
    from datasets import Dataset

    from posttrain.testing import save_tiny_vision
    from tests import vlm_data

    save_tiny_vision(str(root / "vlm"), seed=1)
    Dataset.from_list(vlm_data.prompt_only(16)).save_to_disk(str(root / "grpo-vlm"))
    Dataset.from_list(vlm_data.language_modeling(16)).save_to_disk(str(root / "sft-vlm"))
    return root


# what each command needs besides the common flags, and the metrics that must match one process's
COMMANDS = {
    # GRPO and DPO: a sharded reference, mixed toward the policy every step and checkpointed; GRPO's micro-batches run
    # as passes of at most 24 completion tokens, as many on each process although their completions' widths differ
    "grpo": (["--reward_funcs", "length", "--num_generations", "4", "--max_completion_length", "16", "--beta",
              "0.04", "--sync_ref_model", "true", "--ref_model_sync_steps", "1",
              "--max_completion_tokens_per_pass", "24"],
             ["loss", "reward", "kl", "completions/mean_length", "completions/min_length", "completions/max_length"]),
    # LoRA: the adapter's parameters sharded with the rest; the saved adapter holds every LoRA weight, whole
    "grpo-lora": (["--reward_funcs", "length", "--num_generations", "4", "--max_completion_length", "16", "--beta",
                   "0.04", "--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0"],
                  ["loss", "reward", "kl", "completions/mean_length"]),
    # completions at full length (nothing for packing to remove): the prompts are shared where the test asks for it
    "grpo-shared": (["--reward_funcs", "multiproc_rewards.digit_share", "--num_generations", "4",
                     "--max_completion_length", "16", "--beta", "0.04", "--generation_kwargs",
                     '{"min_new_tokens": 16}'], ["loss", "reward", "kl"]),
    # RLOO: GRPO's round with the leave-one-out advantage, the KL a reward penalty from a sharded reference
    "rloo": (["--reward_funcs", "length", "--num_generations", "4", "--max_completion_length", "16", "--beta",
              "0.04", "--sync_ref_model", "true", "--ref_model_sync_steps", "1"],
             ["loss", "reward", "reward_std", "kl", "completions/mean_length", "completions/min_length",
              "completions/max_length", "clip_ratio/region_mean"]),
    "sft": (["--train_sampling_strategy", "sequential"], ["loss", "num_tokens", "mean_token_accuracy"]),
    "dpo": (["--train_sampling_strategy", "sequential", "--sync_ref_model", "true", "--ref_model_sync_steps", "1"],
            ["loss", "rewards/margins", "logps/chosen", "num_tokens"]),
    # the reward model: the causal LM's body under a new score head (seeded), the Bradley-Terry loss over the pairs
    "reward": (["--train_sampling_strategy", "sequential", "--center_rewards_coefficient", "0.01"],
               ["loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"]),
    # KTO: a sharded reference synced every step; the KL pairs and z0 over the whole step, every process's examples
    "kto": (["--sync_ref_model", "true", "--ref_model_sync_steps", "1"],
            ["loss", "kl", "rewards/margins", "logps/chosen", "logps/rejected", "num_tokens"]),
    # distillation: the student's completions (1 to 16 tokens), a wider teacher sharded as the student, both output
    # layers in chunks
    "distillation": (["--teacher_model_name_or_path", "{workload}/teacher", "--max_completion_length", "16",
                      "--beta", "0.5"], ["loss", "entropy", "completions/mean_length", "completions/max_length"]),
    # a vision-language model on image rows (workload/vlm, workload/<command>): GRPO samples each process's image
    # prompts with their pixels inside the run's whole weights, SFT trains image rows
    "grpo-vlm": (["--reward_funcs", "multiproc_rewards.vowel_share", "--num_generations", "4",
                  "--max_completion_length", "6", "--beta", "0.04"], ["loss", "reward", "kl", "completions/mean_length"]),
    "sft-vlm": (["--train_sampling_strategy", "sequential"], ["loss", "num_tokens"]),
}


# SGD's learning rate: 0.5 moves the tiny model's weights far in 2 steps; grpo-shared's runs are compared to 1e-7, and
# at 0.5 its second step's KL reaches 1e4, which amplifies the rounding of any two computations of the same update
LEARNING_RATE = {"grpo-shared": 0.01}


def _args(workload, command: str, out, per_device: int, *extra) -> list[str]:
    cli, vision = command.split("-")[0], command.endswith("-vlm")
    return [cli, "--model_name_or_path", str(workload / ("vlm" if vision else "model")), "--dataset_name",
            str(workload / (command if vision else f"{cli}.jsonl")),
            *(a.replace("{workload}", str(workload)) for a in COMMANDS[command][0]),
            "--per_device_train_batch_size",
            str(per_device), "--max_steps", "2", "--logging_steps", "1", "--save_strategy", "steps",
            "--save_steps", "1", "--gradient_checkpointing", "false", "--optim", "sgd", "--optim_args",
            "momentum=0.9", "--learning_rate", str(LEARNING_RATE.get(command, 0.5)), "--use_cpu", "true",
            "--plot_on_end", "false", "--output_dir", str(out), *extra]


def _zero3_all(directory) -> str:
    """A DeepSpeed JSON config: ZeRO-3 with every parameter partitioned."""
    ds = directory / "zero3-all.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "train_batch_size": "auto", "gradient_clipping": "auto",
                              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return str(ds)


def _config_file(config: str, directory) -> str:
    """A shipped accelerate config, `fsdp1-cpu` (fsdp1.yaml with every process loading the weights itself), or
    `zero3-all`: one that names _zero3_all's DeepSpeed JSON."""
    if config == "fsdp1-cpu":
        path = directory / "fsdp1-cpu.yaml"
        text = open(os.path.join(CONFIGS, "fsdp1.yaml")).read()
        for setting in ("fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states"):
            assert f"{setting}: true" in text
            text = text.replace(f"{setting}: true", f"{setting}: false")
        path.write_text(text)
        return str(path)
    if config != "zero3-all":
        return os.path.join(CONFIGS, config)
    ds = _zero3_all(directory)
    path = directory / "zero3-all.yaml"
    path.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {ds}\n"
                    "  zero3_init_flag: true\nnum_machines: 1\nnum_processes: 2\nmixed_precision: 'no'\n")
    return str(path)


def _launch(config: str, args: list[str], patched: bool = True, directory=None, **env) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file <config>` on 2 processes of `posttrain <args>`, through the CPU patch or not
    (with the patch, `args` may be `--runs RUNS.json`: several runs in the same two processes)."""
    target = [os.path.join(TESTS, "multiproc_sharded.py")] if patched else ["-m", "posttrain.cli"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--config_file",
           _config_file(config, directory), "--num_processes", "2", "--mixed_precision", "no", *target, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(_env(), **env), timeout=900)


def _failure(run: subprocess.CompletedProcess) -> str:
    """A failed launch's `posttrain: error` lines (one per process), then the end of its stderr."""
    said = [line for line in run.stderr.splitlines() if "posttrain: error" in line]
    return "\n".join(said[:2] + [run.stderr[-2000:]])


def _runs_file(path, runs: list[dict]) -> str:
    path.write_text(json.dumps([{"argv": run["argv"], "env": run.get("env", {})} for run in runs]))
    return str(path)


def _selected(session) -> dict:
    """launch -> the runs this session's selected tests of this module need, in order: a launch is a shipped or test
    config (`deepspeed-field`: multi_gpu.yaml with the `deepspeed` field), its runs `grpo`, `sft`, ..., and the
    prompt-sharing test's `grpo-shared` and `grpo-unshared`."""
    wanted = {}
    for item in session.items:
        if item.module.__name__ != __name__ or not hasattr(item, "callspec"):
            continue
        config = item.callspec.params["config"]
        if item.originalname == "test_sharded_training_saves_and_resumes_like_one_process":
            wanted.setdefault(config, []).append(item.callspec.params["command"])
        elif item.originalname == "test_processes_with_whole_weights_share_their_prompts_and_train_like_one_process":
            wanted.setdefault(config, []).extend(["grpo-shared", "grpo-unshared"])
    return wanted


class Launches:
    """Every run a strategy's selected tests need, in one launch of two processes, and their resumes in a second:
    most of a launch's time on the tiny model is importing torch, transformers and peft. Each run keeps its own
    output directory and logs; the resume launch starts fresh processes, as a user's resume does."""

    def __init__(self, workload, wanted: dict):
        self.workload, self.wanted, self.trained, self.resumed = workload, wanted, {}, {}

    def _config_and_extra(self, launch: str) -> tuple[str, list[str]]:
        if launch == "deepspeed-field":
            return "multi_gpu.yaml", ["--deepspeed", _zero3_all(self.workload)]
        return launch, []

    def out(self, launch: str, run: str, suffix: str = "") -> object:
        return self.workload / f"{launch.split('.')[0]}-{run}{suffix}"

    def _run(self, launch: str, run: str, extra: list[str]) -> dict:
        """A run's argv and environment: grpo-shared logs its shared passes, grpo-unshared is the same run without."""
        command = "grpo-shared" if run == "grpo-unshared" else run
        out, env = self.out(launch, run), {}
        if run != "grpo-unshared":
            env[PATH_LOG] = str(self.out(launch, run, "-paths"))
        if run == "grpo-shared":
            env[SHARED_LOG] = str(self.out(launch, run, "-shared"))
        for directory in env.values():
            os.makedirs(directory)
        return {"argv": _args(self.workload, command, out, 8, *extra), "env": env}

    def train(self, launch: str) -> subprocess.CompletedProcess:
        if launch not in self.trained:
            config, extra = self._config_and_extra(launch)
            runs = [self._run(launch, run, extra) for run in self.wanted[launch]]
            self.trained[launch] = _launch(config, ["--runs", _runs_file(self.out(launch, "runs.json"), runs)],
                                           directory=self.workload)
        return self.trained[launch]

    def resume(self, launch: str) -> tuple[subprocess.CompletedProcess, dict]:
        """Each saves-and-resumes run's step-1 checkpoint moved to a fresh output directory and resumed there, every
        run in one launch; also the files each checkpoint's `deepspeed` folder held before the resume."""
        if launch not in self.resumed:
            config, extra = self._config_and_extra(launch)
            runs, engine_files = [], {}
            for run in self.wanted[launch]:
                if run in ("grpo-shared", "grpo-unshared"):  # the sharing test resumes nothing
                    continue
                resumed = self.out(launch, run, "-resumed")
                resumed.mkdir()
                os.rename(self.out(launch, run) / "checkpoint-1", resumed / "checkpoint-1")
                engine = resumed / "checkpoint-1" / "deepspeed"
                engine_files[run] = set(os.listdir(engine)) if engine.is_dir() else set()
                runs.append({"argv": _args(self.workload, run, resumed, 8, "--resume_from_checkpoint", "true",
                                           *extra)})
            run = _launch(config, ["--runs", _runs_file(self.out(launch, "resume.json"), runs)],
                          directory=self.workload)
            self.resumed[launch] = (run, engine_files)
        return self.resumed[launch]


@pytest.fixture(scope="session")
def launches(request, workload):
    return Launches(workload, _selected(request.session))


@pytest.fixture(scope="session")
def one_process(request, workload):
    """The same runs on one process with the global batch (16 rows), every command the selected tests compare with
    run one after another in one process at the first request: command -> output dir."""
    needed = sorted({"grpo-shared" if run == "grpo-unshared" else run
                     for runs in _selected(request.session).values() for run in runs})
    runs = {command: workload / f"one-{command}" for command in needed}
    done = []

    def run(command: str):
        if not done:
            argv = [{"argv": _args(workload, name, out, 16)} for name, out in runs.items()]
            finished = subprocess.run([sys.executable, os.path.join(TESTS, "run_commands.py"),
                                       _runs_file(workload / "one-process-runs.json", argv)],
                                      capture_output=True, text=True, env=_env(), timeout=900)
            done.append(finished)
        assert done[0].returncode == 0, done[0].stderr[-3000:]
        return runs[command]

    return run


def _records(out) -> list[dict]:
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def _weights(path, lora: bool = False) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "adapter_model.safetensors" if lora else "model.safetensors"))


CASES = [(config, command) for config in ("fsdp1-cpu", "fsdp2.yaml", "zero2.yaml", "zero3-all")
         for command in ("grpo", "sft", "dpo", "rloo", "reward", "kto", "distillation")] + [pytest.param(config, "grpo-lora", marks=pytest.mark.peft)
                                                     for config in ("fsdp1-cpu", "fsdp2.yaml", "zero3-all")] + [
    (config, command) for config in ("fsdp2.yaml", "zero3-all") for command in ("grpo-vlm", "sft-vlm")] + [
    ("multi_gpu.yaml", "sft-vlm")]  # DDP with images: the vision tower's unread layer (GRPO's sampling: the others)


@pytest.mark.parametrize("config,command", CASES + [("zero1.yaml", "grpo"), ("zero3.yaml", "grpo"),
                                                     ("deepspeed-field", "grpo"), ("multi_gpu.yaml", "rloo"),
                                                     ("multi_gpu.yaml", "reward"), ("multi_gpu.yaml", "kto"),
                                                     ("multi_gpu.yaml", "distillation")])
def test_sharded_training_saves_and_resumes_like_one_process(config, command, launches, one_process, tokenizer,
                                                            workload):
    """`deepspeed-field`: a DDP launch (multi_gpu) whose config's `deepspeed` field names the ZeRO-3 JSON, as
    transformers' users write `--deepspeed ds_config.json`. Every log-prob pass runs the output layer in chunks, as on
    one process (never the model's whole logits: under FSDP2 accelerate retypes the output layer, a unit of its own),
    and GRPO decodes with the lean decoder and packs its rollouts where that pays, as on one process."""
    from transformers import AutoModelForCausalLM

    if config.startswith("zero") or config == "deepspeed-field":
        pytest.importorskip("deepspeed")  # in the dev extra; absent only where someone installed without it
    one_process = one_process(command)
    run = launches.train(config)
    assert run.returncode == 0, _failure(run)
    out = launches.out(config, command)
    ranks = []
    for rank in (0, 1):
        log = launches.out(config, command, "-paths") / f"rank{rank}.txt"  # written at a logged pass's first line
        paths = log.read_text().split() if log.exists() else []
        ranks.append(paths)
        if command == "reward":  # no output layer over the vocabulary; whole weights: each pair's prompt run once, as
            # a row per pair or in two forwards, the same layout on both processes at every pass
            assert (len(set(paths)) == 1 and set(paths) <= {"prefix-shared", "prefix-rows"}) if config in (
                "zero2.yaml", "multi_gpu.yaml") else not paths, paths
            assert rank == 0 or paths == ranks[0], ranks
            continue
        if command == "distillation":  # both output layers in chunks; never either model's whole logits
            assert "divergence" in paths and "logits" not in paths and "lean-decoder" in paths, (rank, sorted(set(paths)))
            continue
        if command.endswith("-vlm"):  # rows with pixels: never packed, prompts sampled through generate
            assert "chunked" in paths and not {"logits", "packed", "lean-decoder"} & set(paths), (rank, sorted(set(paths)))
            continue
        assert "chunked" in paths and "logits" not in paths, (rank, sorted(set(paths)))
        if command.startswith(("grpo", "rloo")):  # completions of 1 to 16 tokens: some passes run packed rows, but
            # GRPO's here, every log-prob pass in passes of a prompt's rows, two or three (nothing packing can combine)
            assert "lean-decoder" in paths and "model-forward-decode" not in paths, (rank, sorted(set(paths)))
            assert ("packed" in paths) == (command != "grpo"), (rank, sorted(set(paths)))
    if command == "grpo":  # every process runs as many passes of each micro-batch, some more than one
        passes = [[p for p in (launches.out(config, command, "-paths") / f"rank{rank}.txt").read_text().split()
                   if p.startswith("passes-")] for rank in (0, 1)]
        assert passes[0] == passes[1] and any(p != "passes-1" for p in passes[0]), passes
    one, two = _records(one_process), _records(out)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for key in COMMANDS[command][1]:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    if command in ("grpo", "rloo"):
        assert two[0]["completions/min_length"] < two[0]["completions/max_length"]  # decodes of different lengths

    lora = command.endswith("-lora")
    reference, sharded = _weights(one_process, lora), _weights(out, lora)
    assert sharded.keys() == reference.keys()  # plain names, the tied output layer not stored twice
    if lora:  # every LoRA weight of the two adapted projections of both layers; B starts at zero
        assert len(reference) == 8
        moved = max(float(reference[k].abs().max()) for k in reference if "lora_B" in k)
    else:
        initial = _weights(workload / ("vlm" if command.endswith("-vlm") else "model"))
        moved = max(float((reference[k] - initial[k]).abs().max()) for k in reference if k in initial)
    assert moved > 1e-3  # the two steps changed the weights
    for name in reference:
        assert torch.allclose(sharded[name], reference[name], rtol=1e-5, atol=1e-7), name

    def load(path):
        if command.endswith("-vlm"):
            from transformers import AutoModelForImageTextToText

            return AutoModelForImageTextToText.from_pretrained(path)
        if command == "reward":
            from transformers import AutoModelForSequenceClassification

            return AutoModelForSequenceClassification.from_pretrained(path)
        if not lora:
            return AutoModelForCausalLM.from_pretrained(path)
        from peft import PeftModel

        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(workload / "model"), path)

    ids = torch.tensor([tokenizer("1+2=33")["input_ids"]])
    with torch.no_grad():
        logits = [load(path)(input_ids=ids).logits for path in (one_process, out)]
    assert torch.allclose(logits[0], logits[1], atol=1e-5)

    run, engine_files = launches.resume(config)
    assert run.returncode == 0, _failure(run)
    if config.startswith("zero") or config == "deepspeed-field":  # the engine's own state, a partition per process
        assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= \
            engine_files[command], engine_files[command]
    resumed = launches.out(config, command, "-resumed")
    last = _records(resumed)[-1]
    assert (last["step"], last["loss"]) == (two[-1]["step"], two[-1]["loss"])
    again = _weights(resumed, lora)
    assert all(torch.equal(again[name], sharded[name]) for name in sharded)


@pytest.mark.parametrize("config", ["multi_gpu.yaml", "zero1.yaml", "zero2.yaml"])
def test_processes_with_whole_weights_share_their_prompts_and_train_like_one_process(config, launches, one_process,
                                                                                     workload):
    """DDP and DeepSpeed ZeRO-1/2 (the shipped configs: every process holds the whole weights), completions at full
    length: each process runs its 2 prompts once in its reference and policy passes (the FLOP floor off for the tiny
    model), every pass through the chunked output layer, every decode through the lean decoder. The two steps'
    metrics equal one process's over the 16 rows, and the weights the same launch's without sharing."""
    if config.startswith("zero"):
        pytest.importorskip("deepspeed")
    reference = one_process("grpo-shared")
    run = launches.train(config)
    assert run.returncode == 0, _failure(run)
    shared, unshared = launches.out(config, "grpo-shared"), launches.out(config, "grpo-unshared")
    for rank in (0, 1):
        paths = set((launches.out(config, "grpo-shared", "-paths") / f"rank{rank}.txt").read_text().split())
        # full-length completions: nothing to pack; "auto" passes on the tiny model: each micro-batch in one pass
        assert paths == {"chunked", "lean-decoder", "passes-1"}, paths
        passes = (launches.out(config, "grpo-shared", "-shared") / f"rank{rank}.txt").read_text().splitlines()
        # per step, the reference pass (8 rollouts, no gradient) and the policy pass (with); besides, each model's
        # one-time check (2 rollouts)
        assert passes.count("8 0") == 2 and passes.count("8 1") == 2, passes
        assert set(passes) == {"2 0", "8 0", "8 1"}, passes
    one, two = _records(reference), _records(shared)
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        for key in COMMANDS["grpo-shared"][1]:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    expected, trained = _weights(unshared), _weights(shared)
    assert max(float((expected[k] - _weights(workload / "model")[k]).abs().max()) for k in expected) > 1e-4
    for key in expected:
        assert torch.allclose(trained[key], expected[key], rtol=1e-5, atol=1e-7), key


@pytest.mark.parametrize("config, name", [("fsdp1.yaml", "FSDP"), ("fsdp2.yaml", "FSDP"), ("zero2.yaml", "DeepSpeed")])
def test_a_sharded_config_without_a_gpu_stops_in_one_sentence(config, name, workload):
    """Without the test patch, accelerate turns an FSDP or DeepSpeed launch on CPU (use_cpu) into DDP: the run stops
    before loading, once."""
    if name == "DeepSpeed":
        pytest.importorskip("deepspeed")
    run = _launch(config, _args(workload, "grpo", workload / f"refused-{config}", 8), patched=False)
    lines = [line for line in run.stderr.splitlines() if line.startswith("posttrain:")]
    if config == "fsdp1.yaml":  # the shipped fsdp1 loads the weights on one process: accelerate stops before choosing
        assert run.returncode != 0 and lines == [
            "posttrain: error: This run was launched with FSDP loading the weights on one process and sharing them "
            "(fsdp_cpu_ram_efficient_loading or fsdp_sync_module_states), which accelerate sets up only on a GPU, and "
            "this machine has none: run it on GPUs, or launch with DDP (accelerate_config multi_gpu)."], \
            run.stderr[-3000:]
        return
    assert run.returncode != 0 and lines == [
        f"posttrain: error: This run was launched with {name}, but accelerate set up DDP over 2 processes instead, as "
        "it does on a machine without a GPU or with use_cpu=True, so nothing would be sharded: run it on GPUs without "
        "use_cpu, or launch with DDP (accelerate_config multi_gpu)."], run.stderr[-3000:]
