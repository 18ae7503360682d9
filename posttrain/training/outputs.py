"""What a run writes and shows, with transformers' Trainer's names (a mixin of training/trainer.py's Trainer, on its
`args`, `accelerator`, `state`, `sharding`, `model`, `policy`, `processing_class`, `logger` and callbacks):
log records, the model and adapters, metrics files, trainer_state.json, the plots and report, and the Hub.
"""

import json
import logging
import os
import shutil

from posttrain.errors import StorageError, storage_error
from posttrain.training.checkpoint import checkpoints
from posttrain.training.distributed import AGREED, guarded
from posttrain.training.hub import push_folder, repo_id
from posttrain.training.logging import QUIET_LEVELS
from posttrain.training.saving import save_merged, save_policy_atomically

logger = logging.getLogger("posttrain")

# what transformers logs at logging steps only: a summary record does not repeat them
STEP_ONLY_KEYS = ("loss", "grad_norm", "learning_rate")
# what the end of train() names, when it was written: (file or folder in output_dir, what it is); the first of each
# group that exists
WRITTEN = (
    (("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"),
     "the trained model (load the folder with from_pretrained)"),
    (("adapter_model.safetensors", "adapter_model.bin"), "the trained adapter (load the folder with peft)"),
    (("merged",), "full weights, LoRA merged (save_merged)"),
    (("metrics.jsonl",), "the logged metrics, one record a line"),
    (("completions.jsonl",), "the logged completions (log_completions)"),
    (("plots.png",), "the curves (posttrain plot)"),
    (("report.html",), "the run's report: open it in a browser"),
)


def final_save_failed(err: StorageError, kept: list[tuple[int, str]], step: int) -> StorageError:
    """`err` (the final save's disk failure, one sentence) with what is left: the newest checkpoint, or that none
    holds the trained weights. Raised on every process at once when `err` was (training/distributed.py)."""
    if kept and kept[-1][0] == step:
        left = f"The newest checkpoint, {kept[-1][1]}, is kept and holds the weights of step {step}."
    elif kept:
        newest_step, newest = kept[-1]
        left = (f"The weights of step {step} are not saved; the newest checkpoint, {newest} (step {newest_step}), is "
                "kept.")
    else:
        left = (f"The weights of step {step} are not saved and no checkpoint holds them (from Python, "
                "trainer.save_model() writes them once there is space).")
    failed = StorageError(f"{err} {left}")
    if hasattr(err, AGREED):
        setattr(failed, AGREED, True)
    return failed


def outputs_summary(output_dir: str) -> str:
    """The lines the end of train() prints: the output directory, then each file of WRITTEN that exists in it."""
    found = []
    for names, what in WRITTEN:
        name = next((n for n in names if os.path.exists(os.path.join(output_dir, n))), None)
        if name is not None:
            found.append((name + "/" if os.path.isdir(os.path.join(output_dir, name)) else name, what))
    width = max((len(name) for name, _ in found), default=0)
    lines = [f"posttrain: training done; the run's files are in {os.path.abspath(output_dir)}"]
    return "\n".join(lines + [f"  {name:<{width}}  {what}" for name, what in found])


class OutputsMixin:
    """Logging, saving and pushing."""

    _logging_summary = False  # set while the end-of-training summary is logged (it goes to train_results.json)

    def log(self, logs: dict, start_time=None) -> None:
        """Record `logs` at the current step: log_history, metrics.jsonl (not the end-of-training summary), trackers,
        and the on_log callbacks. transformers' signature: a subclass's override is what the loop calls."""
        record = {"step": self.state.global_step, "epoch": round(self.state.epoch, 4), **logs}
        self.state.log_history.append(record)
        # trackers' network errors are not disk writes
        self._on_main(self._emit, record, not self._logging_summary, writing=None)
        self._call("on_log", logs=record)

    def _log_summary(self, metrics: dict) -> None:
        """The end-of-training record, through `log` (which an override sees) but not into metrics.jsonl."""
        self._logging_summary = True
        try:
            self.log(metrics)
        finally:
            self._logging_summary = False

    def _emit(self, record: dict, to_file: bool) -> None:
        if self.logger is not None:
            self.logger.emit(record, to_file=to_file)
        elif to_file:
            path = os.path.join(self.args.output_dir, "metrics.jsonl")
            try:
                os.makedirs(self.args.output_dir, exist_ok=True)
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as err:
                raise storage_error(err, "write", path) from err


    def _on_main(self, fn, *args, writing: str | None = "output_dir"):
        """`fn(*args)` on the main process; every process waits for it and learns whether it failed (a failed disk
        write under `writing`, default output_dir, as one sentence; None for work that is not a write)."""
        path = self.args.output_dir if writing == "output_dir" else writing
        with guarded(self.accelerator, writing=path):
            if self.accelerator.is_main_process:
                fn(*args)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model (or adapter), tokenizer and config to `output_dir` (default args.output_dir)."""
        whole = self.sharding.full_state_dict(self.model)  # sharded: gathered by every process, written by the main
        self._on_main(save_policy_atomically, self.policy, self.processing_class, self.args.to_dict(),
                      output_dir or self.args.output_dir, whole)

    def _save_final_model(self) -> None:
        """The end of train(): save_model(output_dir) (an override's included). When the disk refuses it, the error
        says that the trained weights are not saved and which checkpoint is kept (none is removed)."""
        try:
            self.save_model(self.args.output_dir)
        except StorageError as err:
            raise final_save_failed(err, checkpoints(self.args.output_dir), self.state.global_step) from err

    def save_merged(self, output_dir: str) -> None:
        """Save full weights that load with plain `AutoModelForCausalLM.from_pretrained` (LoRA merged)."""
        with self.sharding.whole_weights(self.model):  # every process: the export reads whole weights
            self._on_main(save_merged, self.policy, self.processing_class, output_dir)

    def save_state(self) -> None:
        """Write the TrainerState to output_dir/trainer_state.json, as transformers does."""
        self._on_main(self._write_state_json)

    def _write_state_json(self) -> None:
        os.makedirs(self.args.output_dir, exist_ok=True)
        self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    def log_metrics(self, split: str, metrics: dict) -> None:
        """Print `metrics` of `split` (train, eval, ...) as transformers' Trainer does, on the main process."""
        if not self.accelerator.is_main_process:
            return
        print(f"***** {split} metrics *****")
        width = max((len(k) for k in metrics), default=0)
        for key in sorted(metrics):
            value = metrics[key]
            print(f"  {key:<{width}} = {value:>9.4g}" if isinstance(value, float) else f"  {key:<{width}} = {value}")

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """Write `metrics` to output_dir/<split>_results.json (and merge them into all_results.json)."""
        self._on_main(self._write_metrics, split, metrics, combined)

    def _write_metrics(self, split: str, metrics: dict, combined: bool) -> None:
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, f"{split}_results.json"), "w") as f:
            json.dump(metrics, f, indent=4, sort_keys=True)
        if combined:
            path = os.path.join(self.args.output_dir, "all_results.json")
            merged = json.load(open(path)) if os.path.exists(path) else {}
            merged.update(metrics)
            with open(path, "w") as f:
                json.dump(merged, f, indent=4, sort_keys=True)

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, **kwargs) -> str | None:
        """Save the model to output_dir and upload output_dir to the Hub (args.hub_model_id, else its name).

        It needs network access and a token (`hf auth login`, HF_TOKEN or hub_token); without them it stops with one
        sentence saying so. Uploads are synchronous. Returns the commit URL on the main process.
        """
        self.save_model(self.args.output_dir)
        self._call("on_push_begin")
        url = None
        with guarded(self.accelerator):  # the main process pushes; every process learns whether it failed
            if self.accelerator.is_main_process:
                url = push_folder(self.args, self.args.output_dir, commit_message, token=token, revision=revision)
        return url

    @property
    def hub_model_id(self) -> str:
        """The Hub repository push_to_hub uploads to: args.hub_model_id, else output_dir's name (under the token's
        user), as transformers' Trainer names it."""
        return repo_id(self.args)

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def _remove_checkpoints_but(self, kept: str) -> None:
        for _, path in checkpoints(self.args.output_dir):
            if path != kept:
                shutil.rmtree(path, ignore_errors=True)

    def _print_outputs(self) -> None:
        """Say where the run's files are (outputs_summary), on stdout of the main process, at the end of train();
        not with log_level error or critical (posttrain's --quiet)."""
        if self.accelerator.is_main_process and self.args.log_level not in QUIET_LEVELS:
            print(outputs_summary(self.args.output_dir), flush=True)

    def _write_plots(self) -> None:
        """output_dir/plots.png from metrics.jsonl and output_dir/report.html (posttrain/report.py), as plot_on_end
        says (None: when matplotlib is installed)."""
        import importlib.util

        from posttrain.plotting import NothingToDraw, PlotError, plot_runs_with_svg
        from posttrain.report import write_report

        if self.args.plot_on_end is False or (self.args.plot_on_end is None and
                                              importlib.util.find_spec("matplotlib") is None):
            return
        svg = None
        try:  # one figure for both files
            svg = plot_runs_with_svg([self.args.output_dir], os.path.join(self.args.output_dir, "plots.png"))
        except NothingToDraw as err:  # a short run, or logging_strategy=no: the run itself is fine
            logger.info("No plots.png: %s", err)
        except PlotError as err:
            logger.warning("No plots.png: %s", err)
        write_report(self.args.output_dir, curves_svg=svg)  # without logged steps, it says so in place of the curves

    def _train_summary(self, start_time: float, steps: int) -> dict:
        """transformers' end-of-training record, logged to log_history, trackers and callbacks, and written to
        output_dir/train_results.json."""
        from transformers.trainer_utils import speed_metrics

        args = self.args
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
        metrics = speed_metrics("train", start_time, num_samples=steps * per_step, num_steps=steps)
        metrics.update(total_flos=float(self.state.total_flos), train_loss=self._loss_sum / max(steps, 1))
        self._log_summary(metrics)
        # TRL merges its metrics into every record it logs, this one too, and its users read them from
        # state.log_history[-1]: there the summary carries the last logging window's (not transformers' own per-step
        # keys, which it leaves to train_loss); trackers already have them at their step
        summary = self.state.log_history[-1]
        carried = {k: v for k, v in self.logger.last_window.items() if k not in STEP_ONLY_KEYS and k not in summary}
        self.state.log_history[-1] = {**summary, **carried}
        self.save_metrics("train", metrics)
        return metrics
