"""Model and tokenizer loading, and per-token log-probabilities."""

from posttrain.models.forwards import completion_logits
from posttrain.models.keywords import logits_to_keep_kwarg, unwrap
from posttrain.models.loading import load_causal_lm, load_tokenizer
from posttrain.models.logprobs import token_logprobs

__all__ = ["load_causal_lm", "load_tokenizer", "unwrap", "completion_logits", "logits_to_keep_kwarg",
           "token_logprobs"]
