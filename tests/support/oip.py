"""The Open Inference Protocol's official definitions, pinned in tests/data/open_inference_protocol (its README says
from where): the OpenAPI document as a validator of a server's HTTP answers, and the proto compiled at test time
into gRPC stubs.

Where the OpenAPI document and the texts beside it differ, the texts rule, and each rule here names its source:
- its paths write `${NAME}`, the texts' placeholder, for OpenAPI's `{NAME}`, and only the versioned model paths and
  `/v2/`, where inference_rest.md makes `/versions/<v>` optional and writes the server metadata path `v2`;
- it declares 200 alone, or 200 and 400, per route; the texts answer a failure with "an HTTP error status (typically
  400)" whose body is the route's error object, and health with "a 4xx status code [for] false" (required_api.md);
- binary tensor data (Triton's extension_binary_data.md): an output sent as binary carries
  `parameters.binary_data_size` instead of `data`, after a JSON header of `Inference-Header-Content-Length` bytes.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import yaml
from openapi_core import OpenAPI
from openapi_core.testing import MockRequest, MockResponse
from openapi_schema_validator import OAS30Validator

DATA = Path(__file__).parent.parent / "data" / "open_inference_protocol"
REST = DATA / "open_inference_rest.yaml"
PROTO = DATA / "open_inference_grpc.proto"
HEADER_LENGTH = "Inference-Header-Content-Length"
VERSIONED = "/versions/{MODEL_VERSION}"
ERROR_OBJECTS = {  # the error object each route's text names ("The HTTP body must contain the ... object")
    "/v2/": "metadata_server_error_response",
    "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}": "metadata_model_error_response",
    "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/infer": "inference_error_response",
}
HEALTH = ("/v2/health/live", "/v2/health/ready", "/v2/models/{MODEL_NAME}/versions/{MODEL_VERSION}/ready")


def openapi_document() -> dict[str, Any]:
    """The pinned document with `{NAME}` placeholders, each versioned path also without its version, `/v2/` also as
    `/v2`."""
    document = json.loads(re.sub(r"\$\{(\w+)\}", r"{\1}", json.dumps(yaml.safe_load(REST.read_text()))))
    paths = document["paths"]
    for template, item in list(paths.items()):
        if VERSIONED in template:
            twin = copy.deepcopy(item)
            twin["parameters"] = [p for p in twin.get("parameters", []) if p["name"] != "MODEL_VERSION"]
            for operation in (value for key, value in twin.items() if key in ("get", "post")):
                operation["operationId"] += "-any-version"
            paths[template.replace(VERSIONED, "")] = twin
    paths["/v2"] = copy.deepcopy(paths["/v2/"])
    paths["/v2"]["get"]["operationId"] = "get-v2-no-slash"
    return document


@dataclass
class Answer:
    """An HTTP answer as the protocol reads it: its JSON (the header, for binary tensor data) and the binary outputs
    by name."""

    status: int
    body: Any
    binary: dict[str, bytes]


class Conformance:
    """Checks an HTTP answer of a v2 route against the pinned OpenAPI document and the texts (module docstring)."""

    def __init__(self) -> None:
        self.document = openapi_document()
        self.openapi = OpenAPI.from_dict(self.document)
        self.checked: set[tuple[str, str, int]] = set()  # (method, route template, status) seen so far

    def check(self, response: httpx.Response) -> Answer:
        """The answer, after asserting that its status and body are what the document and the texts allow."""
        method, path = response.request.method, response.request.url.path
        template = self.template(method, path)
        self.checked.add((method, template, response.status_code))
        body, binary = self._body(response)
        declared = self.document["paths"][template][method.lower()]["responses"]
        original = _original(template)
        if str(response.status_code) in declared:
            self._validate(method, path, response.status_code, _as_json(body, binary))
        elif original in HEALTH:
            assert 400 <= response.status_code < 500, f"{method} {path}: health is 200 or a 4xx, not {response}"
        else:
            assert 400 <= response.status_code < 600, f"{method} {path}: {response.status_code} is not an error"
            OAS30Validator(self.document["components"]["schemas"][ERROR_OBJECTS[original]]).validate(body)
        return Answer(response.status_code, body, binary)

    def template(self, method: str, path: str) -> str:
        """The document's path template that `path` matches for `method` (fails for a route it does not have)."""
        for template, item in self.document["paths"].items():
            if method.lower() in item and re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", template), path):
                return template
        raise AssertionError(f"{method} {path} is no route of the OpenAPI document")

    def _body(self, response: httpx.Response) -> tuple[Any, dict[str, bytes]]:
        """The JSON body, or for binary tensor data the JSON header and the binary outputs."""
        length = response.headers.get(HEADER_LENGTH)
        if length is None:
            assert response.headers["content-type"] == "application/json", response.headers
            return response.json(), {}
        assert response.headers["content-type"] == "application/octet-stream", response.headers
        header, offset, binary = json.loads(response.content[: int(length)]), int(length), {}
        for output in header["outputs"]:
            size = output.get("parameters", {}).get("binary_data_size")
            if size is not None:
                assert "data" not in output, output
                binary[output["name"]] = response.content[offset : offset + size]
                offset += size
        assert offset == len(response.content), "the binary outputs do not fill the body"
        return header, binary

    def _validate(self, method: str, path: str, status: int, body: Any) -> None:
        request = MockRequest("http://127.0.0.1", method.lower(), path)
        self.openapi.validate_response(request, MockResponse(json.dumps(body).encode(), status_code=status))


def _as_json(body: Any, binary: dict[str, bytes]) -> Any:
    """An answer's JSON as the document's schema sees it: a binary output (extension_binary_data.md) given the
    `data` that response_output requires, empty."""
    if not binary:
        return body
    return {**body, "outputs": [{"data": [], **output} for output in body["outputs"]]}


def _original(template: str) -> str:
    """The template as the pinned document writes it: `/v2` as `/v2/`, a model path with its version."""
    if template == "/v2":
        return "/v2/"
    if template.startswith("/v2/models/") and VERSIONED not in template:
        head, _, tail = template.partition("{MODEL_NAME}")
        return f"{head}{{MODEL_NAME}}{VERSIONED}{tail}"
    return template


class OfficialGrpc:
    """The official proto compiled by protoc (grpcio-tools) into a descriptor set in `directory` and loaded into a
    descriptor pool of its own (tritonclient.grpc, which other tests import into the same process, registers the
    same `inference.*` names in protobuf's default pool). `message(name)` is a message class; `stub(channel)` has a
    callable per RPC of the service, at the path a generated stub calls."""

    def __init__(self, directory: Path) -> None:
        from google.protobuf import descriptor_pb2, descriptor_pool
        from grpc_tools import protoc

        out = directory / "open_inference_grpc.desc"
        assert protoc.main(["protoc", f"-I{DATA}", f"--descriptor_set_out={out}", PROTO.name]) == 0
        self.pool = descriptor_pool.DescriptorPool()
        for file in descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file:
            self.pool.AddSerializedFile(file.SerializeToString())
        self.service = self.pool.FindServiceByName("inference.GRPCInferenceService")

    def message(self, name: str) -> Any:
        from google.protobuf import message_factory

        return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(f"inference.{name}"))

    def stub(self, channel: Any) -> SimpleNamespace:
        from google.protobuf import message_factory

        calls = {}
        for method in self.service.methods:
            request = message_factory.GetMessageClass(method.input_type)
            response = message_factory.GetMessageClass(method.output_type)
            calls[method.name] = channel.unary_unary(
                f"/{self.service.full_name}/{method.name}",
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
        return SimpleNamespace(**calls)
