"""What a busy inference worker's heap keeps of its batches (imgserve.heap.BatchHeap), on the real C heap.

Each case runs in a fresh interpreter: holding freed memory changes glibc's settings for the whole process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

MIB = 2**20

PROGRAM = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from imgserve import heap

    keep = sys.argv[1] == "bound"
    heap.hold_freed_memory()
    now = [0.0]
    released = []
    bound = heap.BatchHeap(release=lambda: released.append(1), recent_s=10, floor_bytes=64 << 20, clock=lambda: now[0])
    held = lambda: (heap.anonymous_bytes() - bound.base_bytes) >> 20
    rows = []

    def batch(at, mib):
        now[0] = at
        block = np.ones(mib << 20, dtype=np.uint8)  # a batch's memory, touched, then freed
        del block
        trimmed = bound.after_batch(mib << 20) if keep else False
        rows.append({"at": at, "mib": mib, "trimmed": trimmed, "held_mib": held()})

    batch(0, 400)  # one big batch
    for at in (1, 2, 5, 9):  # small ones while the big one is still recent
        batch(at, 8)
    for at in (11, 12):  # the big one is 10 s old
        batch(at, 8)
    print(json.dumps({"rows": rows, "released": len(released)}))
    """
)


def run(mode: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(result.stdout)


def test_a_busy_worker_keeps_a_big_batch_while_it_is_recent_and_gives_it_back_after() -> None:
    rows = run("bound")["rows"]
    big, *recent, first_after, second_after = rows
    assert big["held_mib"] >= 350, rows  # freed, but kept for reuse
    assert not any(row["trimmed"] for row in [big, *recent]), rows
    assert all(row["held_mib"] >= 350 for row in recent), rows  # no page faults to pay for the next big batch
    assert first_after["trimmed"], rows
    assert first_after["held_mib"] < 100 and second_after["held_mib"] < 100, rows
    assert not second_after["trimmed"], rows  # back under the bound: no trim per batch
    assert run("bound")["released"] == 1  # the batch buffers go with it


def test_control_without_the_bound_the_big_batch_is_held_for_good() -> None:
    rows = run("hold")["rows"]
    assert rows[-1]["held_mib"] >= 350, rows


CHILDREN = textwrap.dedent(
    """
    import json, subprocess
    started = []
    popen = subprocess.Popen.__init__
    subprocess.Popen.__init__ = lambda self, args, *rest, **kw: started.append(args) or popen(self, args, *rest, **kw)
    from imgserve import heap

    took = [heap.hold_freed_memory(), heap.few_arenas()]
    heap.BatchHeap(release=lambda: None).give_back()
    print(json.dumps({"took": took, "started": started}))
    """
)


def test_the_heap_settings_start_no_process() -> None:
    """A worker trims its heap each time it idles: finding the C library must not start a child process each time
    (ctypes.util.find_library runs ldconfig), a process of the server's that comes and goes."""
    result = subprocess.run([sys.executable, "-c", CHILDREN], capture_output=True, text=True, timeout=60, check=True)
    report = json.loads(result.stdout)
    assert report["took"] == [True, True], "glibc's settings were not taken"
    assert report["started"] == []
