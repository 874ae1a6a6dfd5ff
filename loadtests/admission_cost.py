"""What admission costs a request on the front end's path, timed in this process with the real shared state.

`python -m loadtests.admission_cost [--requests 100000]`

Every inference request is checked three times against the pod's queue bound and its model's: by the connection
layer before any ASGI work (`shed_reason`), by the admission middleware before the body is read (`refusal`), and
when its items take their places (`admit`, then `release`). This times those four calls for one model of batch 8 on
the plan of this machine, with the same shared memory the front ends use (SharedState, made here). The median of 5
runs of `--requests` requests, in microseconds a request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

from imgserve.config import Batching, Settings
from imgserve.frontend.admission import Admission
from imgserve.handoff.model_state import READY
from imgserve.handoff.state import SharedState
from imgserve.pod import Limits, plan_pod, read_machine
from imgserve.served import Catalog, ServedModel
from imgserve.server import Pod
from loadtests.lib.toy_apis import NearFree

RUNS = 5


def admission() -> Admission:
    """The admission of a pod serving one ready model, as a front end holds it."""
    settings = Settings()
    plan = plan_pod(settings, read_machine("cpu", 1, 8 << 30, None), [8])
    catalog = Catalog([ServedModel(0, "near-free", NearFree(), Batching(max_batch_size=8))])
    state = SharedState(plan.workers, plan.slots_per_front_end * plan.front_ends, plan.front_ends, 1)
    state.models.set_limits(0, Limits(8, 1 << 30, 1 << 30))
    state.models.set_state(0, READY)
    pod = Pod(settings, catalog, plan, state, control=None)  # type: ignore[arg-type]  # no model is loaded here
    return Admission(state, catalog, settings.retry_after_s, pod.bounds)


def per_request_us(checks: Admission, requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        checks.shed_reason(0)
        checks.refusal(0)
        checks.admit(1, 0)
        checks.release(1, 0)
    return (time.perf_counter() - started) / requests * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.admission_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args(argv)
    checks = admission()
    median = statistics.median(per_request_us(checks, args.requests) for _ in range(RUNS))
    print(f"admission: {median:.2f} us a request (median of {RUNS} runs of {args.requests})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
