"""Where a vLLM backend's SMC step goes: `StepPhases` times the stretches between marks set on
the backend's own objects (its engine, engine loop, live requests, request planner, output
cache and batcher), one after the other around a step, in wall time (`time.perf_counter`).

A step runs, in order, from the start of the engine's step to the start of the next:

- "engine step, to the rows": vLLM's `LLMEngine.step` (scheduling, the model's forward) until
  its sampler hands the capture the step's logits;
- "rows' log-softmax": the capture's log-softmax of them (the API's log-probabilities; the
  decode floor's steps run it too, the capture sitting in the engine's sampler);
- "engine step, after the rows": the rest of the engine's step (sampling, its bookkeeping);
- "fed requests parked": the live requests whose input the step computed wait idle again;
- "rows taken": the step's rows read from the capture;
- "rows stored": the output cache's copy of them;
- "to the event loop": the step's batch answered on the engine thread, until the batcher starts
  answering its callers (one thread hands over to the other);
- "callers answered, called again": the N callers get their rows and resume, the program's own
  code runs, and the N next calls arrive (their ids checked, the output cache looked up, the
  batcher's wait for a quiet event loop);
- "batch planned and posted": the batch made into engine requests and handed to the engine
  thread;
- "to the engine thread": until the engine thread takes them;
- "requests admitted": the requests fed to their idle live requests, or entered;
- "until the step": from there to the next engine step.

Steps whose marks came in another order (a resampling step's new requests admitted in two
rounds, a batch split by the batcher) are left out and counted (`irregular`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from statistics import median
from typing import Any

# (mark, the phase it ends), in a regular step's order; the first mark starts the step.
_MARKS = (
    ("step start", "until the step"),
    ("log-softmax start", "engine step, to the rows"),
    ("log-softmax end", "rows' log-softmax"),
    ("step end", "engine step, after the rows"),
    ("parked", "fed requests parked"),
    ("store start", "rows taken"),
    ("store end", "rows stored"),
    ("resolve start", "to the event loop"),
    ("plan start", "callers answered, called again"),
    ("plan end", "batch planned and posted"),
    ("admit start", "to the engine thread"),
    ("admit end", "requests admitted"),
)
_NONE = object()
PHASES = tuple(phase for _, phase in _MARKS[1:]) + (_MARKS[0][1],)


class StepPhases:
    """Marks the phases of a vLLM backend's steps while entered (see the module); `medians()`
    gives each phase's median ms over the regular steps.

    Args:
        lm: An `AsyncVirtualLM` whose engine core runs in this process.
    """

    def __init__(self, lm: Any) -> None:
        self._lm = lm
        self._marks: list[tuple[str, float]] = []
        # (object, attribute, the object's own value of it before, or `_NONE`)
        self._patched: list[tuple[Any, str, Any]] = []
        self.irregular = 0

    def __enter__(self) -> StepPhases:
        lm, loop = self._lm, self._lm._engine
        self._wrap(lm.llm_engine.llm_engine, "step", "step start", "step end")
        capture = lm.logprobs_capture  # it records in this process: the V1 runner's sampler
        self._wrap(capture, "record", "log-softmax start", "log-softmax end")
        if loop._live is not None:
            self._wrap(loop._live, "completed", None, "parked")
        self._wrap(lm.cache, "store_rows", "store start", "store end")
        self._wrap(lm._logprobs_batcher, "_resolve", "resolve start", None)
        self._wrap(lm._requests, "logprobs", "plan start", None)
        # Marked before the engine thread is handed the batch, which it may take at once.
        self._wrap(loop, "run", "plan end", None)
        self._wrap(loop, "_admit", "admit start", "admit end", when=lambda: bool(loop._pending))
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for owner, name, own in reversed(self._patched):
            if own is _NONE:
                delattr(owner, name)  # the class's own method again
            else:
                setattr(owner, name, own)
        self._patched.clear()

    def medians(self) -> dict[str, float]:
        """Each phase's median ms per step, over the regular steps (`PHASES`' order)."""
        installed = {name for name, _ in self._marks}
        order = [(mark, phase) for mark, phase in _MARKS if mark in installed]
        names = [mark for mark, _ in order]
        durations: dict[str, list[float]] = {phase: [] for _, phase in order}
        # The stretch from each mark to the next ends a phase; the last, the next step's start.
        ending = [phase for _, phase in order[1:] + order[:1]]
        starts = [i for i, (name, _) in enumerate(self._marks) if name == names[0]]
        self.irregular = 0
        for start, end in zip(starts, starts[1:], strict=False):
            step = self._marks[start : end + 1]
            if [name for name, _ in step[:-1]] != names:
                self.irregular += 1
                continue
            times = [at for _, at in step]
            for phase, before, after in zip(ending, times[:-1], times[1:], strict=True):
                durations[phase].append(1e3 * (after - before))
        return {phase: median(durations[phase]) for phase in PHASES if durations.get(phase)}

    def _wrap(
        self,
        owner: Any,
        name: str,
        before: str | None,
        after: str | None,
        when: Callable[[], bool] = lambda: True,
    ) -> None:
        """Mark `before` and `after` a call of `owner.name` (when `when()` says so before it)."""
        method, marks = getattr(owner, name), self._marks

        def marked(*args: Any, **kwargs: Any) -> Any:
            if not when():
                return method(*args, **kwargs)
            if before is not None:
                marks.append((before, time.perf_counter()))
            try:
                return method(*args, **kwargs)
            finally:
                if after is not None:
                    marks.append((after, time.perf_counter()))

        self._patched.append((owner, name, vars(owner).get(name, _NONE)))
        setattr(owner, name, marked)
