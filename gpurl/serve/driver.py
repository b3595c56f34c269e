"""The rollout engine's stream driven by requests that arrive from other threads.

HTTP handlers (on the server's event loop) call `Driver.submit` with a call's requests
(its `n` choices, one prompt) and a callback; the thread that owns the engine calls
`Driver.step` in a loop: the submissions so far join the stream (`Engine.stream`,
continuous batching: a call's rows fill free decode slots while others decode, and the
prefix cache serves every prefix a session sent before), one scheduling iteration runs,
and every finished call's callback gets its completions. A streaming call's callback is
also given each choice's tokens as they grow. The driver never blocks the event loop;
the callbacks are the caller's to hand back to it (`loop.call_soon_threadsafe`).

In continuous RL (`gpurl.rollout.continuous`) the stream is the run's, iterated by its
batch source: the driver then only `admit`s the submissions before each iteration and is
offered each finished request (`deliver`).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gpurl.models.spec import Params
from gpurl.rollout.engine import Engine, Stream
from gpurl.rollout.requests import Completion, Request

Done = Callable[[list[Completion]], None]
Progress = Callable[[int, list[int], list[float]], None]  # (choice, tokens so far, their log-probs)


@dataclass
class _Call:
    done: Done
    progress: Progress | None
    tag: Any = None  # who made the call (a training session), for `flying`
    indices: list[int] = field(default_factory=list)
    shown: list[int] = field(default_factory=list)  # tokens given to `progress`, per choice


class Driver:
    """Submissions -> completions on one engine stream (`step` from the engine's thread)."""

    def __init__(self, engine: Engine, prefill_width: int = 0, version: int = 0):
        self.engine, self.prefill_width, self.version = engine, prefill_width, version
        self.stream: Stream | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[int, _Call] = {}  # by the index of a call's first request
        self._owner: dict[int, int] = {}  # request index -> its call's key
        self._wake = threading.Event()

    def submit(self, requests: Sequence[Request], done: Done,
               progress: Progress | None = None, tag: Any = None) -> None:
        """Queues one call's requests (thread-safe); `done(completions)` is called from the
        engine's thread once all of them finished."""
        self._inbox.put((list(requests), _Call(done, progress, tag)))
        self._wake.set()

    def queued(self) -> int:
        """Calls submitted and not yet added to the stream."""
        return self._inbox.qsize()

    def pending(self) -> int:
        """Calls submitted and not finished."""
        return self._inbox.qsize() + len(self._calls)

    def wait(self, timeout: float) -> None:
        """Sleeps until a submission arrives or `timeout` seconds pass."""
        self._wake.wait(timeout)
        self._wake.clear()

    def step(self, params: Params) -> bool:
        """Adds the submissions so far, runs one scheduling iteration (every process of the
        job together) and hands out what finished; whether the engine is busy."""
        if self.stream is None:
            self.stream = Stream(self.engine, self.prefill_width, pool=self.engine._pool)
        self.admit()
        busy = self.stream.iterate(params, self.version)
        self._progress()
        for index, completion in self.stream.finished():
            self.deliver(index, completion)
        return busy

    def admit(self) -> int:
        """The submissions so far join the stream; how many calls did."""
        added = 0
        while True:
            try:
                requests, call = self._inbox.get_nowait()
            except queue.Empty:
                return added
            call.indices = self.stream.add(requests)
            call.shown = [0] * len(requests)
            self._calls[call.indices[0]] = call
            for i in call.indices:
                self._owner[i] = call.indices[0]
            added += 1

    def deliver(self, index: int, completion: Completion) -> bool:
        """A finished request of the stream: its call's, when it is one of the driver's
        (the call's `done` gets its completions once all finished); False when not."""
        key = self._owner.pop(index, None)
        if key is None:
            return False
        call = self._calls[key]
        if all(i not in self._owner for i in call.indices):
            del self._calls[key]
            call.done([completion if i == index else self.stream.sched.done[i]
                       for i in call.indices])
        return True

    def flying(self, tags: set) -> list[int]:
        """The stream indices of the unfinished requests of calls made by `tags`."""
        return [i for call in self._calls.values() if call.tag in tags
                for i in call.indices if i in self._owner]

    def cancel(self, tags: set | None = None) -> None:
        """The unfinished calls made by `tags` (None: every call) leave the stream; each is
        answered with no completions (its caller has ended: the route refuses it)."""
        calls = [c for c in self._calls.values() if tags is None or c.tag in tags]
        while tags is None:  # the calls not yet admitted too
            try:
                calls.append(self._inbox.get_nowait()[1])
            except queue.Empty:
                break
        indices = {i for c in calls for i in c.indices if i in self._owner}
        if indices and self.stream is not None:
            self.stream.cancel(indices)
        for call in calls:
            for i in call.indices:
                self._owner.pop(i, None)
            if call.indices:
                self._calls.pop(call.indices[0], None)
            call.done([])

    def streamed(self) -> None:
        """Gives streaming calls their tokens sampled so far (after an iteration)."""
        self._progress()

    def close(self) -> None:
        """Keeps the stream's KV pool for the engine's next generation, and its counts as
        the engine's last (`Engine.stats`)."""
        if self.stream is not None:
            self.engine._pool = self.stream.pool
            self.engine.stats = dict(self.stream.stats)
            self.stream = None

    def _progress(self) -> None:
        for call in self._calls.values():
            if call.progress is None:
                continue
            for choice, i in enumerate(call.indices):
                live = self.stream.sched.lives[i]
                if i in self.stream.sched.done or len(live.tokens) <= call.shown[choice]:
                    continue
                call.shown[choice] = len(live.tokens)
                call.progress(choice, list(live.tokens), list(live.logprobs))
