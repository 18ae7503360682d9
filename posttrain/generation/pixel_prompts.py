"""Sampling prompts that carry pixels (a vision-language model's images) in process, through transformers'
`generate`: each family's own contract drives its prefill and steps (Qwen-VL's multimodal rotary offsets, Gemma 3's
bidirectional image attention, LLaVA's image features), as TRL samples such prompts without vLLM.

    tokens, logprobs = sample_with_pixels(model, prompt_ids, prompt_mask, pixels, params, eos_ids, pad_id, seed)

The sampled distribution is the in-process decoder's: transformers' processors for the repetition penalty, the
minimum length and the suppressed tokens, then this module's for temperature, top-k, top-p and min-p (the same
`filter_logits`); the last processor keeps the log-probability of each sampled token under it, one step's
[N, V] at a time, never the [steps, N, V] scores. The random numbers are torch's, seeded from the round's seed and
the rows' keys within a forked RNG: a round samples the same completions again, though a row's completion depends on
the rows sampled beside it (the in-process decoder's per-row streams do not reach inside `generate`).
"""

import torch

from posttrain.generation.protocol import SamplingParams
from posttrain.generation.sampling import filter_logits


class _Shaped:
    """Temperature, top-k, top-p and min-p, as the in-process decoder applies them (a transformers LogitsProcessor)."""

    def __init__(self, params: SamplingParams):
        self.params = params

    def __call__(self, input_ids, scores):
        return filter_logits(scores, self.params)


class _SampledLogprobs:
    """The last processor: at each step, the log-probability of the token sampled at the step before (the newest of
    `input_ids`) under that step's final scores; `finish` adds the last token's."""

    def __init__(self):
        self.last = None  # [N, V] the previous step's log-softmax
        self.logprobs = []  # [N] per sampled token

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.logprobs.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        self.last = torch.log_softmax(scores.float(), -1)
        return scores

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, T] log-probs of the [N, T] sampled tokens."""
        if self.last is not None and len(self.logprobs) < tokens.size(1):
            self.logprobs.append(self.last.gather(1, tokens[:, -1:]).squeeze(1))
        return torch.stack(self.logprobs, 1) if self.logprobs else tokens.new_zeros(tokens.shape, dtype=torch.float)


def sample_with_pixels(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pixels: dict,
                       params: SamplingParams, eos_ids: list[int], pad_id: int, seed: int) -> tuple:
    """([N, T] sampled tokens, [N, T] float32 their log-probs) for [N, P] left-padded prompts and their batched
    `pixels` (model_inputs.py), T <= params.max_new_tokens."""
    from transformers import LogitsProcessorList

    recorder = _SampledLogprobs()
    options = dict(do_sample=True, max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens or None,
                   temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=params.repetition_penalty,
                   suppress_tokens=list(params.suppress_tokens) or None,
                   begin_suppress_tokens=list(params.begin_suppress_tokens) or None, eos_token_id=list(eos_ids),
                   pad_token_id=pad_id, logits_processor=LogitsProcessorList([_Shaped(params), recorder]),
                   return_dict_in_generate=True)
    devices = [prompt_ids.device] if prompt_ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), **pixels, **options)
    tokens = out.sequences[:, prompt_ids.size(1):]
    return tokens, recorder.finish(tokens)
