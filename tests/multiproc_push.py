"""Run by the two-process push test: each process trains one step, pushes (which fails without a token on the
main process only, where the upload happens) and records what it was told in <out>/rank<RANK>.txt."""

import os
import sys

from datasets import Dataset

from posttrain.configs import GRPOConfig
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.errors import UserError

model_dir, out = sys.argv[1], sys.argv[2]
prompts = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]})
config = GRPOConfig(output_dir=os.path.join(out, "run"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=4, gradient_checkpointing=False, use_cpu=True, save_strategy="no")
trainer = GRPOTrainer(model_dir, lambda completions, **kw: [float(len(c)) for c in completions], config,
                      train_dataset=prompts)
trainer.train()
try:
    trainer.push_to_hub()
    told = "pushed"
except UserError as err:  # the main process's HubError; the other's PeerFailure
    told = str(err)
with open(os.path.join(out, f"rank{os.environ['RANK']}.txt"), "w") as f:
    f.write(told)
trainer.close()
