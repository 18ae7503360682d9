"""peft is optional: full fine-tuning works where it cannot be imported; asking for LoRA says how to install it.

CI also runs every test not marked `peft` in an environment where peft is not installed at all.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import sys
    sys.modules["peft"] = None  # `import peft` now fails, and find_spec("peft") reports it missing
    from datasets import Dataset
    import posttrain
    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain._optional import MissingDependency
    from posttrain.cli import main
    from posttrain.testing import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    ds = Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "4+4="], "answer": ["2", "4", "6", "8"]})
    cfg = GRPOConfig(output_dir=sys.argv[1], max_steps=2, per_device_train_batch_size=4, num_generations=2,
                     max_completion_length=4, beta=0.1, gradient_checkpointing=False, use_cpu=True,
                     save_strategy="no", logging_steps=1)
    trainer = GRPOTrainer(tiny_model(tok, hidden=32, layers=1), "accuracy", cfg, train_dataset=ds,
                          processing_class=tok)
    trainer.train()
    assert trainer.state.global_step == 2
    assert sys.modules["peft"] is None, "something imported peft"
    try:
        GRPOTrainer(tiny_model(tok, hidden=32, layers=1), "accuracy", cfg, train_dataset=ds, processing_class=tok,
                    peft_config={"r": 8})
    except MissingDependency as err:
        print("MESSAGE:", err)
    assert main(["grpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--use_peft"]) == 2
''')


def test_full_finetuning_without_peft(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "out")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("MESSAGE: Training LoRA adapters (peft_config / --use_peft) needs the optional package 'peft': "
            "install it with `pip install 'posttrain[peft]'`.") in out.stdout
    assert "posttrain: error: --use_peft needs the optional package 'peft'" in out.stderr
