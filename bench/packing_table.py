"""Per architecture, kernel and trainer: the largest |packed - alone| of the per-token log-probs (the reward model's
scores) of the trainer's own first batch with packing or padding-free asked for, and the most sequences a row of it
holds (1: the trainer ran padded rows). The cases are tests/packing_cases.py's (tests/test_packed_layouts.py holds
them to 1e-5); the tiny models are posttrain/testing.py's, under sdpa and under flash attention's rules.

    python bench/packing_table.py [--json]

Prints a markdown table (docs/packing.md), or one JSON line per row.
"""

import argparse
import json
import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))  # packing_cases.py


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true", help="one JSON line per row instead of the table")
    args = ap.parse_args()
    import torch

    from packing_cases import CASES
    from posttrain.testing import ARCHITECTURES, tiny_architecture, tiny_tokenizer, use_flash_rules

    torch.set_num_threads(1)
    logging.getLogger("posttrain").setLevel(logging.ERROR)
    tokenizer = tiny_tokenizer(all_bytes=False)
    rows = []
    for family in ARCHITECTURES:
        for kernel in ("sdpa", "flash"):
            row = {"architecture": family, "kernel": kernel}
            for name, case in CASES.items():
                try:
                    model = tiny_architecture(family, tokenizer, classifier=name == "Reward")
                except ValueError:  # no sequence classifier for this family
                    row[name] = None
                    continue
                if kernel == "flash":
                    use_flash_rules(model)
                with tempfile.TemporaryDirectory() as out:
                    gap, per_row = case(model, tokenizer, out)
                row[name] = {"max_abs_gap": gap, "sequences_per_row": per_row}
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        print("| architecture | kernel | " + " | ".join(CASES) + " |")
        print("|---|---|" + "---|" * len(CASES))
        for row in rows:
            cells = ["-" if row[n] is None else f"{row[n]['max_abs_gap']:.1e} ({row[n]['sequences_per_row']})"
                     for n in CASES]
            print(f"| {row['architecture']} | {row['kernel']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
