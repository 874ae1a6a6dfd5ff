"""Locust users that post the test images to /predict, check every answer, and count 503/504 as rejects, not failures.

Shapes, all bounded by --run-time: `--shape step` (five equal steps up to --users), `spike` (a tenth of
--users, then all of them for the middle fifth, then back), `soak` (ramp to --users in a tenth, then hold).
`python -m loadtests.run` runs this headless and plots it; directly:
`locust -f loadtests/locustfile.py --headless --host http://127.0.0.1:8000 --shape spike --users 32 --run-time 60s`
"""

from __future__ import annotations

import itertools
import os
import sys

from locust import FastHttpUser, LoadTestShape, events, task

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for `loadtests`

from loadtests.lib.images import (  # noqa: E402
    ANSWERED,
    MAX_RETRY_AFTER_S,
    REJECT_STATUSES,
    check_answer,
    rejected_name,
    sample_images,
)
from loadtests.lib.shapes import SHAPES  # noqa: E402

_user_numbers = itertools.count()


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:  # noqa: ANN001 (Locust's argparse wrapper)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="step", help="load shape over --run-time")


class ImageUser(FastHttpUser):
    """Posts the test images in turn as raw image bodies; a rejected user waits Retry-After (at most 1 s)."""

    backoff_s = 0.0

    def wait_time(self) -> float:
        backoff, self.backoff_s = self.backoff_s, 0.0
        return backoff

    def on_start(self) -> None:
        self.sent = next(_user_numbers)  # users start at different images

    @task
    def predict(self) -> None:
        images = sample_images()
        image = images[self.sent % len(images)]
        self.sent += 1
        headers = {"Content-Type": image.content_type}
        post = self.client.post("/predict", data=image.data, headers=headers, name=ANSWERED, catch_response=True)
        with post as response:
            status = response.status_code or 0
            if status in REJECT_STATUSES:
                response.request_meta["name"] = rejected_name(status)
                response.success()
                self.backoff_s = min(float(response.headers.get("Retry-After") or 0), MAX_RETRY_AFTER_S)
                return
            problem = check_answer(image, status, response.headers.get("Content-Type", ""), response.content or b"")
            if problem:
                response.failure(problem)
            else:
                response.success()


class ConfiguredShape(LoadTestShape):
    """The shape named by --shape, scaled to --users and stretched over --run-time (which also stops the run)."""

    use_common_options = True

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options
        duration, peak = options.run_time, options.num_users or 1
        progress = self.get_run_time() / duration
        if progress >= 1:
            return None
        return SHAPES[options.shape](progress, peak), float(peak)
