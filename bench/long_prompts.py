"""Run a GRPO bench script with every prompt prefixed by a fixed 111-token instruction (on make_tiny.py's tokenizer;
122-token prompts on the benchmark): the benchmark's workload with real-length prompts.

Usage: python bench/long_prompts.py bench/grpo_step.py MODEL_DIR [its flags]
(also ../shared/bench/trl_grpo.py, or another checkout's bench/grpo_step.py: the prefix is added where the script
builds its dataset, `datasets.Dataset.from_dict`).
"""

import runpy
import sys

import datasets

PREFIX = ("You are a careful assistant. Read the question, think about each digit, carry where needed, check the sum "
          "twice, and answer with the number only, without words. ")


def main():
    script, sys.argv = sys.argv[1], sys.argv[1:]
    from_dict = datasets.Dataset.from_dict.__func__

    def prefixed(cls, mapping, *args, **kwargs):
        if "prompt" in mapping:
            mapping = dict(mapping, prompt=[PREFIX + p for p in mapping["prompt"]])
        return from_dict(cls, mapping, *args, **kwargs)

    datasets.Dataset.from_dict = classmethod(prefixed)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
