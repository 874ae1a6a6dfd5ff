"""The main process's loop: start the workers, then (once they are ready) the front ends, watch them all, drain on
SIGTERM or Ctrl-C, then stop them.

Everything happens on the main thread: the signal handlers only set flags, and the loop acts on them every POLL_S. A
terminal's Ctrl-C reaches every process of the server; the children leave it to the main process, which drains as
on SIGTERM (not ready, new work refused with 503, in-flight requests finished) and then stops them itself (Triton's
and uvicorn's convention). A second Ctrl-C stops at once: the requests still in flight lose their connections. A
supervisor's Ending drains for a moment (FATAL_DRAIN_S) and ends the server with its exit code and one line.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

from imgserve.handoff.state import SharedState
from imgserve.supervisor.children import Children, Ending, Supervisor
from imgserve.supervisor.models import ModelControl

log = logging.getLogger(__name__)
POLL_S = 0.2
FATAL_DRAIN_S = 3.0  # on a fatal failure, how long the surviving processes get to answer what they hold
FORCED_STOP_S = 1.0  # stopping with requests in flight: how long each front end gets before it is killed
STOP_S = 10.0  # a clean stop: how long each child gets to end before it is killed


@dataclass
class _Requested:
    """What the signals asked for, read by the loop."""

    drain: bool = False
    stop_now: bool = False


class Lifecycle:
    """Runs the server's children from start to stop; `run` returns the exit code."""

    def __init__(self, children: Children, state: SharedState, drain_timeout_s: float, control: ModelControl) -> None:
        self.children, self.state, self.drain_timeout_s, self.control = children, state, drain_timeout_s, control
        self.supervisor = Supervisor(children, state)
        self.requested = _Requested()
        self.ending: Ending | None = None

    def run(self) -> int:
        """0 after a clean drain, 1 when children kept dying, 2 when what the user named cannot be served."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # This also takes SIGINT back where a shell started the server as a background job, with SIGINT ignored.
        signal.signal(signal.SIGINT, self._on_sigint)
        self.children.start_workers()
        drain_until = self._watch()
        while self.state.queue_depth > 0 and time.monotonic() < drain_until and not self.requested.stop_now:
            time.sleep(POLL_S)
        in_flight = self.state.queue_depth
        if in_flight:
            log.warning("stopping now, with %d requests in flight", in_flight)
        self.children.stop(FORCED_STOP_S if in_flight else STOP_S)
        if self.ending is not None:  # the server's last line says why it ended
            log.error("imgserve: %s", self.ending.reason)
        return self.state.exit_code

    def _watch(self) -> float:
        """Supervise until a drain is asked for or the supervisor ends the server; when the drain must end. The front
        ends start once every worker is ready (a model that cannot be served ends the server before any)."""
        while True:
            if not self.children.front_ends and self.state.workers_ready:
                refusal = self.control.fit_started()
                if refusal is not None:  # the models loaded at start do not fit the device's memory
                    return self._end(Ending(refusal, 2))
                self.children.start_front_ends()
            elif self.children.front_ends:
                self.control.step()
            if self.requested.drain:
                self.state.start_draining()
                log.info("draining %d in-flight requests", self.state.queue_depth)
                return time.monotonic() + self.drain_timeout_s
            ending = self.supervisor.check()
            if ending is not None:
                return self._end(ending)
            time.sleep(POLL_S)

    def _end(self, ending: Ending) -> float:
        self.ending = ending
        self.state.start_draining(exit_code=ending.exit_code)
        return time.monotonic() + FATAL_DRAIN_S

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.requested.drain = True

    def _on_sigint(self, signum: int, frame: object) -> None:
        if self.requested.drain or self.state.draining:  # a second Ctrl-C: stop now
            self.requested.stop_now = True
            return
        log.info("Ctrl-C: draining (Ctrl-C again to stop now)")
        self.requested.drain = True
