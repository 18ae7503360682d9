"""Several `posttrain <command> ...` runs one after another in one process, as `python -m posttrain.cli` runs each.

    python tests/run_commands.py RUNS.json

RUNS.json is a list of {"argv": [command, flags...], "env": {NAME: value}}: each run's environment variables are
set for it alone. Most of what a launch costs on the tests' tiny models is importing torch, transformers and peft,
so the tests that compare many runs start their processes once. The first run that fails ends the process with its
exit code, after a line on stderr naming it.
"""

import json
import os
import sys


def run_each(runs: list[dict], before=None) -> int:
    """Run every {"argv", "env"} in order through posttrain's CLI; `before(env)` is called before each run."""
    from posttrain import cli

    with _ProcessGroupKept():
        return _run_in_order(cli, runs, before)


def _run_in_order(cli, runs: list[dict], before) -> int:
    for run in runs:
        saved = {name: os.environ.get(name) for name in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        try:
            if before is not None:
                before(run.get("env", {}))
            code = cli.main(run["argv"])
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if code:
            print(f"run_commands: `posttrain {' '.join(run['argv'])}` exited with {code}", file=sys.stderr)
            return code
    return 0


class _ProcessGroupKept:
    """Each run ends by destroying its process group (Trainer.close calls accelerate's end_training); a group cannot
    be set up again on the launcher's store, so between runs it is kept, and destroyed after the last, as one run's
    is."""

    def __enter__(self):
        from accelerate import Accelerator

        self.end_training = Accelerator.end_training
        Accelerator.end_training = lambda accelerator: None
        return self

    def __exit__(self, *exc):
        from accelerate import Accelerator
        from accelerate.state import PartialState

        Accelerator.end_training = self.end_training
        if PartialState._shared_state:
            PartialState().destroy_process_group()


def read_runs(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    sys.exit(run_each(read_runs(sys.argv[1])))
