"""What a TensorSpec declares and what the protocol makes of it: an image input's format in Triton's configuration
(declared, else guessed), BYTES in JSON (base64 for binary data, text elsewhere, both ways), and the statistics read
from prometheus_client's multiprocess files for one model among several."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from imgserve import TensorSpec
from imgserve.errors import ApiError
from imgserve.frontend.v2.model import config_tensor
from imgserve.frontend.v2.statistics import Samples, model_statistics
from imgserve.frontend.v2.tensors import Tensor, json_data, parse_http


@pytest.mark.parametrize(
    ("spec", "shown"),
    [
        (TensorSpec("data", "FP32", (3, 224, 224), format="NCHW"), "FORMAT_NCHW"),
        (TensorSpec("data", "FP32", (3, 224, 224)), "FORMAT_NONE"),
        (TensorSpec("data", "UINT8", (224, 224, 3)), "FORMAT_NHWC"),
        (TensorSpec("data", "UINT8", (3, 3, 3), format="NCHW"), "FORMAT_NCHW"),  # the declaration beats the guess
        (TensorSpec("data", "FP32", (64, 64, 1), format="NHWC"), "FORMAT_NHWC"),
    ],
)
def test_an_inputs_format_is_declared_or_guessed(spec: TensorSpec, shown: str) -> None:
    assert config_tensor(spec, image=True)["format"] == shown
    assert "format" not in config_tensor(spec)  # outputs carry none


@pytest.mark.parametrize(
    ("arguments", "message"),
    [({"format": "CHW"}, "'NCHW' or 'NHWC'"), ({"format": "NCHW", "dims": (3, 224)}, "3 dims")],
)
def test_a_format_that_cannot_be_is_refused_where_the_api_is_written(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorSpec(**{"name": "data", "datatype": "FP32", "dims": (3, 8, 8), **arguments})


def test_bytes_hold_binary_data_when_declared_or_named_image() -> None:
    assert TensorSpec("image", "BYTES", (1,)).holds_binary
    assert TensorSpec("png", "BYTES", (1,), binary=True).holds_binary
    assert not TensorSpec("prompt", "BYTES", (1,)).holds_binary
    assert not TensorSpec("image", "BYTES", (1,), binary=False).holds_binary


def json_body(data: list) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1, len(data)], "data": data}]}).encode()


def test_json_bytes_are_text_unless_the_input_holds_binary_data() -> None:
    (text,) = parse_http(json_body(["seven", "ünïcode", ""]), None).inputs
    assert text.data == [b"seven", "ünïcode".encode(), b""]
    (binary,) = parse_http(json_body(["aGk=", ""]), None, base64_inputs={"x"}).inputs
    assert binary.data == [b"hi", b""]


@pytest.mark.parametrize(
    ("data", "base64_inputs", "message"),
    [
        (["hi there"], {"x"}, "must be base64"),
        ([7], (), "must be strings"),
        (["\ud800"], (), "not valid Unicode"),
    ],
    ids=["text where binary is declared", "a number", "a lone surrogate"],
)
def test_json_bytes_that_do_not_fit_are_a_400(data: list, base64_inputs: set, message: str) -> None:
    with pytest.raises(ApiError, match=message) as caught:
        parse_http(json_body(data), None, base64_inputs=base64_inputs)
    assert caught.value.status == 400


def test_json_bytes_answers_are_text_or_base64_as_declared() -> None:
    assert json_data(Tensor("y", "BYTES", [1, 2], [b"12", "é".encode()], text=True)) == ["12", "é"]
    assert json_data(Tensor("y", "BYTES", [1, 1], [b"\xff\xd8"])) == ["/9g="]
    with pytest.raises(ApiError, match="binary=True") as caught:
        json_data(Tensor("y", "BYTES", [1, 1], [b"\xff\xd8"], text=True))
    assert caught.value.status == 500


WRITER = """
from prometheus_client import Counter, Histogram
requests = Counter("imgserve_requests_total", "", ["route", "code", "model"])
seconds = Counter("imgserve_request_seconds_total", "", ["route", "code", "model"])
batch = Histogram("imgserve_batch_size", "", ["model"], buckets=(1, 2, 4))
for model, ok, failed, sizes in (("a", 3, 1, (1, 2)), ("b", 5, 0, (4,))):
    requests.labels("/v2/infer", "200", model).inc(ok)
    requests.labels("/v2/infer", "503", model).inc(failed)
    requests.labels("/v2", "200", model).inc(9)  # no inference
    seconds.labels("/v2/infer", "200", model).inc(0.5 * ok)
    for size in sizes:
        batch.labels(model).observe(size)
"""


def test_statistics_are_each_models_own_samples(tmp_path: Path) -> None:
    """Samples written by another process, two models apart by their `model` label: each model's figures."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", WRITER], env=env, check=True, timeout=60)
    samples = Samples(str(tmp_path))
    a, b = (model_statistics(name, "1", samples) for name in ("a", "b"))
    assert (a["inference_count"], a["execution_count"], b["inference_count"], b["execution_count"]) == (3, 2, 4, 1)
    assert a["inference_stats"]["success"] == {"count": 3, "ns": 1_500_000_000}
    assert a["inference_stats"]["fail"] == {"count": 1, "ns": 0}
    assert b["inference_stats"]["success"] == {"count": 5, "ns": 2_500_000_000}
    assert a["inference_stats"]["compute_infer"]["count"] == a["inference_stats"]["compute_input"]["count"] == 3
