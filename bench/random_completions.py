"""Random full-length completions in place of the decode, on TRL's side and posttrain's alike.

`install()` replaces transformers' `GenerationMixin.generate` (what TRL 1.16's GRPOTrainer calls without vLLM) and
posttrain's in-process decode (`TransformersGenerator._decode`) with a draw of random token ids, every row full
length (`max_new_tokens`, no EOS). The training passes see the shapes that a decode forced to full length
(`min_new_tokens`, the anchors' setting) gives them, without the decode's time: for memory rows, whose peak is in the
training, not in the decode. The ids lie in [10, min(2,000, the vocabulary)): within the bench tokenizers' own
vocabularies (2,274 tokens for make_tiny.py's and make_qwen_shape.py's) and above their special tokens.
"""

FIRST_ID, TOP_ID = 10, 2000


def random_ids(rows: int, width: int, vocab: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(FIRST_ID, min(TOP_ID, vocab), (rows, width), generator=generator)


def transformers_generate(self, input_ids=None, generation_config=None, **kwargs):
    """GenerationMixin.generate's stand-in: the prompts followed by `max_new_tokens` random ids each."""
    import torch

    config = generation_config or self.generation_config
    completion = random_ids(input_ids.size(0), config.max_new_tokens, self.get_input_embeddings().num_embeddings)
    return torch.cat([input_ids, completion.to(input_ids.device)], dim=1)


def posttrain_decode(self, prompts, model_inputs=None):
    """TransformersGenerator._decode's stand-in: every row `max_new_tokens` random ids, none finished by EOS."""
    import torch

    from posttrain.generation.protocol import Rollouts
    from posttrain.generation.transformers_backend import left_pad

    prompt_ids, prompt_mask = left_pad(prompts, self.pad_id, self._device())
    rows, width = len(prompts), self.params.max_new_tokens
    ids = random_ids(rows, width, self.model.get_input_embeddings().num_embeddings)
    return Rollouts(prompt_ids, prompt_mask, ids, torch.ones(rows, width, dtype=torch.bool),
                    torch.zeros(rows, dtype=torch.bool), torch.full((rows, width), -5.0))


def install() -> None:
    from transformers.generation.utils import GenerationMixin

    GenerationMixin.generate = transformers_generate
    try:
        from posttrain.generation.transformers_backend import TransformersGenerator
    except ImportError:  # TRL's environment without posttrain
        return
    TransformersGenerator._decode = posttrain_decode
