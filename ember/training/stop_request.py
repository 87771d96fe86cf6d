"""Stopping a run cleanly: SIGTERM/SIGINT become a request to checkpoint and stop after the
current step, agreed on by every process of a multi-process run."""

from __future__ import annotations

import os
import signal

import jax


class StopRequest:
    """Turns SIGTERM/SIGINT into a request to checkpoint and stop after the current step.

    With several processes, every one must stop after the same step (a checkpoint is a collective,
    and so is the next step of a process that did not stop: one process signalled alone hung the
    run, with no checkpoint). There SIGTERM is left to JAX's preemption service, which
    ``jax.distributed.initialize`` starts: it tells every process of a notice any of them received,
    and ``reached_preemption_sync_point`` names the one step after which all stop. SIGINT is turned
    into such a notice."""

    def __init__(self, start: int):
        self.is_set = False
        self._previous = {}
        self._preemption = preemption_service(start)
        for sig in (signal.SIGINT,) if self._preemption else (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def stopping(self, step: int) -> bool:
        """Whether to checkpoint and stop after ``step`` (called once per step, in order)."""
        if not self._preemption:
            return self.is_set
        from jax.experimental import multihost_utils

        reached = multihost_utils.reached_preemption_sync_point(step)
        if reached:
            print(f"\na process received a preemption notice: saving a checkpoint after step {step}, then stopping")
        return reached

    def _handle(self, signum, _frame):
        if self.is_set:  # a second signal: stop now
            raise KeyboardInterrupt
        self.is_set = True
        if self._preemption:  # the notice the preemption service shares with every process
            os.kill(os.getpid(), signal.SIGTERM)
            return
        print(f"\nreceived {signal.Signals(signum).name}: saving a checkpoint after this step, then stopping")

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def preemption_service(start: int) -> bool:
    """Whether this run has several processes and JAX's preemption service, which then has
    seen step ``start`` (its sync point is counted in steps every process calls it with)."""
    if jax.process_count() == 1:
        return False
    from jax.experimental import multihost_utils

    try:
        multihost_utils.reached_preemption_sync_point(start)
    except RuntimeError:  # jax_enable_preemption_service is off
        return False
    return True


__all__ = ["StopRequest", "preemption_service"]
