"""gRPC's limits against a real server with Triton's client, raw channels and raw HTTP/2 sockets: the API key is
checked from the call's metadata before its message is read, an open RPC must send its message within the header
timeout, `max_connections` bounds calls in progress, the streams of a connection and the connections, silent and
idle connections are closed, and the send limit fits an answer as large as the pixel limit allows."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import toy_models
import tritonclient.grpc as triton
from safetensors.torch import save_file
from serving import Server, image_bytes, running_server
from tritonclient.grpc import service_pb2

from imgserve.testing import free_port

MODEL = "toy"
KEY = {"authorization": "Bearer k1"}
INFER = "/inference.GRPCInferenceService/ModelInfer"
LIVE = "/inference.GRPCInferenceService/ServerLive"
CONNECTIONS = 3
HEADER_TIMEOUT_S = 2.0
DELAY_S = 1.0  # per batch of one image: calls admitted at once stay in progress for seconds
SETTINGS, MAX_CONCURRENT_STREAMS = 4, 3  # HTTP/2's SETTINGS frame type and its setting id


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """An identity model that takes DELAY_S per batch, one image per batch, one key, max_connections 3."""
    directory = tmp_path_factory.mktemp("grpc-limits")
    weights = directory / "slow.safetensors"
    save_file(toy_models.Slow().state_dict(), str(weights))
    model = {"model": str(weights), "model_factory": "toy_models:Slow", "model_name": MODEL}
    limits = {"max_connections": CONNECTIONS, "max_batch_size": 1, "batch_timeout_ms": 0, "workers_per_device": 1}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOY_DELAY_S", str(DELAY_S))
        with running_server(
            directory, grpc_port=free_port(), api_key="k1", header_timeout_s=HEADER_TIMEOUT_S, **model, **limits
        ) as running:
            yield running


def images_input(*images: bytes) -> triton.InferInput:
    tensor = triton.InferInput("image", [len(images), 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[image] for image in images], dtype=object))
    return tensor


def raw_model_infer(server: Server, message: bytes, metadata: tuple = ()) -> grpc.StatusCode:
    """Send `message` as ModelInfer's serialized request, as is; the call's status code."""
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary(INFER)  # no serializer: the bytes travel unparsed
        try:
            call(message, metadata=metadata, timeout=30)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def stalled_call(
    server: Server, method: str, metadata: tuple = (), timeout: float = 10
) -> tuple[grpc.StatusCode, float]:
    """Call `method` with its headers but never its message; the status code and the seconds it took."""
    release = threading.Event()

    def silence() -> Iterator[bytes]:
        release.wait(timeout + 5)
        yield from ()

    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        started, code = time.monotonic(), grpc.StatusCode.OK
        try:
            channel.stream_unary(method)(silence(), metadata=metadata, timeout=timeout)
        except grpc.RpcError as error:
            code = error.code()
        finally:
            release.set()
    return code, time.monotonic() - started


def frame(kind: int, flags: int = 0, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame on stream 0."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", 0) + payload


def h2_connect(server: Server, handshake: bool = True) -> tuple[socket.socket, dict[int, int] | None]:
    """A raw TCP connection to the gRPC port; with `handshake`, the HTTP/2 preface sent and the server's SETTINGS
    read and acknowledged (None: the server closed the connection instead)."""
    sock = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=5)
    if not handshake:
        return sock, None
    try:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS))
        header = sock.recv(9, socket.MSG_WAITALL)
        if len(header) < 9 or header[3] != SETTINGS:
            return sock, None
        length = int.from_bytes(header[:3], "big")
        payload = sock.recv(length, socket.MSG_WAITALL) if length else b""
    except ConnectionError:
        return sock, None
    sock.sendall(frame(SETTINGS, flags=1))  # ACK
    return sock, dict(struct.unpack(">HI", payload[i : i + 6]) for i in range(0, len(payload), 6))


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (what it sends meanwhile is read and dropped)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except ConnectionError:
            return True
        except TimeoutError:
            return False
    return False


def test_an_unauthenticated_call_is_refused_before_its_message_is_read(server: Server) -> None:
    """A call whose message never comes is refused at once; 15 MiB that are no protobuf at all: without a key
    UNAUTHENTICATED (nothing parsed them), with the key the parse fails; a well-formed 15 MiB request without a
    valid key is UNAUTHENTICATED too. Each refusal counts as a 401."""
    refused = server.metric("imgserve_requests_total", route="grpc/ModelInfer", code="401")
    code, seconds = stalled_call(server, INFER)
    assert code == grpc.StatusCode.UNAUTHENTICATED and seconds < HEADER_TIMEOUT_S, (code, seconds)
    garbage = b"\xff" * (15 * 1024 * 1024)
    assert raw_model_infer(server, garbage) == grpc.StatusCode.UNAUTHENTICATED
    assert raw_model_infer(server, garbage, (("authorization", "Bearer wrong"),)) == grpc.StatusCode.UNAUTHENTICATED
    assert raw_model_infer(server, garbage, tuple(KEY.items())) not in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.OK,
    )
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(len(garbage).to_bytes(4, "little") + garbage)
    assert raw_model_infer(server, request.SerializeToString()) == grpc.StatusCode.UNAUTHENTICATED
    assert server.metric("imgserve_requests_total", route="grpc/ModelInfer", code="401") == refused + 4


def test_an_open_rpc_must_send_its_message_within_the_header_timeout(server: Server) -> None:
    """ServerLive needs no key, so a call that never sends its message would hold one of the server's call slots
    for as long as its client likes: the server ends it after the header timeout."""
    timeouts = server.metric("imgserve_requests_total", route="grpc", code="408")
    code, seconds = stalled_call(server, LIVE, timeout=20)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and seconds < HEADER_TIMEOUT_S + 3, (code, seconds)
    assert server.metric("imgserve_requests_total", route="grpc", code="408") == timeouts + 1


def test_an_answer_as_large_as_the_pixel_limit_allows_is_sent(server: Server) -> None:
    """2700x2700 output_pixels (21.9 MB) is more than the 20 MiB receive limit, and well within the pixel limit."""
    client = triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        output = triton.InferRequestedOutput("output_pixels")
        image = images_input(image_bytes(2700, 2700, "JPEG"))
        answer = client.infer(MODEL, [image], outputs=[output], headers=KEY, client_timeout=60)
    finally:
        client.close()
    assert answer.as_numpy("output_pixels").shape == (1, 2700, 2700, 3)


def test_calls_at_once_are_bounded_by_max_connections(server: Server) -> None:
    """Six calls at once over two connections (three each, what a connection may carry) against max_connections 3:
    three are computed, the other three are RESOURCE_EXHAUSTED at once (the model's queue, which holds four, never
    sees them)."""
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=[1, 1])
    png = image_bytes(8, 8)
    request.raw_input_contents.append(len(png).to_bytes(4, "little") + png)
    own_connection = [("grpc.use_local_subchannel_pool", 1)]  # channels to one address share one otherwise
    channels = [grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", own_connection) for _ in range(2)]
    try:
        for channel in channels:
            grpc.channel_ready_future(channel).result(timeout=10)
        infers = [
            channel.unary_unary(
                INFER, service_pb2.ModelInferRequest.SerializeToString, service_pb2.ModelInferResponse.FromString
            )
            for channel in channels
        ]
        calls = [infer.future(request, metadata=tuple(KEY.items()), timeout=30) for infer in infers for _ in range(3)]
        codes = [call.code() for call in calls]
    finally:
        for channel in channels:
            channel.close()
    assert codes.count(grpc.StatusCode.OK) == CONNECTIONS, codes
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 6 - CONNECTIONS, codes


def test_a_connection_carries_at_most_max_connections_streams(server: Server) -> None:
    """The server announces max_connections as the connection's SETTINGS_MAX_CONCURRENT_STREAMS: a client's calls
    past it wait in its own channel, and streams a client opens past it anyway never reach the server's code."""
    sock, settings = h2_connect(server)
    with sock:
        assert settings is not None and settings.get(MAX_CONCURRENT_STREAMS) == CONNECTIONS, settings


def test_connections_are_bounded_and_silent_or_idle_ones_closed(server: Server) -> None:
    """Four connections against max_connections 3: one is closed at once and a new client cannot connect while the
    others are held; a connection that never sends the HTTP/2 preface and ones that carry no call are closed after
    the header timeout, and a client connects again."""
    silent, _ = h2_connect(server, handshake=False)
    held = [h2_connect(server) for _ in range(3)]
    try:
        assert any(settings is None for _, settings in held), "a fourth connection was kept"
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary(LIVE, service_pb2.ServerLiveRequest.SerializeToString)(
                    service_pb2.ServerLiveRequest(), timeout=5
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert closed_within(silent, HEADER_TIMEOUT_S + 3)
        assert all(closed_within(sock, HEADER_TIMEOUT_S + 3) for sock, settings in held if settings is not None)
    finally:
        for sock in [silent, *(sock for sock, _ in held)]:
            sock.close()
    client = triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        assert client.is_server_live()
    finally:
        client.close()
