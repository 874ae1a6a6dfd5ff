"""The Open Inference Protocol against its official definitions (pinned in tests/data/open_inference_protocol, read
as tests/support/oip.py says), for the built-in model and for a user API that declares its own tensors: every v2
HTTP route's answers validated against the OpenAPI document, the infer request fuzzed from the document's schema
with schemathesis, and gRPC called through stubs compiled from the official proto."""

from __future__ import annotations

import base64
import copy
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from oip import Conformance, OfficialGrpc, openapi_document
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from serving import Server, image_bytes, running_server

from imgserve.testing import free_port

INFER = "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/infer"
SERVED = {"builtin": ({}, "denoiser"), "user API": ({"api": "v2_apis:MeanColour"}, "mean_colour")}
PNG = image_bytes(20, 10, seed=4)
FUZZ_CASES = {"official": 50, "narrowed to the model": 100}  # per generation mode (valid, invalid): 300 a server
ACCEPTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


@dataclass
class Served:
    """A running server, the model it serves and that model's metadata."""

    server: Server
    model: str
    metadata: dict[str, Any]

    @property
    def infer(self) -> str:
        return f"{self.server.url}/v2/models/{self.model}/infer"

    @property
    def outputs(self) -> list[str]:
        return [output["name"] for output in self.metadata["outputs"]]


@pytest.fixture(scope="module", params=list(SERVED))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    settings_, model = SERVED[request.param]
    logs = tmp_path_factory.mktemp("logs")
    with running_server(logs, grpc_port=free_port(), max_batch_size=4, **settings_) as server:
        yield Served(server, model, httpx.get(f"{server.url}/v2/models/{model}").json())


@pytest.fixture(scope="module")
def conformance() -> Conformance:
    return Conformance()


def image_body(**extra: Any) -> dict[str, Any]:
    data = [base64.b64encode(PNG).decode()]
    return {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 1], "data": data}], **extra}


def test_every_route_answers_as_the_document_says(served: Served, conformance: Conformance) -> None:
    """Each route of the document, with and without its optional version, true and false, through the validator;
    every answer without `outputs` names every output of the metadata, in its order."""
    url, model = served.server.url, served.model
    check: Callable[[httpx.Response], Any] = conformance.check
    assert check(httpx.get(f"{url}/v2")).body == check(httpx.get(f"{url}/v2/")).body
    for path in (
        "/v2/health/live",
        "/v2/health/ready",
        f"/v2/models/{model}/ready",
        f"/v2/models/{model}/versions/1/ready",
    ):
        assert check(httpx.get(url + path)).status == 200
    assert check(httpx.get(f"{url}/v2/models/{model}/versions/1")).body == served.metadata
    check(httpx.get(f"{url}/v2/models/{model}"))
    for path in ("/v2/models/nope", f"/v2/models/{model}/versions/7", "/v2/models/nope/ready", "/v2/models/nope/infer"):
        method = "POST" if path.endswith("infer") else "GET"
        assert check(httpx.request(method, url + path, json=image_body())).status == 404
    answer = check(httpx.post(served.infer, json=image_body(id="a1")))
    assert [output["name"] for output in answer.body["outputs"]] == served.outputs and answer.body["id"] == "a1"
    versioned = check(httpx.post(f"{url}/v2/models/{model}/versions/1/infer", json=image_body()))
    assert versioned.body["outputs"] == answer.body["outputs"]
    binary = check(httpx.post(served.infer, json=image_body(parameters={"binary_data_output": True})))
    assert list(binary.binary) == served.outputs
    raw = check(httpx.post(served.infer, content=PNG, headers={"Inference-Header-Content-Length": "0"}))
    assert raw.binary == binary.binary
    for bad in ({"inputs": []}, image_body(outputs=[{"name": "nope"}]), {"inputs": [{"name": "image"}]}):
        assert check(httpx.post(served.infer, json=bad)).status == 400
    routes = {(method, template) for method, template, status in conformance.checked if status == 200}
    every = {(m.upper(), t) for t, item in conformance.document["paths"].items() for m in item if m in ("get", "post")}
    assert every <= routes, f"not answered 200: {every - routes}"


def narrowed(document: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """The document with its infer request held to what gets past the parser to the model: each input one of the
    model's own, of one or two items, its data pixel values or images (a PNG, a truncated PNG); its outputs and
    parameters imgserve's and Triton's. A subset of the official schema, so every answer must still conform."""
    narrow = copy.deepcopy(document)
    schemas = narrow["components"]["schemas"]
    schemas["request_input"] = {"anyOf": [variant for tensor in metadata["inputs"] for variant in _inputs(tensor)]}
    schemas["inference_request"]["properties"]["inputs"].update(minItems=1, maxItems=2)
    schemas["inference_request"]["additionalProperties"] = False
    schemas["inference_request"]["properties"]["parameters"] = _object(
        format={"enum": ["png", "jpeg", "webp", "gif"]},
        quality={"type": "integer", "minimum": -5, "maximum": 105},
        binary_data_output={"type": "boolean"},
        timeout={"enum": [-1, 0, 60_000_000]},
    )
    schemas["request_output"] = _object(
        name={"enum": [tensor["name"] for tensor in metadata["outputs"]]},
        parameters=_object(binary_data={"type": "boolean"}, classification={"type": "integer", "maximum": 5}),
    )
    schemas["request_output"]["required"] = ["name"]
    return narrow


def _inputs(tensor: dict[str, Any]) -> list[dict[str, Any]]:
    """A declared input as request inputs of one and of two items, their data of the right count."""
    pngs = [base64.b64encode(PNG).decode(), base64.b64encode(PNG[: len(PNG) // 2]).decode()]
    element = {"enum": pngs} if tensor["datatype"] == "BYTES" else {"type": "integer", "minimum": 0, "maximum": 255}
    variants = []
    for items in (1, 2):
        shape = [items, *(1 if size < 0 else size for size in tensor["shape"][1:])]
        count = math.prod(shape)
        variant = _object(
            name={"enum": [tensor["name"]]},
            datatype={"enum": [tensor["datatype"]]},
            shape={"enum": [shape]},
            data={"type": "array", "items": element, "minItems": count, "maxItems": count},
        )
        variants.append({**variant, "required": ["name", "shape", "datatype", "data"]})
    return variants


def _object(**properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schema_kind", list(FUZZ_CASES))
def test_the_infer_schema_fuzzed(served: Served, conformance: Conformance, schema_kind: str) -> None:
    """schemathesis draws requests from the infer operation's schema, valid ones and ones that break it: no answer
    is a 5xx, each conforms (schemathesis's own schema check, then the validator), and the server stays ready."""
    document = conformance.document if schema_kind == "official" else narrowed(openapi_document(), served.metadata)
    operation = schemathesis.openapi.from_dict(document)[INFER]["POST"]
    path_parameters = {"MODEL_NAME": served.model, "MODEL_VERSION": "1"}
    cases = st.one_of([operation.as_strategy(mode, path_parameters=path_parameters) for mode in GenerationMode])
    statuses: dict[int, int] = {}

    @given(case=cases)
    @settings(
        max_examples=FUZZ_CASES[schema_kind] * len(GenerationMode),
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def answer_conforms(case: schemathesis.Case) -> None:
        response = case.call(base_url=served.server.url, timeout=30)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
        headers = [(name, value) for name, values in response.headers.items() for value in values]
        request = httpx.Request(case.method, served.server.url + case.formatted_path)
        conformance.check(
            httpx.Response(response.status_code, headers=headers, content=response.content, request=request)
        )

    answer_conforms()
    assert sum(statuses.values()) >= FUZZ_CASES[schema_kind], statuses
    assert schema_kind == "official" or statuses.get(200), f"the narrowed schema never reached the model: {statuses}"
    assert httpx.get(f"{served.server.url}/v2/health/ready").status_code == 200
    assert served.server.slots_freed()


def test_grpc_through_the_official_proto(served: Served, tmp_path) -> None:
    """Health, metadata and inference through the official proto's stubs answer what HTTP answers."""
    official = OfficialGrpc(tmp_path)
    url, model = served.server.url, served.model
    with grpc.insecure_channel(f"127.0.0.1:{served.server.grpc_port}") as channel:
        stub = official.stub(channel)
        assert stub.ServerLive(official.message("ServerLiveRequest")(), timeout=10).live
        assert stub.ServerReady(official.message("ServerReadyRequest")(), timeout=10).ready
        assert stub.ModelReady(official.message("ModelReadyRequest")(name=model, version="1"), timeout=10).ready
        server = stub.ServerMetadata(official.message("ServerMetadataRequest")(), timeout=10)
        assert {"name": server.name, "version": server.version, "extensions": list(server.extensions)} == httpx.get(
            f"{url}/v2"
        ).json()
        metadata = stub.ModelMetadata(official.message("ModelMetadataRequest")(name=model), timeout=10)
        tensors = {
            kind: [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in getattr(metadata, kind)]
            for kind in ("inputs", "outputs")
        }
        assert tensors == {kind: served.metadata[kind] for kind in tensors}
        assert (metadata.name, metadata.platform) == (model, served.metadata["platform"])
        request = official.message("ModelInferRequest")(model_name=model, id="g1")
        request.inputs.add(name="image", datatype="BYTES", shape=[1, 1]).contents.bytes_contents.append(PNG)
        typed = stub.ModelInfer(request, timeout=60)
        del request.inputs[0].contents.bytes_contents[:]
        request.raw_input_contents.append(struct.pack("<I", len(PNG)) + PNG)
        raw = stub.ModelInfer(request, timeout=60)
    http = httpx.post(served.infer, json=image_body(parameters={"binary_data_output": True}))
    length = int(http.headers["Inference-Header-Content-Length"])
    assert http.content[length:] == b"".join(raw.raw_output_contents) == b"".join(typed.raw_output_contents)
    assert [output.name for output in raw.outputs] == served.outputs and raw.id == "g1"


def bad_grpc_calls(official: OfficialGrpc, model: str) -> dict[str, tuple[str, Any]]:
    """Calls a server must refuse, each with the RPC it goes to: a message, or bytes that are not its protobuf."""
    infer = official.message("ModelInferRequest")

    def request(*inputs: tuple[str, str, list[int]], raw: list[bytes] | None = None, **fields: Any) -> Any:
        message = infer(model_name=fields.pop("model_name", model), **fields)
        for name, datatype, shape in inputs:
            message.inputs.add(name=name, datatype=datatype, shape=shape)
        message.raw_input_contents.extend(raw or [])
        return message

    element = struct.pack("<I", len(PNG)) + PNG
    image = ("image", "BYTES", [1, 1])
    wrong_output = request(image, raw=[element])
    wrong_output.outputs.add(name="nope")
    return {
        "unknown model": ("ModelInfer", request(image, raw=[element], model_name="nope")),
        "unknown version": ("ModelInfer", request(image, raw=[element], model_version="7")),
        "metadata of an unknown model": ("ModelMetadata", official.message("ModelMetadataRequest")(name="nope")),
        "readiness of an unknown model": ("ModelReady", official.message("ModelReadyRequest")(name="nope")),
        "no input": ("ModelInfer", request()),
        "unknown input": ("ModelInfer", request(("x", "BYTES", [1, 1]), raw=[element])),
        "wrong datatype": ("ModelInfer", request(("image", "FP32", [1, 1]), raw=[b"\0" * 4])),
        "shape and data differ": ("ModelInfer", request(("image", "BYTES", [2, 1]), raw=[element])),
        "raw contents for no input": ("ModelInfer", request(raw=[element])),
        "not an image": ("ModelInfer", request(image, raw=[struct.pack("<I", 5) + b"hello"])),
        "unknown output": ("ModelInfer", wrong_output),
        "infer message not protobuf": ("ModelInfer", b"\xff\xff\xff\xff"),
        "metadata message not protobuf": ("ModelMetadata", b"\x0a\xff"),
    }


def test_bad_grpc_calls_are_invalid_argument_or_not_found(served: Served, tmp_path) -> None:
    official = OfficialGrpc(tmp_path)
    codes = {}
    with grpc.insecure_channel(f"127.0.0.1:{served.server.grpc_port}") as channel:
        stub = official.stub(channel)
        for case, (rpc, message) in bad_grpc_calls(official, served.model).items():
            call = getattr(stub, rpc)
            if isinstance(message, bytes):  # the bytes as they are, past the stub's serializer
                call = channel.unary_unary(f"/inference.GRPCInferenceService/{rpc}")
            with pytest.raises(grpc.RpcError) as caught:
                call(message, timeout=30)
            codes[case] = caught.value.code()
        assert stub.ServerReady(official.message("ServerReadyRequest")(), timeout=10).ready
    assert {case: code for case, code in codes.items() if code not in ACCEPTED} == {}
    assert [case for case, code in codes.items() if code == grpc.StatusCode.NOT_FOUND] == [
        "unknown model",
        "unknown version",
        "metadata of an unknown model",
        "readiness of an unknown model",
    ]
