"""How long torch.compile takes, measured as it happens: one log line per compile (a graph when dynamo traces a
block, its forward included, and its backward too where AOT autograd lowers both at once; the backward of that
graph when AOT autograd compiles it lazily in the first backward) with its wall time and the running total. A
cold compile on a slow or busy machine then shows its progress instead of a silent first step, and a run stopped
while compiling still says how far it got and where the time went.

The times come from torch's compile callbacks (`torch._dynamo.callback`): a start and an end around each outermost
compile, code generation included (inductor waits for its kernels' compiles before it returns; autotuning at a
kernel's first run comes later and is not counted). A compile that fails ends its callbacks too, so its line is
followed by the error. The watchdog (trainer/watchdog.py) uses the same callbacks to count compiling as progress.
"""

from __future__ import annotations

import logging
import time

from torch._dynamo.callback import callback_handler

__all__ = ["CompileTimes", "remove_compile_callbacks"]

logger = logging.getLogger("trainer")


class CompileTimes:
    """The compiles of this process while inside `with` (entered again, it counts on): how many (`compiles`; a
    graph and its backward count apart), `seconds` in all, and one INFO line per compile
    (`trainer.metrics.init_logging` shows INFO on rank 0). Torch's callbacks are process-wide: registered only
    inside, they cannot outlive their owner, and two owners never both count a compile."""

    def __init__(self):
        self.compiles = 0
        self.seconds = 0.0
        self._started_at: float | None = None

    def __enter__(self) -> "CompileTimes":
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        return self

    def __exit__(self, *exc) -> None:
        remove_compile_callbacks(self._start, self._end)
        self._started_at = None

    # torch >= 2.6 passes a `CallbackArgs` (what triggered the compile and its id); older releases passed nothing
    def _start(self, *args) -> None:
        self._started_at = time.perf_counter()

    def _end(self, *args) -> None:
        if self._started_at is None:  # entered while a compile was in flight: its start was not seen
            return
        seconds = time.perf_counter() - self._started_at
        self._started_at = None
        self.compiles += 1
        self.seconds += seconds
        trigger = getattr(getattr(args[0], "callback_trigger", None), "name", "") if args else ""
        compile_id = getattr(args[0], "compile_id", None) if args else None
        what = "graph" + (f" {compile_id}" if compile_id not in (None, "None") else "")
        if trigger == "LAZY_BACKWARD":
            what = f"backward of {what}"
        logger.info("torch.compile: %s compiled in %.1f s (%d compiles, %.1f s so far)", what, seconds,
                    self.compiles, self.seconds)


def remove_compile_callbacks(start, end) -> None:
    """Remove a start and an end callback from torch's compile callbacks, if they are still there."""
    for callbacks, callback in ((callback_handler.start_callbacks, start), (callback_handler.end_callbacks, end)):
        if callback in callbacks:  # torch._dynamo.reset() clears them
            callbacks.remove(callback)
