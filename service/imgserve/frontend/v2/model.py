"""The served models as the Open Inference Protocol sees them: each one's declared tensors, metadata, configuration
and inference, found by name (`V2Models.find`).

Both wire formats (HTTP in http.py, gRPC in grpc_service.py) convert to and from tensors.InferRequest / Tensor and
call `V2Model.infer`. A request's tensors carry a batch of N items along their first dimension: item i gets a
`Request` whose inputs are row i of each input tensor; the API decodes each in the front end, the workers batch
them with every other call's, and each item's encoded answer (a dict of the declared outputs' values) becomes row i
of each output tensor. Items whose values differ in shape are padded with the output's `pad`, or refused (400)
where it has none. An API that declares no tensors takes one encoded image (`image`, BYTES [N, 1]) and answers
one BYTES output (`output`) holding its /predict answer. With the classification extension (output parameter
`classification: k`) a numeric output answers BYTES [N, k] of "score:index[:label]", best first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from imgserve.api import Request, TensorSpec, encoder
from imgserve.config import ServerSettings
from imgserve.errors import ApiError
from imgserve.frontend.inference import Inference, Steps
from imgserve.frontend.responding import json_bytes
from imgserve.frontend.v2.statistics import Samples, model_statistics
from imgserve.frontend.v2.tensors import DTYPES, InferRequest, RequestedOutput, Tensor, bad, from_raw
from imgserve.handoff.state import SharedState
from imgserve.litapi import LitServeAPI
from imgserve.models.loader import is_torchscript
from imgserve.served import Catalog, ServedModel
from imgserve.version import __version__

VERSION = "1"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "classification", "statistics", "model_repository"]


def platform(model: str) -> str:
    """The metadata's `platform`, "<project>_<format>" as the specification names platforms (information only; it
    lists `pytorch_torchscript` for TorchScript): a TorchScript archive, whatever its suffix, `pytorch_torchscript`;
    a torch.export archive (.pt2) `pytorch_exportedprogram`; any model the workers build and run as Python modules
    (the built-in model, weights with a factory, a pickled module) `pytorch_eager`."""
    path = Path(model)
    if path.suffix == ".pt2":
        return "pytorch_exportedprogram"
    return "pytorch_torchscript" if path.is_file() and is_torchscript(path) else "pytorch_eager"


class V2Models:
    """The models the protocol serves (every ImageAPI of the catalog), by name, version 1 each; and the server's
    readiness, which `not_ready_reason` gives (the pod's, or one model's)."""

    def __init__(
        self,
        catalog: Catalog,
        settings: ServerSettings,
        state: SharedState,
        inference: Inference,
        not_ready_reason: Callable[[int | None], str | None],
    ) -> None:
        self.not_ready_reason = not_ready_reason
        self.by_name = {
            served.name: V2Model(served, settings, state, inference)
            for served in catalog
            if not isinstance(served.api, LitServeAPI)
        }

    def find(self, name: str, version: str | None = None) -> V2Model:
        """The model `name` (and `version`, if given); 404 when this server has no such model."""
        model = self.by_name.get(name)
        if model is None:
            served = ", ".join(map(repr, self.by_name))
            message = f"Request for unknown model: {name[:100]!r} is not found; this server serves {served}"
            raise ApiError(404, "unknown_model", message)
        if version not in (None, "", VERSION):
            raise ApiError(404, "unknown_version", f"model {name!r} has only version {VERSION}, not {version[:20]!r}")
        return model

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "imgserve", "version": __version__, "extensions": EXTENSIONS}

    def statistics(self, name: str | None = None) -> dict[str, Any]:
        """The statistics extension's answer: every model's entry, or one's (statistics.py says what each figure is)."""
        names = [name] if name is not None else list(self.by_name)
        samples = Samples()
        return {"model_stats": [model_statistics(model, VERSION, samples) for model in names]}

    def max_images(self) -> int:
        """The most items one request for any model may carry."""
        return max((model.max_images() for model in self.by_name.values()), default=1)

    def label(self, name: str) -> str:
        """The model label of a call naming `name`: the name of a model served, else "" (unknown names would make
        the label's values unbounded)."""
        return name if name in self.by_name else ""

    def model_not_ready_reason(self, name: str) -> str | None:
        return self.not_ready_reason(self.by_name[name].served.index)


class V2Model:
    """One served model, under its name, version 1."""

    def __init__(self, served: ServedModel, settings: ServerSettings, state: SharedState, inference: Inference) -> None:
        self.served, self.api, self.name, self.batching = served, served.api, served.name, served.batching
        self.settings, self.state, self.inference = settings, state, inference
        self.platform = platform(served.api.model or "")
        self.binary_inputs = frozenset(
            spec.name for spec in served.api.inputs if spec.datatype == "BYTES" and spec.holds_binary
        )
        self._encode = encoder(served.api)

    def max_images(self) -> int:
        """The most items one request may carry (what the model's queue holds): the parsers' bound on BYTES
        elements."""
        return self.inference.admission.bounds(self.served.index)[1]

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": self.platform,
            "inputs": [_metadata(spec) for spec in self.api.inputs],
            "outputs": [_metadata(spec) for spec in self.api.outputs],
        }

    def config(self) -> dict[str, Any]:
        """The part of Triton's model configuration that clients (perf_analyzer, image_client) read."""
        configured, limits = self.batching.max_batch_size, self.state.models.limits(self.served.index)
        batch = limits.batch_size if limits else (configured if isinstance(configured, int) else 1)
        several = len(self.api.inputs) > 1  # then each input is optional: the API says which it needs
        return {
            "name": self.name,
            "platform": self.platform,
            "max_batch_size": int(batch),
            "input": [config_tensor(spec, optional=several, image=True) for spec in self.api.inputs],
            "output": [config_tensor(spec) for spec in self.api.outputs],
            "dynamic_batching": {"max_queue_delay_microseconds": int(self.batching.batch_timeout_ms * 1000)},
        }

    async def infer(
        self, request: InferRequest, deadline: float, started: float
    ) -> list[tuple[RequestedOutput, Tensor]]:
        """Each requested output with its tensor for the request's items; ApiError for anything wrong."""
        specs = {spec.name: spec for spec in self.api.outputs}
        wanted = _wanted(specs, request)
        names = [output.name for output in request.outputs] if request.outputs is not None else None
        inputs = request.inputs if request.raw is None else [self._raw_input(request.raw)]
        calls = [
            Request(
                protocol="v2",
                inputs=row,
                outputs=names,
                parameters=request.parameters,
                max_image_pixels=self.settings.max_image_pixels,
            )
            for row in self._rows(inputs)
        ]
        deadline = min(deadline, started + _timeout_s(request.parameters.get("timeout")))
        encode = lambda output, call: self._values(output, call, specs)  # noqa: E731
        steps = Steps(self.served, self.api.decode_request, encode, _row_bytes)
        answers = await self.inference.run(calls, deadline, steps)
        return [(output, self._tensor(specs[output.name], output, answers)) for output in wanted]

    def _raw_input(self, body: bytes) -> Tensor:
        """A raw binary request's body as the first declared input (the extension wants a model of one input; the
        built-in models' second input, `pixels`, is an alternative to `image`, never needed beside it)."""
        spec = self.api.inputs[0]
        return from_raw(spec.name, spec.datatype, spec.dims, body)

    def _rows(self, inputs: list[Tensor]) -> list[dict[str, np.ndarray]]:
        """The request's items: each declared input's row of the batch, checked against the declaration."""
        declared = {spec.name: spec for spec in self.api.inputs}
        count = None
        if len({tensor.name for tensor in inputs}) < len(inputs):
            raise bad("an input is given twice")
        for tensor in inputs:
            spec = declared.get(tensor.name)
            if spec is None:
                given, names = repr(tensor.name[:100]), ", ".join(map(repr, declared))
                raise bad(f"unknown input {given}; this model takes {names}")
            _check_dims(spec, tensor)
            if count not in (None, tensor.shape[0]):
                raise bad("every input must carry the same number of items (the first dimension)")
            count = tensor.shape[0]
        return [{tensor.name: _row(tensor, index) for tensor in inputs} for index in range(count or 0)]

    def _values(self, output: Any, call: Request, specs: dict[str, TensorSpec]) -> dict[str, Any]:
        """One item's answer as the declared outputs' values (the front end's encode step)."""
        answer = self._encode(output, call)
        if isinstance(answer, dict) and set(answer) <= set(specs) and answer:
            return answer
        if len(specs) == 1:  # one declared output: the whole answer is its value
            return {next(iter(specs)): answer}
        raise ApiError(500, "api_error", f"encode_response returned no dict of the declared outputs {sorted(specs)}")

    def _tensor(self, spec: TensorSpec, output: RequestedOutput, answers: list[dict[str, Any]]) -> Tensor:
        """The batch's tensor for one output: row i from item i's value."""
        missing = [index for index, answer in enumerate(answers) if spec.name not in answer]
        if missing:
            raise ApiError(500, "api_error", f"encode_response gave no value for output {spec.name!r}")
        values = [answer[spec.name] for answer in answers]
        if output.classification is not None:
            return self._classification(spec.name, output.classification, values)
        if spec.datatype == "BYTES":
            elements = [_elements(value) for value in values]
            if len({len(row) for row in elements}) > 1:
                raise bad(f"output {spec.name!r}: the items have different numbers of elements")
            shape, flat = [len(values), len(elements[0])], [e for row in elements for e in row]
            return Tensor(spec.name, "BYTES", shape, flat, text=not spec.holds_binary)
        arrays = [np.asarray(value, dtype=DTYPES[spec.datatype]) for value in values]
        return Tensor(spec.name, spec.datatype, *_stacked(spec, arrays))

    def _classification(self, name: str, k: int, values: list[Any]) -> Tensor:
        """Triton's classification strings "score:index[:label]", best first: k per item (at most the classes)."""
        scores = [np.asarray(value, dtype=np.float64).reshape(-1) for value in values]
        k = min(k, min(len(row) for row in scores))
        labels, strings = self.api.labels, []
        for row in scores:
            for index in np.argsort(-row, kind="stable")[:k]:
                label = f":{labels[index]}" if index < len(labels) else ""
                strings.append(f"{row[index]:f}:{index}{label}".encode())
        return Tensor(name, "BYTES", [len(values), k], strings, text=True)


def _wanted(specs: dict[str, TensorSpec], request: InferRequest) -> list[RequestedOutput]:
    """The outputs to answer: those the request names, else every declared output (the specification's default)."""
    if request.outputs is None:
        return [RequestedOutput(name, request.binary_outputs) for name in specs]
    for output in request.outputs:
        spec = specs.get(output.name)
        if spec is None:
            raise bad(f"unknown output {output.name[:100]!r}; this model has {', '.join(specs)}")
        if output.classification is not None and spec.datatype == "BYTES":
            raise bad(f"output {output.name!r}: classification applies to numeric outputs only")
    return request.outputs


def _check_dims(spec: TensorSpec, tensor: Tensor) -> None:
    """The tensor is [N, *dims] of the declared datatype (-1: any length; a BYTES [N] counts as [N, 1])."""
    shape = tensor.shape[1:] if tensor.shape[1:] or spec.datatype != "BYTES" else [1]
    fits = len(shape) == len(spec.dims) and all(d in (-1, s) for d, s in zip(spec.dims, shape, strict=True))
    if tensor.datatype != spec.datatype or not tensor.shape or not fits:
        want = f"{spec.datatype} {[-1, *spec.dims]}"
        got = f"{tensor.datatype[:16]} {tensor.shape}"
        raise bad(f"input {spec.name!r} is {want} (got {got})")


def _row(tensor: Tensor, index: int) -> np.ndarray:
    """Item `index` of a batched tensor: numbers as an array, BYTES as an object array of bytes."""
    if isinstance(tensor.data, np.ndarray):
        item: np.ndarray = tensor.data[index]
        return item
    per_item = int(np.prod(tensor.shape[1:])) if len(tensor.shape) > 1 else 1
    row = np.empty(per_item, dtype=object)
    row[:] = tensor.data[index * per_item : (index + 1) * per_item]
    return row.reshape(tensor.shape[1:] or [1])


def _row_bytes(call: Request) -> int:
    return sum(
        sum(len(item) for item in value.reshape(-1)) if value.dtype == object else value.nbytes
        for value in call.inputs.values()
    )


def _elements(value: Any) -> list[bytes]:
    """A BYTES output's elements for one item: bytes or text as one element, a list of them as several, anything
    else as its JSON."""
    if isinstance(value, bytes | str):
        return [value.encode() if isinstance(value, str) else value]
    if isinstance(value, list | tuple) and all(isinstance(item, bytes | str) for item in value) and value:
        return [item.encode() if isinstance(item, str) else item for item in value]
    return [json_bytes(value)]


def _stacked(spec: TensorSpec, arrays: list[np.ndarray]) -> tuple[list[int], np.ndarray]:
    """The items' arrays as one [N, ...] array: padded with the spec's `pad` where their shapes differ."""
    shapes = {array.shape for array in arrays}
    if len(shapes) > 1:
        if spec.pad is None or len({len(shape) for shape in shapes}) > 1:
            raise bad(f"output {spec.name!r} is one tensor: its items must share one shape (got {len(shapes)})")
        largest = [max(sizes) for sizes in zip(*shapes, strict=True)]
        padded = np.full([len(arrays), *largest], spec.pad, dtype=arrays[0].dtype)
        for row, array in zip(padded, arrays, strict=True):
            row[tuple(slice(0, size) for size in array.shape)] = array
        return list(padded.shape), padded
    stacked = np.stack(arrays)
    return list(stacked.shape), stacked


def _metadata(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": [-1, *spec.dims]}


def config_tensor(spec: TensorSpec, optional: bool = False, image: bool = False) -> dict[str, Any]:
    """A tensor in Triton's model configuration; an input says its image format (image_client reads it): the one
    its TensorSpec declares, else NHWC guessed from dims (H, W, 1|3), else none."""
    data_type = "TYPE_STRING" if spec.datatype == "BYTES" else f"TYPE_{spec.datatype}"
    entry: dict[str, Any] = {"name": spec.name, "data_type": data_type, "dims": list(spec.dims)}
    if image:
        guessed = "NHWC" if len(spec.dims) == 3 and spec.dims[2] in (1, 3) else "NONE"
        entry["format"] = f"FORMAT_{spec.format or guessed}"
    return {**entry, "optional": True} if optional else entry


def _timeout_s(value: Any) -> float:
    """Triton's `timeout` request parameter, in microseconds (none: no limit beyond the request's deadline)."""
    if value is None:
        return float("inf")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ApiError(422, "bad_timeout", "parameter timeout must be a positive number of microseconds")
    return value / 1e6
