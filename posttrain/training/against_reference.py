"""The part DPO's and KTO's trainers share as trainers against a frozen reference (training/reference.py makes it):
the context the reference's passes run in (a LoRA policy with its adapters off), the policy before and after the
accelerator prepares it, TR-DPO's sync every ref_model_sync_steps, precomputed reference log-probs that can no
longer be computed, and the checkpoint's share: a map-style dataset's precomputed log-probs (what the run trains
against, restored whatever the cache holds now) and a synced reference.

A subclass keeps its prepared rows' precomputed log-probs in `self.batches.rows.ref` ([rows, 2] float64, or None).
"""

import contextlib

import torch

from posttrain.configs import ConfigError
from posttrain.models.peft import is_peft_model, reference_mode
from posttrain.models.preparation import mix_reference
from posttrain.sequences.batches import MapBatches
from posttrain.training.batched import BatchedDataTrainer
from posttrain.training.checkpoint import CheckpointError, CheckpointExtras, model_fingerprint
from posttrain.training.distributed import guarded


class AgainstReferenceTrainer(BatchedDataTrainer):
    """A subclass gives `_setup` and `_precompute_references`; `_setup` sets `_setup_model`."""

    _setup_model = None  # the policy as `_setup` prepared it, before the accelerator wraps it

    def _setup(self, model, ref_model, train_dataset, eval_dataset, processing_class, peft_config):
        """Load the policy (setting `_setup_model`) and the reference, prepare the data; return the policy."""
        raise NotImplementedError

    def _precompute_references(self, model) -> None:
        """precompute_ref_log_probs: every train (and eval) row's reference log-probs, while `model` still is the
        reference."""
        raise NotImplementedError

    def _build(self, model, ref_model, train_dataset, eval_dataset, processing_class, peft_config) -> None:
        """The end of construction, once the config and the accelerator exist: the subclass's `_setup` (the policy,
        the reference, the data; a failure on one process stops them all before DDP's first collective), the
        precomputed reference log-probs (collectives of their own: outside the guarded set-up), the optimizer."""
        with guarded(self.accelerator):
            model = self._setup(model, ref_model, train_dataset, eval_dataset, processing_class, peft_config)
        if self.args.precompute_ref_log_probs:
            self._precompute_references(model)
        self._model_fingerprint = model_fingerprint(model)
        self._prepare(model, self._total_steps())
        self._tokens_seen = 0
        self._call("on_init_end")

    def _reference_context(self):
        if self.reference_adapter is not None or (self.ref_model is None and is_peft_model(self.policy_or_model)):
            return reference_mode(self.policy_or_model, self.reference_adapter)
        return contextlib.nullcontext()

    @property
    def policy_or_model(self):
        """The unwrapped policy, also before the accelerator has prepared it."""
        return self.policy if self.policy is not None else self._setup_model

    @property
    def _no_grad_model(self):
        """What forwards without gradient call: the policy as training/sharding.forward_module says, also before the
        accelerator has prepared it."""
        return self.forward_policy if self.forward_policy is not None else self._setup_model

    def _sync_reference(self) -> None:
        """TR-DPO: after every ref_model_sync_steps-th update, ref = alpha * policy + (1 - alpha) * ref."""
        args = self.args
        if args.sync_ref_model and (self.state.global_step + 1) % args.ref_model_sync_steps == 0:
            self.sharding.at_rest(self.ref_model, self.model)
            mix_reference(self.ref_model, self.policy, args.ref_model_mixup_alpha)

    def _finish_step(self, metrics: dict, tokens: float) -> dict:
        """The shared step's end (training/batched.py), then TR-DPO's sync of the reference."""
        metrics = super()._finish_step(metrics, tokens)
        self._sync_reference()
        return metrics

    def _check_reference_computable(self, model) -> None:
        """With precompute_ref_log_probs and full fine-tuning, no reference is kept once training has started."""
        if model is None and self.ref_model is None and self.reference_adapter is None and \
                not is_peft_model(self.policy) and self.state.global_step > 0:
            raise ConfigError("Cannot compute reference log-probs for a dataset passed to evaluate() after training "
                              "started: with precompute_ref_log_probs=True and full fine-tuning no reference model is "
                              "kept. Pass it as eval_dataset to the trainer, pass a ref_model, or set "
                              "precompute_ref_log_probs=False.")

    # ------------------------------------------------------------------ the loop's hooks (training/trainer.py)

    def _checkpoint_extras(self) -> CheckpointExtras:
        """The batched trainers' data position; the precomputed reference log-probs of a map-style dataset (what the
        run trains against), and a synced reference."""
        extras = super()._checkpoint_extras()
        if isinstance(self.batches, MapBatches) and self.batches.rows.ref is not None:
            extras.tensors["ref_logps"] = torch.from_numpy(self.batches.rows.ref)
        if self.args.sync_ref_model:
            extras.models["ref_model"] = self.ref_model
        return extras

    def _restore_position(self, state: dict, tensors: dict) -> None:
        super()._restore_position(state, tensors)
        if "ref_logps" in tensors and isinstance(self.batches, MapBatches):
            saved = tensors["ref_logps"].cpu().numpy()
            if saved.shape != (len(self.batches.rows), 2):
                raise CheckpointError(f"Cannot resume: the checkpoint's reference log-probs are for {saved.shape[0]} "
                                      f"{self._data_noun} and this run has {len(self.batches.rows)}; resume with the "
                                      "same data.")
            self.batches.rows.ref = saved  # what the interrupted run trained against
