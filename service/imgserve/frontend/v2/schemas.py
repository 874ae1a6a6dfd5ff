"""The Open Inference Protocol's HTTP messages as pydantic models, for the OpenAPI document (frontend/openapi.py):
what the routes of frontend/v2/http.py read and answer, as the protocol's text and Triton's extensions name them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

Datatype = Literal[
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES"
]


class ProtocolError(BaseModel):
    """The body of every error of the protocol's routes."""

    error: str


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool
    error: str | None = Field(None, description="Why not ready (loading, draining, ...)")


class ModelReady(Ready):
    name: str


class TensorMetadata(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int] = Field(description="The first dimension is the batch; -1: any length")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ConfigTensor(BaseModel):
    name: str
    data_type: str = Field(description="TYPE_STRING for BYTES, else TYPE_ and the datatype")
    dims: list[int] = Field(description="Without the batch dimension; -1: any length")
    format: str | None = Field(None, description="An input's image layout: FORMAT_NCHW, FORMAT_NHWC or FORMAT_NONE")
    optional: bool | None = None


class ModelConfig(BaseModel):
    """The part of Triton's model configuration that its clients read."""

    name: str
    platform: str
    max_batch_size: int
    input: list[ConfigTensor]
    output: list[ConfigTensor]
    dynamic_batching: dict[str, int]


class Tensor(BaseModel):
    name: str
    datatype: Datatype
    shape: list[int] = Field(description="The first dimension is the batch")
    parameters: dict[str, Any] = Field(
        {}, description="binary_data_size: the tensor's bytes follow the JSON header instead of `data`"
    )
    data: list[Any] | None = Field(
        None,
        description="The elements in row-major order, flat or nested; BYTES elements as strings: text, or base64 for "
        "an input or output that holds binary data (`image`, encoded images)",
    )


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] = Field(
        {}, description="binary_data: answer it as bytes after the JSON; classification: the top k as strings"
    )


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] = Field(
        {}, description="binary_data_output: every output as bytes; timeout: a deadline in microseconds"
    )
    inputs: list[Tensor]
    outputs: list[RequestedOutput] | None = Field(None, description="None: every output of the model")


class InferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    outputs: list[Tensor]


class DurationStat(BaseModel):
    count: int
    ns: int = Field(description="Cumulative nanoseconds")


class InferenceStats(BaseModel):
    success: DurationStat
    fail: DurationStat
    queue: DurationStat
    compute_input: DurationStat
    compute_infer: DurationStat
    compute_output: DurationStat
    cache_hit: DurationStat
    cache_miss: DurationStat


class ModelStatistics(BaseModel):
    name: str
    version: str
    last_inference: int = Field(description="Not measured: 0")
    inference_count: int = Field(description="Images the model ran")
    execution_count: int = Field(description="The model's batches")
    inference_stats: InferenceStats
    batch_stats: list[dict[str, Any]]


class Statistics(BaseModel):
    """The statistics extension's answer: what imgserve measured, per model (docs/v2-protocol.md#statistics)."""

    model_stats: list[ModelStatistics]
