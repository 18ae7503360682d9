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

A callback is checked when it is added (`checked_callback`): a class that cannot be built without arguments, an
object with no event method (a function, a string), a method named like an event but misspelled (it would never be
called), or an event method that cannot take what its event passes is refused in one sentence, before training.
"""

import reprlib

from posttrain.configs import ConfigError, resolve_steps, suggest
from posttrain.errors import described, function_name, signature_mismatch
from posttrain.timeouts import waiting_on

EVENTS = ("on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
          "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end", "on_step_end", "on_evaluate", "on_predict",
          "on_save", "on_log", "on_prediction_step", "on_push_begin")
# what every event passes after (args, state, control), and what some events add (as transformers passes them)
COMMON_KWARGS = ("model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader")
EVENT_KWARGS = {"on_log": ("logs",), "on_evaluate": ("metrics",), "on_predict": ("metrics",)}


def _named(callback) -> str:
    """A refused callback as a message names it: a function by its name, another object by its value or class."""
    if callable(callback) and hasattr(callback, "__qualname__"):
        return f"the function {function_name(callback)!r}"
    if isinstance(callback, (str, int, float, dict, list, tuple)):
        return f"{reprlib.repr(callback)} ({type(callback).__name__})"
    return f"an instance of {type(callback).__name__}"


def checked_callback(callback):
    """`callback` as the handler keeps it, a class instantiated as transformers does; one sentence (ConfigError) for a
    class that cannot be built without arguments, an object with no event method, a misspelled event method, or an
    event method that cannot take what its event passes."""
    if isinstance(callback, type):
        problem = signature_mismatch(callback)
        if problem is not None:
            raise ConfigError(f"The callback class {callback.__name__} cannot be built without arguments ({problem}), "
                              f"as a class given in callbacks is: pass an instance, {callback.__name__}(...), "
                              "instead.")
        callback = callback()
    events = [event for event in EVENTS if callable(getattr(callback, event, None))]
    if not events:
        raise ConfigError(f"callbacks holds {_named(callback)}, which has none of a TrainerCallback's event methods "
                          "(on_log, on_step_end, ...): pass an instance of a transformers.TrainerCallback subclass "
                          "that overrides the events it handles.")
    for name in dir(callback):
        close = suggest(name, EVENTS) if name.startswith("on_") and name not in EVENTS else ""
        if close and callable(getattr(callback, name, None)):
            raise ConfigError(f"The callback {type(callback).__name__} defines {name}, which is no callback event, so "
                              f"it would never be called: rename it.{close}")
    for event in events:
        method = getattr(callback, event)
        passed = dict.fromkeys(COMMON_KWARGS + EVENT_KWARGS.get(event, ()))
        problem = signature_mismatch(method, None, None, None, **passed)
        if problem is not None:
            own = "".join(f", {name}=..." for name in EVENT_KWARGS.get(event, ()))
            raise ConfigError(f"The callback method {described(method)} cannot take what {event} passes, (args, state, "
                              f"control, model=..., optimizer=..., lr_scheduler=...{own}, ...) ({problem}): give it the "
                              "signature (self, args, state, control, **kwargs), as TrainerCallback's methods have.")
    return callback


class CallbackHandler:
    """The trainer's callbacks, and the event calls into them.

    Args:
        callbacks: callbacks or callback classes (instantiated here), each checked (checked_callback).
        trainer: gives args, state, control and the objects passed as kwargs.
    """

    def __init__(self, callbacks, trainer):
        self.callbacks = []
        self.trainer = trainer
        for cb in callbacks or []:
            self.add(cb)

    def add(self, callback) -> None:
        self.callbacks.append(checked_callback(callback))

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
            with waiting_on(f"callback {type(cb).__name__}.{event}"):  # user code: an interrupt stops it
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
