"""Callbacks, called as transformers' Trainer calls them, and the default flow that decides when to log, evaluate
and save.

A callback is a `transformers.TrainerCallback` (or any object with some of its methods, or a class of either, which
is instantiated). Each event is called as `callback.on_<event>(args, state, control, **kwargs)` with the kwargs
transformers passes (model, processing_class, optimizer, lr_scheduler, train_dataloader, eval_dataloader, and the
event's own: logs, metrics). A callback may set `control.should_log`, `should_evaluate`, `should_save`,
`should_epoch_stop` or `should_training_stop`, and the loop honours it; one that returns a control object
replaces the control, as in transformers.

`state` is a `transformers.TrainerState` and `control` a `transformers.TrainerControl`: the same objects reward
functions receive as `trainer_state`.
"""

from posttrain.configs import resolve_steps

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate", "on_predict",
          "on_save", "on_log", "on_prediction_step", "on_push_begin")


class CallbackHandler:
    """The trainer's callbacks, and the event calls into them.

    Args:
        callbacks: callbacks or callback classes (instantiated here).
        trainer: gives args, state, control and the objects passed as kwargs.
    """

    def __init__(self, callbacks, trainer):
        self.callbacks = []
        self.trainer = trainer
        for cb in callbacks or []:
            self.add(cb)

    def add(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop(self, callback):
        """Remove and return `callback` (an instance, or the first instance of a class); None if absent."""
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and isinstance(cb, callback)):
                self.callbacks.remove(cb)
                return cb
        return None

    def call(self, event: str, **kwargs):
        """Run `event` on every callback; returns the (possibly replaced) control."""
        t = self.trainer
        control = t.control
        if event == "on_train_begin":
            control.should_training_stop = False
        elif event == "on_epoch_begin":
            control.should_epoch_stop = False
        elif event == "on_step_begin":
            control.should_log = control.should_evaluate = control.should_save = False
        common = dict(model=t.model, processing_class=t.processing_class, optimizer=t.optimizer,
                      lr_scheduler=t.lr_scheduler, train_dataloader=None, eval_dataloader=None)
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is None:
                continue
            result = method(t.args, t.state, control, **common, **kwargs)
            if result is not None:
                control = result
        t.control = control
        return control


class Intervals:
    """The step intervals of a run of `total_steps` optimizer steps (fractions resolved, eval_steps defaulted)."""

    def __init__(self, args, total_steps: int):
        self.logging = resolve_steps(args.logging_steps, total_steps)
        self.save = resolve_steps(args.save_steps, total_steps)
        eval_steps = args.eval_steps if args.eval_steps is not None else args.logging_steps
        self.eval = resolve_steps(eval_steps, total_steps)


def flow_after_step(args, state, control, intervals: Intervals) -> None:
    """transformers' DefaultFlowCallback.on_step_end, plus a log at the last step so no window is lost."""
    step, last = state.global_step, state.global_step >= state.max_steps
    if args.logging_strategy == "steps" and (step % intervals.logging == 0 or last):
        control.should_log = True
    if step == 1 and args.logging_first_step and args.logging_strategy != "no":
        control.should_log = True
    if args.eval_strategy == "steps" and args.eval_delay <= step and (step % intervals.eval == 0 or last):
        control.should_evaluate = True
    if args.save_strategy == "steps" and (step % intervals.save == 0 or last):
        control.should_save = True
    if last:
        control.should_training_stop = True


def flow_after_epoch(args, state, control) -> None:
    """transformers' DefaultFlowCallback.on_epoch_end."""
    if args.logging_strategy == "epoch":
        control.should_log = True
    if args.eval_strategy == "epoch" and args.eval_delay <= state.epoch:
        control.should_evaluate = True
    if args.save_strategy == "epoch":
        control.should_save = True
