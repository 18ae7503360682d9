"""async_generation: a rollout worker samples and scores the next rounds while the trainer steps.

    worker thread (each process)                    trainer (main thread)
    round r: wait until the engine holds weights     step t: take the next round from the queue; drop it when it is
             recent enough for the step r trains at          more than max_staleness syncs old (the processes
             (and fewer than `ahead` rounds wait)            agree on the stalest share); gather its rewards, then
             generate holding the engine, score              advantages, log-probs, the loss (grpo/rollout.py)
             -> queue (round, version)               after a step whose count is a multiple of weight_sync_steps:
                                                             push the weights holding the engine -> that version

A version is the number of optimizer steps the weights had taken when they were synced; a round sampled with
version v and trained at step t (steps taken before it) is (t // W - v // W) syncs stale, W = weight_sync_steps. The
worker starts round r only once the engine holds version >= W * (t_r // W - max_staleness), t_r the step it is
planned for, so rounds are not sampled only to be dropped; at max_staleness 0 every round waits for the weights of
its own step, which is synchronous GRPO's order, bit for bit.

Nothing runs a collective on the worker's thread: its failure is handed to the trainer, which raises it inside
`guarded`, so every process stops with it. A worker without a sign of life for heartbeat_stale_after_s stops the run.
"""

import collections
import contextlib
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from posttrain.errors import UserError
from posttrain.timeouts import waiting_on
from posttrain.training.distributed import guarded


class RolloutWorkerError(UserError, RuntimeError):
    """The rollout worker hung or stopped without a reason."""


@dataclass
class SampledRound:
    """A round the worker sampled: `local` (grpo/rollout.py LocalRound), the weights' `version` it was sampled with,
    and its `index` in the prompt stream (rounds drawn since the run's start)."""

    local: object
    version: int
    index: int


class RolloutWorker:
    """The thread that samples rounds ahead of the trainer.

    Args:
        draw: () -> the prompt stream's next round (only this thread reads the stream while it runs).
        sample: (prompt round, step, engine) -> LocalRound (Rollout.sample_local; `engine` the context to generate in).
        plan: round index -> (the steps taken before the step it trains at, the version it needs).
        ahead: the most rounds sampled beyond those the trainer has taken.
        heartbeat_s: seconds without a sign of life after which the worker counts as hung.
        next_index: the first round to draw; queue: rounds sampled before a resume.
    """

    def __init__(self, draw: Callable, sample: Callable, plan: Callable, *, ahead: int, heartbeat_s: float,
                 next_index: int = 0, queue=()):
        self._draw, self._sample, self._plan = draw, sample, plan
        self.ahead, self.heartbeat_s = ahead, heartbeat_s
        self._cond = threading.Condition()
        self.engine_lock = threading.Lock()  # held while the engine generates or takes weights
        self.queue = collections.deque(queue)
        self.next_index = next_index
        self.taken = next_index - len(self.queue)  # rounds the trainer has taken (dropped ones included)
        self.published: int | None = None  # the version the engine holds
        self.held = self.busy = self.stopping = False
        self.error: BaseException | None = None
        self.beat = time.monotonic()
        self.waited = 0.0  # seconds spent waiting for weights or room, since last collected
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="posttrain-rollout-worker", daemon=True)
        self._thread.start()

    def _may_start(self) -> bool:
        if self.next_index >= self.taken + self.ahead or self.published is None:
            return False
        return self.published >= self._plan(self.next_index)[1]

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    started = time.monotonic()
                    while not self.stopping and (self.held or not self._may_start()):
                        self._cond.wait(0.5)
                        self.beat = time.monotonic()
                    if self.stopping:
                        return
                    self.waited += time.monotonic() - started
                    self.busy, index = True, self.next_index
                item = self._produce(index)
                with self._cond:
                    self.queue.append(item)
                    self.next_index += 1
                    self.busy, self.beat = False, time.monotonic()
                    self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the trainer, which stops every process with it
            with self._cond:
                self.error, self.busy = error, False
                self._cond.notify_all()

    def _produce(self, index: int) -> SampledRound:
        prompt_round = self._draw()
        self.beat = time.monotonic()
        version: list[int] = []

        @contextlib.contextmanager
        def engine():
            with self.engine_lock:  # no push lands while this round generates
                version.append(self.published)
                yield
            self.beat = time.monotonic()

        local = self._sample(prompt_round, self._plan(index)[0] + 1, engine)
        return SampledRound(local, version[0], index)

    # ------------------------------------------------------------------ the trainer's side

    def take(self) -> tuple[SampledRound, float, int]:
        """The next sampled round, the seconds waited for it and the rounds still queued; raises the worker's error,
        or RolloutWorkerError when it hung or stopped."""
        started = time.monotonic()
        with self._cond, waiting_on("the rollout worker (async_generation)"):
            while not self.queue or self.error is not None:
                self._check_alive()
                self._cond.wait(min(0.5, self.heartbeat_s / 4))
            item = self.queue.popleft()
            self.taken += 1
            self._cond.notify_all()
            return item, time.monotonic() - started, len(self.queue)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error
        if self._thread is None or not self._thread.is_alive():
            raise RolloutWorkerError("The rollout worker (async_generation) stopped without a round or an error: "
                                     "restart the run from its newest checkpoint.")
        silent = time.monotonic() - self.beat
        if silent > self.heartbeat_s:
            raise RolloutWorkerError(f"The rollout worker (async_generation) gave no sign of life for {silent:.0f} s "
                                     f"(heartbeat_stale_after_s={self.heartbeat_s:g}): a round's generation or reward "
                                     "functions hang; check the generation server and the reward functions, or raise "
                                     "heartbeat_stale_after_s.")

    def fail(self, error: BaseException) -> None:
        """A failure beside the worker's own (a background push): the trainer raises it when it next takes a round."""
        with self._cond:
            self.error = self.error or error
            self._cond.notify_all()

    def publish(self, version: int) -> None:
        """The engine now holds `version` (call holding engine_lock, after the push)."""
        with self._cond:
            self.published = version
            self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self):
        """No round in progress and none started within: for checkpoints, evaluation, a skipped epoch."""
        with self._cond:
            self.held = True
            while self.busy and self.error is None:
                self._cond.wait(0.5)
        try:
            yield
        finally:
            with self._cond:
                self.held = False
                self._cond.notify_all()

    def wait_settled(self, timeout_s: float) -> bool:
        """Wait until no round is in progress and none could start with the weights the engine holds and the room
        the queue has (or the worker failed or stops); False when `timeout_s` passed first. Between a step's update
        and its push, and after it, this fixes which weights each round is sampled with: for runs that must be
        reproducible to the bit (the resume tests), where the worker otherwise races the trainer."""
        with self._cond:
            return self._cond.wait_for(lambda: self.error is not None or self.stopping
                                       or not (self.busy or (not self.held and self._may_start())), timeout_s)

    def skip_until(self, end: int, on_taken: Callable) -> None:
        """Drop every round before index `end` (the rest of an epoch), queued or not yet drawn; `on_taken` is told of
        each. Call paused."""
        while self.queue and self.queue[0].index < end:
            on_taken(self.queue.popleft().local.prompt_round)
            self.taken += 1
        for _ in range(max(0, end - self.next_index)):
            on_taken(self._draw())
            self.next_index += 1
            self.taken += 1

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)  # a daemon thread: a round stuck in user code does not keep the process

    def collect_waited(self) -> float:
        with self._cond:
            waited, self.waited = self.waited, 0.0
            return waited


class AheadRounds:
    """The trainer's side of async_generation, a round source (grpo/round_source.py): starts the worker, takes its rounds within max_staleness, pushes the
    weights every weight_sync_steps, and carries the queue through checkpoints.

    Args:
        args: the GRPOConfig.
        accelerator: the run's.
        sample: Rollout.sample_local's arguments after the round: (prompt round, step, engine) -> LocalRound.
        gather: LocalRound -> the round gathered on every process (Rollout.gathered; the trainer's thread).
        draw: the prompt stream's next round; on_taken: told of each round the trainer takes or drops.
        push: sends the policy's current weights to the engine (a collective under sharding: every process calls it).
        next_index, queue: where a resumed run's worker starts, and the rounds it had sampled.
    """

    def __init__(self, args, accelerator, *, sample: Callable, gather: Callable, draw: Callable, on_taken: Callable,
                 push: Callable, next_index: int = 0, queue=(), extra_rounds: int = 0, exclusive_push: bool = True,
                 background: tuple[Callable, Callable] | None = None):
        self.args, self.accelerator, self._push, self._on_taken = args, accelerator, push, on_taken
        self._gather = gather
        self.exclusive_push = exclusive_push  # no round generates during a push (a copy of the policy in process)
        # (snapshot, send): a push sent by a thread of its own while the trainer steps on (posttrain serve)
        self._background, self._pushing = background, None
        self.extra_rounds = extra_rounds  # dynamic sampling's rounds beyond one per batch
        ahead = args.rounds_ahead(args.generation_batch_size, accelerator.num_processes)
        self.worker = RolloutWorker(draw, sample, self.plan, ahead=ahead, heartbeat_s=args.heartbeat_stale_after_s,
                                    next_index=next_index, queue=queue)
        self._stats = {"stale_dropped": 0.0, "trainer_wait_s": 0.0}
        self._staleness: list[int] = []
        self._depths: list[int] = []

    def plan(self, index: int) -> tuple[int, int]:
        """Round `index`'s step (the steps taken before the one it starts) and the version it needs; a generation
        batch is steps_per_generation x num_iterations micro-batches, gradient_accumulation_steps a step."""
        args = self.args
        micro = args.steps_per_generation * args.num_iterations
        step = (index - self.extra_rounds) * micro // args.gradient_accumulation_steps
        W = args.weight_sync_steps
        return step, W * max(0, step // W - args.max_staleness)

    def start(self, steps_taken: int) -> None:
        """Push the current weights (version `steps_taken`) and start sampling."""
        self.sync(steps_taken)
        self.worker.start()

    def sync(self, steps_taken: int) -> None:
        """Push the current weights as version `steps_taken`; holding the engine where the push and a generation
        cannot overlap (an in-process copy), else alongside the round in progress (a server orders the two)."""
        with self.worker.engine_lock if self.exclusive_push else contextlib.nullcontext():
            with guarded(self.accelerator):  # a push that fails on one process stops them all
                self._push()
            self.worker.publish(steps_taken)

    def after_step(self, steps_taken: int) -> None:
        if steps_taken % self.args.weight_sync_steps:
            return
        if self._background is None:
            return self.sync(steps_taken)
        snapshot, send = self._background
        self.wait_for_push()  # one push at a time
        with guarded(self.accelerator):  # the export (a collective under sharding) on the main thread
            weights = snapshot()

        def push():
            try:
                send(weights)
                self.worker.publish(steps_taken)
            except BaseException as error:  # noqa: BLE001 - the trainer raises it where it waits for rounds
                self.worker.fail(error)

        self._pushing = threading.Thread(target=push, name="posttrain-weight-push", daemon=True)
        self._pushing.start()

    def wait_for_push(self) -> None:
        """The push in flight (a background one) finished; its failure reaches the trainer through the worker."""
        if self._pushing is not None:
            self._pushing.join()
            self._pushing = None

    def next_round(self, step: int, extra: bool = False):
        """The round to train on at `step` (1-based, as reward functions are told), gathered on every process,
        skipping those more than max_staleness syncs old; `extra`: a dynamic-sampling round beyond the batch's
        first."""
        args, acc, W = self.args, self.accelerator, self.args.weight_sync_steps
        self.extra_rounds += int(extra)
        while True:
            with guarded(acc):  # the worker's failure (generation, tools, rewards) stops every process
                item, waited, depth = self.worker.take()
            staleness = (step - 1) // W - item.version // W
            worst = int(acc.gather(torch.tensor([staleness], device=acc.device)).max())
            self._stats["trainer_wait_s"] += waited
            self._on_taken(item.local.prompt_round)
            if worst <= args.max_staleness:
                self._staleness.append(worst)
                self._depths.append(depth)
                return self._gather(item.local)
            self._stats["stale_dropped"] += 1

    def metrics(self) -> dict:
        """async/* since the last call: rounds dropped as stale, their staleness (the mean over the rounds taken),
        the queue's depth when taken, seconds the trainer waited for rounds and the worker for weights or room
        (those two the processes' mean)."""
        acc = self.accelerator
        waits = torch.tensor([self._stats["trainer_wait_s"], self.worker.collect_waited()], device=acc.device)
        waits = acc.reduce(waits, reduction="mean").tolist()
        out = {"async/stale_dropped": self._stats["stale_dropped"],
               "async/staleness_mean": sum(self._staleness) / max(len(self._staleness), 1),
               "async/queue_depth": sum(self._depths) / max(len(self._depths), 1),
               "async/trainer_wait_s": waits[0], "async/generator_wait_s": waits[1]}
        self._stats = {"stale_dropped": 0.0, "trainer_wait_s": 0.0}
        self._staleness, self._depths = [], []
        return out

    def snapshot(self, sampler: torch.Generator) -> tuple[dict, dict, torch.Generator]:
        """(meta, tensors, the sampler's state) for a checkpoint, taken with the worker paused between rounds: its
        next round, dynamic sampling's extra rounds, the queue (pickled: rows as the dataset gave them), and a copy
        of `sampler` (the generator's RNG) as of that queue."""
        self.wait_for_push()
        with self.worker.paused():
            blob = torch.frombuffer(bytearray(pickle.dumps(list(self.worker.queue))), dtype=torch.uint8)
            copy = torch.Generator().set_state(sampler.get_state())
            return self._position(), {"async_queue": blob}, copy

    def _position(self) -> dict:
        """Where the worker stands: its next round, and dynamic sampling's extra rounds."""
        return {"next_index": self.worker.next_index, "extra_rounds": self.extra_rounds}

    @contextlib.contextmanager
    def evaluating(self, steps_taken: int):
        """The worker paused while evaluation samples (it pushes the current weights, version `steps_taken`)."""
        self.wait_for_push()
        with self.worker.paused():
            yield
            with self.worker.engine_lock:
                self.worker.publish(steps_taken)

    def skip_rest_of_epoch(self, rounds_per_epoch: int) -> None:
        """The rounds left in the current epoch dropped, sampled or not (a callback's should_epoch_stop)."""
        with self.worker.paused():
            taken = self.worker.taken
            self.worker.skip_until(taken + (-taken % rounds_per_epoch), self._on_taken)

    def close(self) -> tuple[dict, list]:
        """Stop the worker; returns where it stood (meta and queue, as a checkpoint holds them) for a restart."""
        self.wait_for_push()
        self.worker.stop()
        return {**self._position(), "stream_drawn": True}, list(self.worker.queue)


def start_ahead(args, accelerator, rollout, rounds, taken: int, on_taken: Callable, resumed, steps_taken: int
                ) -> AheadRounds:
    """The rollout worker of `rollout` (grpo/rollout.py) started where the run stands: `rounds` the prompt stream,
    `taken` rounds trained on (or dropped); `resumed` a checkpoint's (meta, queue) or None. The current weights
    (version `steps_taken`) are pushed first."""
    next_index = resumed[0]["next_index"] if resumed else taken
    if not (resumed and resumed[0].get("stream_drawn")):  # a checkpoint's stream stands at the rounds taken
        for _ in range(next_index - taken):  # the rounds the worker had drawn beyond those taken
            next(rounds)
    skip_bad = args.on_bad_reward == "skip"

    def sample(prompt_round, step: int, engine):
        return rollout.sample_local(prompt_round, args.num_generations, step, skip_bad, engine=engine)

    def gather(local):
        return rollout.gathered(local, args.num_generations, args.log_completions)

    sampler = rollout.sampler

    ahead = AheadRounds(args, accelerator, sample=sample, gather=gather, draw=lambda: next(rounds), on_taken=on_taken,
                        push=sampler.push_weights, next_index=next_index,
                        queue=resumed[1] if resumed else (), extra_rounds=resumed[0]["extra_rounds"] if resumed else 0,
                        exclusive_push=not sampler.generator.samples_during_push,
                        background=((sampler.weights_snapshot, lambda weights: sampler.generator.sync_weights(weights))
                                    if sampler.generator.pushes_in_background else None))
    ahead.start(steps_taken)
    return ahead


def queue_from_tensors(tensors: dict) -> list[SampledRound]:
    """The queue `AheadRounds.snapshot` saved (empty when the checkpoint has none)."""
    blob = tensors.get("async_queue")
    return [] if blob is None else pickle.loads(blob.cpu().numpy().tobytes())
