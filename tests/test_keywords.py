"""The keywords posttrain passes to a model, under the names the installed transformers and the model's own forward
use (models/keywords.py); no deprecation warning from posttrain's own calls."""

import contextlib
import dataclasses
import logging
import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import Qwen2ForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from posttrain.generation import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.models import logprobs
from posttrain.models.keywords import (FORWARD_NAMES, cache_kwarg, forward_keyword,
                                       missing_from_forward, returned_cache, transformers_cache_name)
from posttrain.models.loading import load_causal_lm
from posttrain.models.packed_layouts import PADDED_ONLY, PADDED_ROWS, packed_layouts
from posttrain.testing import tiny_model

CACHE = transformers_cache_name()


class OldNamesLM(Qwen2ForCausalLM):
    """A forward written before the renames (transformers 4.45-4.49, or remote code of that time)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                num_logits_to_keep=0, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **{CACHE: past_key_values}, use_cache=use_cache, logits_to_keep=num_logits_to_keep,
                               **kwargs)


class NewNamesLM(Qwen2ForCausalLM):
    """A forward with transformers 5.24's names, whatever transformers is installed."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **{CACHE: cache}, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)


class KwargsOnlyLM(Qwen2ForCausalLM):
    """A forward that names nothing (a wrapper's `*args, **kwargs`)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


def test_each_keyword_is_the_forwards_own_name(tokenizer):
    """The name the model's forward gives each keyword; transformers' own for a forward that names none."""
    old, new, anonymous = (tiny_model(tokenizer, hidden=16, layers=1, model_class=cls)
                           for cls in (OldNamesLM, NewNamesLM, KwargsOnlyLM))
    assert (cache_kwarg(old), forward_keyword(old, "logits_to_keep")) == ("past_key_values", "num_logits_to_keep")
    assert (cache_kwarg(new), forward_keyword(new, "logits_to_keep")) == ("cache", "logits_to_keep")
    assert cache_kwarg(anonymous) == CACHE and forward_keyword(anonymous, "logits_to_keep") is None
    assert CACHE == ("cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values")
    assert missing_from_forward(new, tuple(FORWARD_NAMES) + ("position_ids",)) is None
    assert missing_from_forward(anonymous, ("position_ids", "cache")) == (
        f"its forward (KwargsOnlyLM, transformers {transformers.__version__}) takes no `position_ids`, none of "
        "`cache`, `past_key_values`, `cache_params`")


@dataclasses.dataclass
class _OutputBefore524:
    logits: torch.Tensor
    past_key_values: object = None


def test_the_returned_cache_is_read_from_the_outputs_own_field():
    """transformers 5.24's outputs hold `cache` (their `past_key_values` is a warning alias); older ones, and remote
    code's, `past_key_values`."""
    marker = object()
    with _deprecations() as said:
        assert returned_cache(CausalLMOutputWithPast(logits=torch.zeros(1), **{CACHE: marker})) is marker
        assert returned_cache(_OutputBefore524(torch.zeros(1), marker)) is marker
    assert said == []


@pytest.mark.parametrize("model_class", [OldNamesLM, NewNamesLM, Qwen2ForCausalLM])
def test_decodes_and_shared_prompts_work_whatever_the_forward_calls_its_cache(tokenizer, monkeypatch, model_class):
    """The forward's decode (a KV cache passed back at every step) samples what the plain model samples, and the
    log-prob pass shares prompts (two forwards, the second against the first's selected cache) with the unshared
    pass's values, under either name of the cache."""
    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 0)  # tiny models: see tests/test_prompt_sharing.py
    plain = tiny_model(tokenizer, seed=4, hidden=32, layers=2)
    model = tiny_model(tokenizer, seed=4, hidden=32, layers=2, model_class=model_class)
    prompts = [tokenizer(t, add_special_tokens=False).input_ids for t in ("1+2=", "a longer prompt", "x")] * 3
    params = SamplingParams(max_new_tokens=6, temperature=0.9, min_new_tokens=6)
    with _deprecations() as said:
        ours = TransformersGenerator(model, tokenizer, params, seed=3, lean=False).generate(prompts)
        assert logprobs.prompt_sharing_works(model)
        batch = (ours.prompt_ids, ours.prompt_mask, ours.completion_ids, ours.completion_mask)
        shared, _ = logprobs.token_logprobs(model, *batch, temperature=0.9, share_prompts=True, packing=False)
    assert said == []
    theirs = TransformersGenerator(plain, tokenizer, params, seed=3, lean=False).generate(prompts)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    unshared, _ = logprobs.token_logprobs(plain, *batch, temperature=0.9, share_prompts=False, packing=False)
    real = ours.completion_mask.bool()
    assert torch.allclose(shared[real], unshared[real], atol=1e-5)


class NoCacheLM(Qwen2ForCausalLM):
    """Returns no cache however asked (a cache under a name of its own, or none)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        setattr(out, CACHE, None)
        return out


def test_a_decode_without_a_returned_cache_stops_with_one_sentence(tokenizer):
    """Without its cache each step would see one token: noise sampled as if it were the model's."""
    from posttrain.errors import UserError

    model = tiny_model(tokenizer, hidden=16, layers=1, model_class=NoCacheLM)
    generator = TransformersGenerator(model, tokenizer, SamplingParams(max_new_tokens=3), seed=0, lean=False)
    with pytest.raises(UserError, match=r"^NoCacheLM returned no KV cache from a forward with use_cache=True \(passed "
                                        rf"as `{CACHE}`\), so it cannot be sampled from token by token in process: "):
        generator.generate([[5, 6, 7]])


def test_a_fast_path_off_for_a_missing_keyword_is_said_once_with_the_versions(tokenizer, caplog):
    model = tiny_model(tokenizer, hidden=16, layers=1, model_class=KwargsOnlyLM)
    with caplog.at_level("WARNING", logger="posttrain"):
        for _ in range(2):
            assert packed_layouts(model) == PADDED_ONLY
            assert not logprobs.prompt_sharing_works(model)
    forward = f"its forward (KwargsOnlyLM, transformers {transformers.__version__}) takes"
    assert [r.getMessage() for r in caplog.records] == [
        f"KwargsOnlyLM: {PADDED_ROWS}, because {forward} no `position_ids`.",
        f"KwargsOnlyLM: {logprobs.SHARING_OFF}, because {forward} no `position_ids`, none of `cache`, "
        "`past_key_values`, `cache_params`, no `use_cache`, neither `logits_to_keep` nor `num_logits_to_keep`."]


@pytest.mark.parametrize("given", ["dtype", "torch_dtype"])
def test_a_dtype_under_either_name_loads_under_the_installed_name(tiny_model_dir, given):
    with _deprecations() as said:
        model = load_causal_lm(str(tiny_model_dir), {given: "bfloat16"})
    assert model.dtype == torch.bfloat16 and said == []  # passed on as `dtype`: torch_dtype would warn


def test_a_training_run_raises_no_deprecation_warning(tmp_path, tokenizer, addition_dataset, monkeypatch):
    """A GRPO run with packed rows and shared prompts on the installed transformers: nothing posttrain calls says
    it is deprecated (transformers' FutureWarnings and its `warning_once` logs alike)."""
    from conftest import length_reward, tiny_config

    from posttrain import GRPOTrainer

    monkeypatch.setattr(logprobs, "MIN_SHARED_SAVING_FLOP", 0)
    model = tiny_model(tokenizer, hidden=32, layers=2)
    with _deprecations() as said:
        GRPOTrainer(model=model, reward_funcs=length_reward, processing_class=tokenizer,
                    args=tiny_config(tmp_path, max_steps=2, num_iterations=2), train_dataset=addition_dataset).train()
    assert logprobs.prompt_sharing_works(model) and packed_layouts(model).rows
    assert said == []


@contextlib.contextmanager
def _deprecations():
    """Collects what transformers (and anything else) says is deprecated in the block: Python warnings, and
    transformers' log records, whose `warning_once` memory is cleared first so that an earlier test cannot hide
    one."""
    said = []

    class Collect(logging.Handler):
        def emit(self, record):
            if "deprecat" in record.getMessage().lower():
                said.append(record.getMessage())

    transformers.utils.logging.warning_once.cache_clear()
    handler = Collect()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield said
        said.extend(str(w.message) for w in caught
                    if issubclass(w.category, (DeprecationWarning, FutureWarning, PendingDeprecationWarning)))
    finally:
        logger.removeHandler(handler)
