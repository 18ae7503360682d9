"""What a subclass of a trainer may override, and the transformers / TRL methods it may not.

TRL's users subclass trainers. The methods below are called by posttrain's loop as transformers' and TRL's are, and
an override of one (calling `super()` where it trains or saves) works as it would there:

    training_step(model, inputs, num_items_in_batch)   each micro-batch's forward and backward (call super)
    compute_loss(model, inputs, return_outputs, num_items_in_batch)
                                                        each micro-batch's loss, which training_step backpropagates
                                                        (call super, change what it returns)
    log(logs, start_time)                               every record: steps, evaluations, the summary
    evaluate(eval_dataset, ignore_keys, metric_key_prefix)   also what eval_strategy calls during training
    save_model(output_dir, _internal_call)              the final save (checkpoints write their own files)
    push_to_hub(commit_message, ...)                    the end-of-training push
    close() / end()                                     the end of a script

The methods in UNCALLED are transformers' or TRL's internals, which posttrain's loop does not have: an override of
one would never run, so a trainer whose class defines one stops at construction with what to do instead.
"""

from posttrain.errors import UserError

_OWN_STEP = "posttrain computes the loss in its own step: override compute_loss(model, inputs, return_outputs, " \
            "num_items_in_batch) to change each micro-batch's loss, or choose the loss with the config (loss_type)"
_OWN_DATA = "posttrain prepares and batches the rows itself (calling get_train_dataloader() gives what it batches): " \
            "prepare the dataset before passing it, and override training_step(model, inputs) to see each micro-batch"
_OWN_OPTIMIZER = "pass optimizers=(optimizer, lr_scheduler) or optimizer_cls_and_kwargs to the trainer instead"
_OWN_ROUND = "posttrain generates and scores in its own round (grpo/rollout.py): put the scoring in reward_funcs"
_OWN_LOOP = "use a TrainerCallback (on_log, on_save, on_evaluate, ...) or override log / save_model / evaluate"
_OWN_EVAL = "evaluate() computes the metrics itself: pass compute_metrics (SFT, DPO, KTO, the reward model) or override evaluate"

UNCALLED = {
    "_compute_loss": _OWN_STEP, "get_batch_loss_metrics": _OWN_STEP,
    "concatenated_forward": _OWN_STEP, "_get_per_token_logps_and_entropies": _OWN_STEP,
    "compute_ref_log_probs": _OWN_STEP,
    "get_train_dataloader": _OWN_DATA, "get_eval_dataloader": _OWN_DATA, "_get_train_sampler": _OWN_DATA,
    "_prepare_dataset": _OWN_DATA, "_prepare_inputs": _OWN_DATA,
    "create_optimizer": _OWN_OPTIMIZER, "create_scheduler": _OWN_OPTIMIZER,
    "create_optimizer_and_scheduler": _OWN_OPTIMIZER,
    "_generate_and_score_completions": _OWN_ROUND, "_generate": _OWN_ROUND, "_generate_single_turn": _OWN_ROUND,
    "_calculate_rewards": _OWN_ROUND,
    "_inner_training_loop": _OWN_LOOP, "_maybe_log_save_evaluate": _OWN_LOOP, "_save_checkpoint": _OWN_LOOP,
    "_save": _OWN_LOOP, "_load_from_checkpoint": _OWN_LOOP,
    "prediction_step": _OWN_EVAL, "evaluation_loop": _OWN_EVAL,
}


def refuse_uncalled_overrides(cls: type) -> None:
    """Stop when `cls`, or a user's class between it and posttrain's trainer, defines a method of UNCALLED, naming it
    and what to do instead. (posttrain's own classes define the DataLoader getters to be called, not overridden:
    training/loaders.py.)"""
    base = next(klass for klass in cls.__mro__ if klass.__module__.startswith("posttrain."))
    for klass in cls.__mro__:
        if klass is base:
            break
        for name in UNCALLED:
            if name in vars(klass):
                raise UserError(f"{klass.__name__}.{name} overrides a transformers/TRL method that posttrain's "
                                f"{base.__name__} never calls, so the override would be ignored: {UNCALLED[name]}.")
