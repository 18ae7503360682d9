"""A tiny student learns addition from a bigger teacher by on-policy distillation, on CPU in about 20 seconds:
`python examples/distil_addition.py`.

Stage 1, the teacher (SFT): a random 2-layer, 64-wide model with a character vocabulary learns single-digit
addition ("3+4=" -> "7") from every sum but the held-out ones. Stage 2, distillation: a random 1-layer, 32-wide
student (a quarter of the teacher's parameters), sharing its tokenizer, samples its own answers to the training
prompts, and DistillationTrainer (TRL 1.16's API) moves its next-token distributions towards the teacher's on those
samples (beta 0.5, the generalized Jensen-Shannon divergence), through both output layers in chunks.

The script prints, on the held-out sums (never trained on by either model), the teacher's accuracy, and the student's
accuracy and agreement with the teacher's answers (greedy decoding) before and after distillation, and plots the
run (distil_addition.png). On 2 cores: the teacher 80%; the student 0% -> 60% accurate, agreeing with the teacher
0% -> 80% (21 s in all, 2026-11-27).

    python examples/distil_addition.py [--output-dir distil-addition] [--steps 1000] [--teacher-steps 300]
"""

import argparse
import os

HELD_OUT = {(a, b) for a in range(10) for b in range(10) if (a * 7 + b * 3) % 10 == 0}  # 10 of the 100 sums


def rows(held_out: bool) -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10) for b in range(10)
            if ((a, b) in HELD_OUT) == held_out]


def answers(model, tokenizer, prompts: list[str]) -> list[str]:
    """Greedy answers, up to 3 tokens or the EOS."""
    import torch

    out = []
    model.eval()
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(generated[0, ids.size(1):], skip_special_tokens=True))
    return out


def scores(student, teacher, tokenizer) -> tuple[float, float]:
    """(the student's accuracy, its agreement with the teacher) on the held-out sums."""
    held = rows(held_out=True)
    prompts = [r["prompt"] for r in held]
    mine, theirs = answers(student, tokenizer, prompts), answers(teacher, tokenizer, prompts)
    accuracy = sum(a == r["completion"] for a, r in zip(mine, held)) / len(held)
    agreement = sum(a == b for a, b in zip(mine, theirs)) / len(held)
    return accuracy, agreement


def train_teacher(out: str, steps: int):
    from datasets import Dataset

    from posttrain import SFTConfig, SFTTrainer
    from posttrain.testing import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer(all_bytes=False)
    config = SFTConfig(output_dir=os.path.join(out, "teacher"), max_steps=steps, per_device_train_batch_size=30,
                       learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=50, save_strategy="no",
                       gradient_checkpointing=False, use_cpu=True, report_to="none", seed=0, plot_on_end=False)
    trainer = SFTTrainer(tiny_model(tokenizer, seed=1, hidden=64, layers=2), args=config,
                         train_dataset=Dataset.from_dict({k: [r[k] for r in rows(False)] for k in ("prompt",
                                                                                                   "completion")}),
                         processing_class=tokenizer)
    trainer.train()
    return trainer.policy, tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-dir", default="distil-addition")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--teacher-steps", type=int, default=300)
    args = ap.parse_args()

    import torch
    from datasets import Dataset

    from posttrain import DistillationConfig, DistillationTrainer
    from posttrain.plotting import plot_runs
    from posttrain.testing import tiny_model

    torch.set_num_threads(2)
    teacher, tokenizer = train_teacher(args.output_dir, args.teacher_steps)
    student = tiny_model(tokenizer, seed=2, hidden=32, layers=1)
    teacher_accuracy = scores(teacher, teacher, tokenizer)[0]
    before = scores(student, teacher, tokenizer)
    config = DistillationConfig(output_dir=os.path.join(args.output_dir, "student"), max_steps=args.steps,
                                per_device_train_batch_size=30, max_completion_length=3, beta=0.5, learning_rate=5e-3,
                                lr_scheduler_type="constant", temperature=1.0, logging_steps=5, save_strategy="no",
                                gradient_checkpointing=False, use_cpu=True, report_to="none", seed=0)
    prompts = Dataset.from_dict({"prompt": [r["prompt"] for r in rows(held_out=False)]})
    trainer = DistillationTrainer(student, teacher, args=config, train_dataset=prompts, processing_class=tokenizer)
    trainer.train()
    after = scores(trainer.policy, teacher, tokenizer)
    print(f"held-out sums: teacher accuracy {teacher_accuracy:.0%}; student accuracy {before[0]:.0%} -> "
          f"{after[0]:.0%}, agreement with the teacher {before[1]:.0%} -> {after[1]:.0%}")
    plot_runs([config.output_dir], os.path.join(args.output_dir, "distil_addition.png"))


if __name__ == "__main__":
    main()
