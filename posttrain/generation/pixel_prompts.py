"""Sampling prompts that carry pixels (a vision-language model's images) in process, through transformers'
`generate`: each family's own contract drives its prefill and steps (Qwen-VL's multimodal rotary offsets, Gemma 3's
bidirectional image attention, LLaVA's image features), as TRL samples such prompts without vLLM.

    tokens, logprobs = sample_with_pixels(model, prompt_ids, prompt_mask, pixels, params, eos_ids, pad_id, streams)

The sampled distribution is the in-process decoder's: transformers' processors for the repetition penalty, the
minimum length and the suppressed tokens, then this module's for temperature, top-k, top-p and min-p (the same
`filter_logits`); the draw is the in-process decoder's too (`sampling.sample` with each row's counter-based stream),
made by the last processor, which leaves only the drawn token to `generate`'s greedy choice and keeps its
log-probability. So a row samples the same completion whichever rows are sampled beside it (another process's
share, a server request), as text prompts do.
"""

import torch

from posttrain.generation.protocol import SamplingParams
from posttrain.generation.sampling import filter_logits, sample, stream_uniforms


class _Shaped:
    """Temperature, top-k, top-p and min-p, as the in-process decoder applies them (a transformers LogitsProcessor)."""

    def __init__(self, params: SamplingParams):
        self.params = params

    def __call__(self, input_ids, scores):
        return filter_logits(scores, self.params)


class _Drawn:
    """The last processor: each row's token drawn from the final scores with the uniform number of its stream for
    this step (as the in-process decoder draws it), its log-probability kept, and the scores left -inf everywhere but
    at the drawn token, which `generate`'s greedy choice then takes."""

    def __init__(self, streams: torch.Tensor, prompt_width: int):
        self.streams, self.prompt_width = streams, prompt_width
        self.logprobs = []  # [N] per step

    def __call__(self, input_ids, scores):
        step = input_ids.size(1) - self.prompt_width
        token, logp = sample(scores, stream_uniforms(self.streams, step))
        self.logprobs.append(logp)
        return torch.full_like(scores, float("-inf")).scatter_(1, token.unsqueeze(1), 0.0)

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, T] float32 log-probs of the [N, T] sampled tokens."""
        if not self.logprobs:
            return tokens.new_zeros(tokens.shape, dtype=torch.float)
        return torch.stack(self.logprobs[:tokens.size(1)], 1).float()


def sample_with_pixels(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pixels: dict,
                       params: SamplingParams, eos_ids: list[int], pad_id: int, streams: torch.Tensor) -> tuple:
    """([N, T] sampled tokens, [N, T] float32 their log-probs) for [N, P] left-padded prompts and their batched
    `pixels` (model_inputs.py), each row drawing from its stream ([N] int64, sampling.row_streams),
    T <= params.max_new_tokens."""
    from transformers import LogitsProcessorList

    drawn = _Drawn(streams.to(prompt_ids.device), prompt_ids.size(1))
    options = dict(do_sample=False, max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens or None,
                   repetition_penalty=params.repetition_penalty,
                   suppress_tokens=list(params.suppress_tokens) or None,
                   begin_suppress_tokens=list(params.begin_suppress_tokens) or None, eos_token_id=list(eos_ids),
                   pad_token_id=pad_id, logits_processor=LogitsProcessorList([_Shaped(params), drawn]),
                   return_dict_in_generate=True, temperature=None, top_k=None, top_p=None)
    out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), **pixels, **options)
    tokens = out.sequences[:, prompt_ids.size(1):]
    return tokens, drawn.finish(tokens)
