"""Time and extra memory of one engine weight export (posttrain.weights.export_weights).

Usage: python bench/weight_export.py MODEL_DIR [--peft] [--repeats 3] [--threads 2]
Prints one JSON line:
  export_s        seconds to produce every (name, tensor) pair, consumed one at a time (median of repeats)
  sync_s          seconds to export and copy into a separate engine copy of the model (the sync_weights path)
  fresh_mib       MiB of tensors the export allocates (merged LoRA layers, clones of trainable tensors);
                  frozen tensors are handed out without a copy
  peak_extra_mib  growth of the process's peak RSS across the exports and syncs (allocator noise included)
  tensors         number of pairs exported
"""

import argparse
import copy
import json
import resource
import statistics
import time


def rss_peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--peft", action="store_true", help="LoRA r=16, alpha=32 on all-linear, as in trl_grpo.py")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.weights import export_weights

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    engine = copy.deepcopy(model).eval()
    if args.peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        with torch.no_grad():  # non-zero adapters, as after some training
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
    seen = {t.untyped_storage().data_ptr() for t in model.state_dict().values()}  # the model's own storage
    fresh = 0
    for _, t in export_weights(model):
        if t.untyped_storage().data_ptr() not in seen:  # a new allocation, counted once even if tied
            seen.add(t.untyped_storage().data_ptr())
            fresh += t.numel() * t.element_size()
    base_peak = rss_peak_mib()

    export_times, sync_times, count = [], [], 0
    engine_state = engine.state_dict()
    for _ in range(args.repeats):
        start = time.perf_counter()
        count = sum(1 for _ in export_weights(model))
        export_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        with torch.no_grad():
            for name, tensor in export_weights(model):
                engine_state[name].copy_(tensor)
        sync_times.append(time.perf_counter() - start)
    print(json.dumps({
        "impl": "posttrain", "peft": args.peft, "tensors": count,
        "export_s": round(statistics.median(export_times), 4), "sync_s": round(statistics.median(sync_times), 4),
        "fresh_mib": round(fresh / 2**20, 1), "peak_extra_mib": round(rss_peak_mib() - base_peak, 1),
    }))


if __name__ == "__main__":
    main()
