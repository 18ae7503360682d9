"""The vision-language benchmark's workload, shared by bench/trl_vlm.py (TRL) and bench/vlm_step.py (posttrain):
a tiny Qwen2.5-VL built offline (posttrain.testing.tiny_vision_processor, seeded: both sides train the same
weights) and rows of TRL's vision formats with --images images each (16x16 pixels, 4 image tokens each after the
processor's 2x2 merge), one dataset per trainer:

    sft           messages (user question with the images, assistant answer)
    dpo           prompt / chosen / rejected messages
    kto           prompt / completion / label messages
    grpo, rloo    prompt messages (GRPO's reward: the completion's length)
    distillation  prompt messages; the teacher another tiny Qwen2.5-VL (seed 1)
"""

import random

TRAINERS = ("sft", "dpo", "kto", "grpo", "rloo", "distillation")
WORDS = "the a of to and in is it you that he was for on are with as I his they be at one have this from".split()


def add_arguments(parser) -> None:
    parser.add_argument("--trainer", choices=TRAINERS, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--images", type=int, default=3, help="images per row (2-4 in the issue's rows)")
    parser.add_argument("--words", type=int, default=24, help="words of each question and answer")
    parser.add_argument("--completion", type=int, default=16, help="online trainers: max_completion_length")
    parser.add_argument("--generations", type=int, default=4, help="GRPO, RLOO: num_generations")
    parser.add_argument("--threads", type=int, default=2)


def model_and_processor(seed: int = 0, folder: str = "/tmp/bench-models"):
    """(the model's path, its processor): the tiny model saved once under `folder`, so that both sides load it by
    path, as users give it, and load their reference or teacher from it as they do."""
    import os

    from posttrain.testing import tiny_vision_processor

    model, processor = tiny_vision_processor("qwen2_5_vl", seed=seed)
    path = os.path.join(folder, f"vlm-qwen2_5_vl-seed{seed}")
    if not os.path.isdir(path):
        model.save_pretrained(path)
        processor.tokenizer.save_pretrained(path)  # what a teacher's vocabulary is checked against
    return path, processor


def _image(rng):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.asarray([[[rng.randrange(256) for _ in range(3)] for _ in range(16)]
                                       for _ in range(16)], dtype=np.uint8))


def rows(trainer: str, n: int, images: int, words: int, seed: int = 0) -> list[dict]:
    """n rows of `trainer`'s vision format."""
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(words))

    out = []
    for i in range(n):
        row = {"images": [_image(rng) for _ in range(images)], "prompt": [{"role": "user", "content": text()}]}
        if trainer == "sft":
            row = {"images": row["images"], "messages": row["prompt"] + [{"role": "assistant", "content": text()}]}
        elif trainer == "dpo":
            row.update(chosen=[{"role": "assistant", "content": text()}],
                       rejected=[{"role": "assistant", "content": text()}])
        elif trainer == "kto":
            row.update(completion=[{"role": "assistant", "content": text()}], label=i % 2 == 0)
        out.append(row)
    return out


def length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def rows_needed(args) -> int:
    if args.trainer in ("grpo", "rloo"):
        return args.steps * args.batch // args.generations
    return args.steps * args.batch


def common_config(args, out_dir: str) -> dict:
    """The config fields both sides set (the trainer's own are added by each script)."""
    values = dict(output_dir=out_dir, use_cpu=True, bf16=False, max_steps=args.steps,
                  per_device_train_batch_size=args.batch, learning_rate=1e-5, logging_steps=1, report_to="none",
                  save_strategy="no", seed=0, gradient_checkpointing=False)
    if args.trainer in ("grpo", "rloo"):
        values.update(num_generations=args.generations, max_completion_length=args.completion, shuffle_dataset=False)
    elif args.trainer == "distillation":
        values.update(max_completion_length=args.completion, shuffle_dataset=False)
    elif args.trainer == "sft":
        values.update(shuffle_dataset=False)
    return values
