"""The public API class (imgserve/api.py) in one process: the default `batch`/`unbatch` (stack and split, leaf by leaf),
`Request` as `decode_request` sees it over HTTP and the Open Inference Protocol (every bad input a 4xx ApiError),
`encoder` for both `encode_response` signatures, and an `ImageAPI` run through its hooks as a worker runs them."""

from __future__ import annotations

import io
import warnings
from typing import Any

import litserve as ls
import numpy as np
import pytest
import torch
from PIL import Image

from imgserve import ApiError, Encoded, ImageAPI, Request, UploadedFile
from imgserve.api import encoder, split, stack
from imgserve.testing import InProcess

RNG = np.random.default_rng(31)
PIXELS = RNG.integers(0, 256, (12, 20, 3), dtype=np.uint8)


def png(pixels: np.ndarray = PIXELS) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def upload(field: str = "file", data: bytes | None = None) -> UploadedFile:
    return UploadedFile(field, "photo.png", "image/png", png() if data is None else data)


def multipart(*files: UploadedFile, **form: str) -> Request:
    return Request(content_type="multipart/form-data", files=files, form=form)


def status_of(call: Any) -> tuple[int, str]:
    with pytest.raises(ApiError) as caught:
        call()
    return caught.value.status, caught.value.code


# stack and split: the default batch and unbatch.


def test_same_shaped_arrays_and_tensors_stack_and_split_back() -> None:
    arrays = [RNG.random((3, 4)) for _ in range(5)]
    stacked = stack(arrays)
    assert isinstance(stacked, np.ndarray) and stacked.shape == (5, 3, 4)
    assert all(np.array_equal(a, b) for a, b in zip(split(stacked), arrays, strict=True))
    tensors = [torch.rand(2, 3) for _ in range(4)]
    stacked_tensors = stack(tensors)
    assert isinstance(stacked_tensors, torch.Tensor) and stacked_tensors.shape == (4, 2, 3)
    assert all(torch.equal(a, b) for a, b in zip(split(stacked_tensors), tensors, strict=True))


def test_dicts_and_tuples_stack_leaf_by_leaf_and_split_back() -> None:
    items = [{"image": np.full((2, 2), i), "box": (np.arange(4) + i, torch.tensor([i, i]))} for i in range(3)]
    batch = stack(items)
    assert batch["image"].shape == (3, 2, 2)
    assert isinstance(batch["box"], tuple) and batch["box"][0].shape == (3, 4) and batch["box"][1].shape == (3, 2)
    back = split(batch)
    assert len(back) == 3
    for i, item in enumerate(back):
        assert np.array_equal(item["image"], np.full((2, 2), i))
        assert np.array_equal(item["box"][0], np.arange(4) + i) and torch.equal(item["box"][1], torch.tensor([i, i]))


def test_lists_stack_leaf_by_leaf() -> None:
    batch = stack([[np.zeros(3), np.ones(2)], [np.zeros(3), np.ones(2)]])
    assert isinstance(batch, list) and [part.shape for part in batch] == [(2, 3), (2, 2)]


@pytest.mark.parametrize(
    "items",
    [
        [np.zeros((2, 3)), np.zeros((3, 3))],  # shapes differ
        [np.zeros(3), torch.zeros(3)],  # numpy and torch
        [0.5, 0.7],  # plain values
        ["a", "b"],
        [{"a": np.zeros(2)}, {"b": np.zeros(2)}],  # keys differ
        [(np.zeros(2), 1), (np.zeros(2),)],  # lengths differ
        [(np.zeros(2),), [np.zeros(2)]],  # a tuple and a list
    ],
    ids=["shapes", "numpy-and-torch", "floats", "strings", "keys", "lengths", "tuple-and-list"],
)
def test_what_does_not_stack_stays_the_list_it_is(items: list[Any]) -> None:
    assert stack(items) is items


def test_mixed_leaves_stack_where_they_can() -> None:
    batch = stack([{"x": np.zeros(2), "t": 0.1}, {"x": np.ones(2), "t": 0.9}])
    assert batch["x"].shape == (2, 2) and batch["t"] == [0.1, 0.9]
    assert split(batch) == [{"x": pytest.approx(np.zeros(2)), "t": 0.1}, {"x": pytest.approx(np.ones(2)), "t": 0.9}]


def test_split_of_a_list_is_that_list_and_dicts_must_agree_on_the_batch_size() -> None:
    outputs = [{"label": "cat"}, {"label": "dog"}]
    assert split(outputs) == outputs  # a predict that returns one output per item
    with pytest.raises(ValueError, match="different batch sizes"):
        split({"a": np.zeros((2, 3)), "b": np.zeros((3, 3))})


# Request: what decode_request gets.


def test_a_multipart_file_and_a_raw_body_are_the_image() -> None:
    for request in (
        multipart(upload()),
        multipart(upload("other"), upload("image"), note="x"),
        Request(body=png(), content_type="image/png"),
        Request(body=png(), content_type="application/octet-stream"),
    ):
        name = "image" if request.file("image") else "file"
        assert np.array_equal(request.image(name), PIXELS)
        assert request.open_image(name).mode == "RGB"


def test_a_missing_file_field_is_422_naming_what_came() -> None:
    request = multipart(upload("picture"), threshold="0.5")
    with pytest.raises(ApiError) as caught:
        request.image()
    assert (caught.value.status, caught.value.code) == (422, "missing_file")
    assert "picture" in caught.value.message and "threshold" in caught.value.message
    assert status_of(lambda: Request(content_type="multipart/form-data").image()) == (422, "missing_file")


@pytest.mark.parametrize("content_type", ["application/json", "text/plain", ""])
def test_a_body_that_is_not_an_image_type_is_415(content_type: str) -> None:
    assert status_of(Request(body=png(), content_type=content_type).image) == (415, "unsupported_media_type")


def test_an_open_inference_protocol_image_or_pixels_input_is_the_image() -> None:
    encoded = Request(protocol="v2", inputs={"image": np.array([png()], dtype=object)})
    assert np.array_equal(encoded.image(), PIXELS)
    raw = Request(protocol="v2", inputs={"pixels": PIXELS})
    assert np.array_equal(raw.image(), PIXELS)


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        ({"image": np.array([png(), png()], dtype=object)}, (400, "bad_request")),  # two images for one item
        ({"image": np.array(["text"], dtype=object)}, (400, "bad_request")),  # not bytes
        ({"image": np.array([b"not an image"], dtype=object)}, (400, "not_an_image")),
        ({"pixels": PIXELS.astype(np.float32)}, (400, "bad_pixels")),
        ({"pixels": PIXELS[..., 0]}, (400, "bad_pixels")),
        ({"tensor": np.zeros(3)}, (400, "bad_request")),
        ({}, (400, "bad_request")),
    ],
    ids=["two-images", "str", "corrupt", "float-pixels", "gray-pixels", "other-input", "no-input"],
)
def test_a_bad_open_inference_protocol_input_is_400(inputs: dict[str, np.ndarray], expected: tuple) -> None:
    assert status_of(Request(protocol="v2", inputs=inputs).image) == expected


def test_an_image_over_the_pixel_limit_is_413_however_it_came() -> None:
    limit = PIXELS.shape[0] * PIXELS.shape[1] - 1
    for request in (
        Request(files=[upload()], content_type="multipart/form-data", max_image_pixels=limit),
        Request(body=png(), content_type="image/png", max_image_pixels=limit),
        Request(protocol="v2", inputs={"image": np.array([png()], dtype=object)}, max_image_pixels=limit),
        Request(protocol="v2", inputs={"pixels": PIXELS}, max_image_pixels=limit),
    ):
        assert status_of(request.image) == (413, "image_too_large")
    assert Request(body=png(), content_type="image/png", max_image_pixels=limit + 1).image().shape == PIXELS.shape


def test_json_is_parsed_or_a_400() -> None:
    assert Request(body=b'{"threshold": 0.5, "box": [1, 2]}').json() == {"threshold": 0.5, "box": [1, 2]}
    for body in (b"{not json", b"", b"\xff\xfe", b"[" * 100_000):
        assert status_of(Request(body=body).json) == (400, "bad_json")


def test_file_finds_an_upload_by_its_field() -> None:
    first, second = upload("file"), upload("mask", b"mask bytes")
    request = multipart(first, second)
    assert request.file() is first and request.file("mask") is second and request.file("absent") is None
    assert request.file("mask").data == b"mask bytes"  # type: ignore[union-attr]


@pytest.mark.parametrize(("fmt", "media_type"), [("png", "image/png"), ("jpeg", "image/jpeg"), ("webp", "image/webp")])
def test_for_image_is_a_request_carrying_that_image(fmt: str, media_type: str) -> None:
    request = Request.for_image(PIXELS, fmt)
    assert request.content_type == media_type and request.protocol == "http"
    pixels = request.image()
    assert pixels.shape == PIXELS.shape
    if fmt == "png":
        assert np.array_equal(pixels, PIXELS)


# The API class and its hooks.


class Plain(ImageAPI):
    def encode_response(self, output: Any) -> Any:  # type: ignore[override]  # LitServe's one-argument form
        return {"value": output}


class WithRequest(ImageAPI):
    def encode_response(self, output: Any, request: Request) -> Any:
        return {"value": output, "asked": request.query.get("q")}


def test_encoder_calls_encode_response_with_the_request_only_when_it_takes_it() -> None:
    request = Request(query={"q": "yes"})
    assert encoder(Plain())(1, request) == {"value": 1}
    assert encoder(WithRequest())(2, request) == {"value": 2, "asked": "yes"}
    assert encoder(ImageAPI())(3, request) == 3  # the default answers the output as JSON


def test_an_image_api_does_not_get_litservers_batch_warning() -> None:
    """ImageAPI has batch and unbatch of its own; LitServe warns about that without a max_batch_size. Not here."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ImageAPI()
        Plain(max_batch_size=None)
        WithRequest(max_batch_size="auto", batch_timeout=0.01)
    assert [str(warning.message) for warning in caught] == []

    class Control(ls.LitAPI):  # the warning this guards against, from LitServe itself
        def batch(self, inputs: list[Any]) -> Any:
            return inputs

        def unbatch(self, output: Any) -> list[Any]:
            return output

    with pytest.warns(UserWarning, match="max_batch_size"):
        Control()


def test_batching_settings_are_kept_for_the_server() -> None:
    assert ImageAPI().batching == (None, None)
    assert ImageAPI(max_batch_size="auto", batch_timeout=0.02).batching == ("auto", 0.02)
    api = ImageAPI(max_batch_size=8)
    assert api.batching == (8, None) and api.max_batch_size == 8


def test_the_default_hooks_decode_the_image_and_the_example_request_is_one() -> None:
    api = ImageAPI()
    assert np.array_equal(api.decode_request(Request(body=png(), content_type="image/png")), PIXELS)
    example = api.decode_request(api.example_request())
    assert example.shape == (256, 256, 3) and example.dtype == np.uint8


class MeanColour(ImageAPI):
    """A small user API: each image's mean colour, and the batch sizes predict saw."""

    def setup(self, device: str) -> None:
        self.batches: list[int] = []

    def predict(self, batch: np.ndarray) -> torch.Tensor:
        self.batches.append(len(batch))
        return torch.from_numpy(batch).float().mean(dim=(1, 2))

    def encode_response(self, output: torch.Tensor, request: Request) -> Encoded:
        return Encoded(",".join(f"{value:.1f}" for value in output.tolist()).encode(), "text/csv")


def test_an_image_api_runs_through_its_hooks_as_a_worker_batches_them() -> None:
    """decode_request -> batch (same sizes stacked) -> predict -> unbatch -> encode_response, in order."""
    api = MeanColour()
    worker = InProcess(api).setup()
    images = [np.full((8, 8, 3), 10, np.uint8), np.full((8, 8, 3), 20, np.uint8), np.full((4, 6, 3), 30, np.uint8)]
    answers = worker.run([Request.for_image(image) for image in images])
    assert [answer.data for answer in answers] == [b"10.0,10.0,10.0", b"20.0,20.0,20.0", b"30.0,30.0,30.0"]
    assert all(answer.media_type == "text/csv" for answer in answers)
    assert sorted(api.batches) == [1, 2], "the two 8x8 images in one batch, the 4x6 one alone"


def test_a_hook_error_answers_only_its_item() -> None:
    """An ApiError raised in predict answers that item with it; the other items of the batch get their outputs."""

    class Picky(MeanColour):
        def predict(self, batch: np.ndarray) -> torch.Tensor:
            if (batch == 99).any():
                raise ApiError(422, "too_bright", "no 99s")
            return super().predict(batch)

    worker = InProcess(Picky()).setup()
    outputs = worker.predict([np.full((2, 2, 3), value, np.uint8) for value in (1, 99, 3)])
    assert isinstance(outputs[1], ApiError) and (outputs[1].status, outputs[1].code) == (422, "too_bright")
    assert [output.tolist() for output in (outputs[0], outputs[2])] == [[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]]
