"""Run by tests/integration/test_neighbours.py, often as another user: send a pickle that would write a marker file,
garbage and an oversized datagram to every imgserve socket listed in /proc/net/unix, and to a stream socket (the
fork server's) a fork request as multiprocessing's client sends it, with that pickle; print what each send did, as
JSON.
Standard library only (it runs under the system's Python, as whoever the test makes it)."""

import array
import contextlib
import json
import os
import pickle
import random
import socket
import sys


class WritesMarker:
    def __reduce__(self):
        return exec, (f"open({sys.argv[1]!r}, 'w').write('ran')",)


def imgserve_sockets() -> list[str]:
    with open("/proc/net/unix") as table:
        names = [line.split()[-1] for line in table.read().splitlines()[1:] if len(line.split()) >= 8]
    return sorted({name for name in names if "imgserve" in name})


def address(name: str) -> str:
    return "\0" + name[1:] if name.startswith("@") else name


def send_stream(payload: bytes, name: str) -> None:
    """To a stream socket: a fork request (multiprocessing.forkserver's client: the child's two pipe ends and two more
    fds as SCM_RIGHTS, then the pickle the child would load first, on the pipe), then `payload`."""
    parent_r, child_w = os.pipe()
    child_r, parent_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as request:
            request.settimeout(2)
            request.connect(address(name))
            fds = array.array("i", [child_r, child_w, null, null])
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # connected, then dropped by the server
                request.sendmsg([bytes([len(fds)])], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        os.write(parent_w, pickle.dumps(WritesMarker()))
    finally:
        for fd in (parent_r, child_w, child_r, parent_w, null):
            os.close(fd)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as garbage:
        garbage.settimeout(2)
        garbage.connect(address(name))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # connected, then dropped by the server
            garbage.sendall(payload)


def main() -> None:
    rng = random.Random(29)
    payloads = [pickle.dumps(WritesMarker()), pickle.dumps((0, "uid", 0.0, WritesMarker()))]
    payloads += [rng.randbytes(rng.randrange(1, 4000)) for _ in range(50)]
    payloads += [b"\x94" + rng.randbytes(20), b"\xc7\xff\x01" + rng.randbytes(300), bytes(300_000)]
    results = {}
    for name in imgserve_sockets():
        outcomes = set()
        for payload in payloads:
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sender.setblocking(False)
            try:
                sender.sendto(payload, address(name))
                outcomes.add("sent")
            except OSError as exc:
                if exc.errno != 91:  # EPROTOTYPE: a stream socket, sent to below
                    outcomes.add(type(exc).__name__)
                    continue
                try:
                    send_stream(payload, name)
                    outcomes.add("sent")
                except OSError as exc:
                    outcomes.add(type(exc).__name__)
            finally:
                sender.close()
        results[name] = sorted(outcomes)
    print(json.dumps(results))


main()
