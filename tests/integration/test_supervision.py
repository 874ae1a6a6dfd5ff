"""The main process supervises every child, tested by kill -9 under load: a dead HTTP front end is replaced (and one
that keeps dying ends the server), a dead inference worker's requests are answered 503 while it is restarted (and the
fork server they start from, killed, takes them with it and is replaced with them), and nothing outlives a main
process killed with -9. (One request on a killed worker, timed:
tests/integration/test_faults.py.)"""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from serving import (
    Server,
    image_bytes,
    running_server,
    sockets,
    start_server,
    stop_server,
    wait_ready,
    wait_until,
)

from imgserve.handoff.state import SharedState
from loadtests.lib.closed_loop import run_closed_loop

PNG = {"Content-Type": "image/png"}
IMAGE = image_bytes(32, 24)
REPLACED_WITHIN_S = 5.0  # the bound for a replaced front end
ORPHANS_GONE_S = 10.0  # the bound for the children of a main process killed with -9


def lines_with(server: Server, text: str) -> list[str]:
    """The server's log lines that contain `text`."""
    return [line for line in server.log().splitlines() if text in line]


def assert_all_gone(pids: set[int]) -> None:
    """The server's children are gone soon after it (the resource tracker ends once its last user has)."""
    left = lambda: [(pid, _command(pid)) for pid in pids if psutil.pid_exists(pid)]  # noqa: E731
    wait_until(lambda: not left(), 5, f"processes left behind: {left()}")


def _command(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:100]
    except psutil.Error:
        return "gone"


class PinnedClient:
    """One keep-alive HTTP connection, so the front end that accepted it is known and stays the same."""

    def __init__(self, server: Server) -> None:
        url = urlsplit(server.url)
        self.connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
        self.post()  # connects

    def post(self) -> int:
        """POST one image on this connection; the status."""
        self.connection.request("POST", "/predict", body=IMAGE, headers=PNG)
        response = self.connection.getresponse()
        response.read()
        return response.status

    def front_end(self, server: Server) -> int:
        """The pid of the front end holding this connection's server side."""
        port = self.connection.sock.getsockname()[1]
        for pid in server.front_end_pids().values():
            if any(c.raddr and c.raddr.port == port for c in sockets(psutil.Process(pid), "tcp")):
                return pid
        raise AssertionError(f"no front end holds the connection from port {port}")


def clients_on_two_front_ends(server: Server, attempts: int = 40) -> tuple[list[PinnedClient], list[PinnedClient]]:
    """Open connections until each of the two front ends holds some (the kernel picks who accepts)."""
    # Ready is the first front end's word: the second may still be binding its answer socket.
    wait_until(lambda: len(server.front_end_pids()) == 2, 10, "both front ends up")
    first, second = sorted(server.front_end_pids().values())
    clients: dict[int, list[PinnedClient]] = {first: [], second: []}
    for _ in range(attempts):
        client = PinnedClient(server)
        clients[client.front_end(server)].append(client)
        if len(clients[first]) >= 2 and len(clients[second]) >= 2:
            break
    assert all(clients.values()), f"the kernel gave every connection to one front end: {clients}"
    return clients[first], clients[second]


def test_killed_front_end_is_replaced_and_the_other_keeps_serving(tmp_path) -> None:
    with running_server(tmp_path, api_servers=2, workers_per_device=1) as server:
        victims, survivors = clients_on_two_front_ends(server)
        victim = victims[0].front_end(server)
        [victim_index] = [i for i, pid in server.front_end_pids().items() if pid == victim]
        statuses: list[int] = []
        stop_load = threading.Event()

        def keep_posting(client: PinnedClient) -> None:
            while not stop_load.is_set():
                statuses.append(client.post())

        load = [threading.Thread(target=keep_posting, args=(client,)) for client in survivors]
        for thread in load:
            thread.start()
        time.sleep(0.5)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        replacement = wait_until(
            lambda: (pid := server.front_end_pids().get(victim_index)) not in (None, victim) and pid,
            REPLACED_WITHIN_S,
            "the killed front end replaced",
            interval_s=0.05,
        )
        replaced_s = time.monotonic() - killed_at
        time.sleep(0.5)
        stop_load.set()
        for thread in load:
            thread.join(timeout=30)
        print(f"front end replaced {replaced_s:.2f} s after kill -9")
        assert statuses and set(statuses) == {200}, "requests on the other front end were disturbed"
        # The replacement serves: new connections reach it (the kernel picks who accepts each).
        picked: list[int] = []
        deadline = time.monotonic() + 30
        while (front_end := PinnedClient(server).front_end(server)) != replacement:
            picked.append(front_end)
            assert time.monotonic() < deadline, (
                f"no new connection reached the replacement {replacement} in 30 s: {len(picked)} went to"
                f" {set(picked)}; front ends now {server.front_end_pids()}; {lines_with(server, 'front end')}"
            )
        assert server.metric("imgserve_front_end_restarts_total") == 1
        assert len(lines_with(server, f"HTTP front end {victim_index} died")) == 1
        assert server.zombies() == []
        assert server.process.poll() is None


def test_a_lone_front_end_killed_under_load_is_replaced_and_the_server_answers_again(tmp_path) -> None:
    """The worst case: the only front end (--api-servers 1; a CPU pod runs 2 by default) killed during a load."""
    with running_server(tmp_path, api_servers=1) as server:
        [front_end] = server.front_end_pids().values()
        killer = threading.Timer(1.0, os.kill, (front_end, signal.SIGKILL))
        killer.start()
        load = run_closed_loop(f"{server.url}/predict", users=4, seconds=2.5, warmup_s=0)
        killer.join()
        # The killed front end's connections died with it; every other request was answered, none hung.
        assert load.answered, load.errors()
        assert all(o.ok or o.status == 0 for o in load.outcomes), load.errors()
        assert load.failed <= 4, load.errors()  # at most each user's request in flight on the dead front end
        wait_until(lambda: server.front_end_pids() and front_end not in server.front_end_pids().values(), 5, "replaced")
        assert httpx.post(f"{server.url}/predict", content=IMAGE, headers=PNG, timeout=30).status_code == 200
        assert server.metric("imgserve_queue_depth") == 0, "the dead front end's admitted requests were not written off"
        assert server.zombies() == []


def test_killed_worker_under_load_costs_only_503s(tmp_path) -> None:
    with running_server(tmp_path) as server:
        worker = server.worker_pids()[0]
        killer = threading.Timer(1.0, os.kill, (worker, signal.SIGKILL))
        killer.start()
        load = run_closed_loop(f"{server.url}/predict", users=4, seconds=3)
        killer.join()
        assert load.failed == 0, load.errors()  # every request a correct 200 or an explicit 503
        assert load.answered
        wait_ready(server, timeout=60)
        assert worker not in server.worker_pids()
        assert server.metric("imgserve_worker_restarts_total") == 1
        assert server.metric("imgserve_queue_depth") == 0
        assert server.zombies() == []


def test_a_killed_fork_server_takes_its_workers_and_both_are_replaced(tmp_path) -> None:
    """The workers' parent (supervisor/forkserver.py) killed under load: the workers die with it, their requests are
    answered 503, and the next worker start brings a new fork server and new workers that answer."""
    with running_server(tmp_path) as server:
        workers = set(server.worker_pids())
        [fork_server] = {psutil.Process(pid).ppid() for pid in workers}
        killer = threading.Timer(1.0, os.kill, (fork_server, signal.SIGKILL))
        killer.start()
        load = run_closed_loop(f"{server.url}/predict", users=4, seconds=3)
        killer.join()
        assert load.failed == 0, load.errors()
        replaced = lambda: len(fresh := set(server.worker_pids())) == len(workers) and not fresh & workers  # noqa: E731
        wait_until(replaced, 60, "new workers in place of the fork server's")
        wait_ready(server, timeout=60)
        [new_fork_server] = {psutil.Process(pid).ppid() for pid in server.worker_pids()}
        assert new_fork_server != fork_server and not _alive(fork_server)
        assert httpx.post(f"{server.url}/predict", content=IMAGE, headers=PNG, timeout=30).status_code == 200
        assert server.metric("imgserve_worker_restarts_total") == len(workers)
        assert server.zombies() == []


def test_front_end_that_keeps_dying_ends_the_server(tmp_path) -> None:
    server = start_server({"api_servers": 1}, tmp_path)
    try:
        wait_ready(server)
        children = server.descendants()
        for death in range(3):
            [front_end] = wait_until(lambda: list(server.front_end_pids().values()), 5, f"front end {death + 1} up")
            os.kill(front_end, signal.SIGKILL)
            wait_until(lambda pid=front_end: pid not in server.front_end_pids().values(), 5, "the front end gone")
        assert server.process.wait(timeout=30) == 1
        assert len(lines_with(server, "3 front-end deaths in 60 s")) == 1, server.log_tail()
        assert "Traceback" not in server.log()
        assert_all_gone(children)
    finally:
        stop_server(server)


def test_kill_9_of_the_main_process_leaves_no_child_holding_the_port(tmp_path) -> None:
    """The OOM killer's way: kill -9 of the main process under load. Within ORPHANS_GONE_S no process of the server
    is left (none unsupervised, none on the port or a device), and a new server starts on the same port."""
    server = start_server({}, tmp_path)
    try:
        wait_ready(server)
        children = server.descendants()
        port = int(server.url.rpartition(":")[2])
        load = threading.Thread(
            target=run_closed_loop, args=(f"{server.url}/predict",), kwargs={"users": 4, "seconds": 2}
        )
        load.start()
        time.sleep(1.0)
        os.kill(server.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        server.process.wait(timeout=10)
        wait_until(lambda: not [pid for pid in children if _alive(pid)], ORPHANS_GONE_S, "every child gone")
        print(f"every child gone {time.monotonic() - killed_at:.2f} s after kill -9 of the main process")
        load.join(timeout=30)
        again = start_server({"port": port}, tmp_path)
        try:
            wait_ready(again)
            assert httpx.post(f"{again.url}/predict", content=IMAGE, headers=PNG, timeout=30).status_code == 200
        finally:
            stop_server(again)
    finally:
        stop_server(server)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for whoever adopted it to reap it (a zombie holds no port, memory or device)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ctrl_c_stops_every_child_without_taking_them_for_dead(tmp_path) -> None:
    """SIGINT is a stop, not a failure: no child is 'restarted' on the way out, and none is left behind."""
    server = start_server({}, tmp_path)
    try:
        wait_ready(server)
        assert httpx.post(f"{server.url}/predict", content=IMAGE, headers=PNG, timeout=30).status_code == 200
        children = {process.pid for process in server.tree()[1:]}
        front_ends = len(server.front_end_pids())
        server.process.send_signal(signal.SIGINT)
        server.process.wait(timeout=60)
        assert lines_with(server, "died") == [] and front_ends > 0
        assert len(lines_with(server, "Started server process")) == front_ends, server.log_tail()
        assert_all_gone(children)
    finally:
        stop_server(server)


def test_a_dead_front_end_takes_its_grpc_service_with_it() -> None:
    """Ready waits for gRPC (--grpc-port): a front end killed while serving it leaves the pod not ready until its
    replacement listens again, and another front end's death does not touch it."""
    state = SharedState(workers=1, request_slots=2, front_ends=2)
    state.serve_as(0)
    state.serve_grpc(True)
    state.forget_front_end(1)
    assert state.grpc_serving
    state.forget_front_end(0)
    assert not state.grpc_serving


def test_a_metric_file_left_empty_by_a_process_killed_as_it_made_it_spoils_no_scrape(tmp_path) -> None:
    """prometheus_client creates a process's metric file before it sizes it: a process killed in between leaves it
    empty for good (prometheus/client_python#1199), and a scrape that comes in between finds it so."""
    with running_server(tmp_path) as server:
        assert httpx.post(f"{server.url}/predict", content=IMAGE, headers=PNG).status_code == 200
        opened = {Path(file.path) for process in server.tree() for file in process.open_files()}
        directory = next(path.parent for path in opened if path.name.startswith("counter_"))
        dead = max(process.pid for process in server.tree()) + 1000
        for kind in ("counter", "histogram", "gauge_all", "gauge_livesum"):
            (directory / f"{kind}_{dead}.db").touch()
        scrape = httpx.get(f"{server.url}/metrics")
        assert scrape.status_code == 200, scrape.text
        answered = {
            sample.labels["code"]: sample.value
            for family in text_string_to_metric_families(scrape.text)
            for sample in family.samples
            if sample.name == "imgserve_requests_total" and sample.labels["route"] == "/predict"
        }
        assert answered == {"200": 1.0}, answered
        statistics = httpx.get(f"{server.url}/v2/models/stats")
        assert statistics.status_code == 200, statistics.text
        assert [model["inference_stats"]["success"]["count"] for model in statistics.json()["model_stats"]] == [1]
