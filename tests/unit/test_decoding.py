"""Uploads left encoded by the front end and decoded in the worker next to their batch (imgserve.worker.decoding):
the header checked in the front end as a full decode checks it, each upload decoded, resized and cropped as the
front end's preprocessing does, a corrupt one answered 400 alone, and the batched (GPU) path's fallback."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from imgserve import codec
from imgserve.api import Request
from imgserve.codec import EncodedImage
from imgserve.errors import ApiError
from imgserve.models.preprocess import Preprocess
from imgserve.worker.decoding import cut_tensor, decode_items

CPU = torch.device("cpu")
IMAGENET = Preprocess(256, 224, "bilinear")


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A photo-like uint8 image: smooth shapes under noise."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(np.sin(x / 37) + np.cos(y / 23)) * 60 + 128, x * 255 / width, y * 255 / height], -1)
    noise = np.random.default_rng(seed).normal(0, 20, base.shape)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def upload(pixels: np.ndarray, fmt: str = "jpeg") -> bytes:
    return codec.encode_image(pixels, fmt, 90)


def corrupt_jpeg() -> bytes:
    """A JPEG whose header is sound and whose data is not: it passes the front end and fails the decode."""
    data = upload(photo(64, 48))
    return data[: data.index(b"\xff\xda") + 20]  # cut short 20 bytes into its scan


def in_front_end(data: bytes, preprocess: Preprocess = IMAGENET) -> np.ndarray:
    """What the front end's own decode and preprocessing make of an upload."""
    return preprocess(codec.open_image(data, 10**8)).pixels


def left_encoded(data: bytes, preprocess: Preprocess = IMAGENET) -> EncodedImage:
    """The same upload as the front end leaves it for the worker, with how to cut it."""
    header = codec.read_header(data, 10**8)
    geometry = preprocess.geometry(header.width, header.height)
    return header.cut(geometry.resized, geometry.crop, preprocess.interpolation)


def test_the_header_is_checked_as_a_full_decode_checks_it() -> None:
    """Nothing is decoded in the front end, yet the same uploads are refused with the same answers."""
    big = upload(photo(64, 48))
    cases = [b"", b"not an image", upload(photo(8, 8))[:40], big, upload(photo(16, 16), "webp")[:0]]
    for data in cases:
        for limit in (10**8, 1000):
            expected = _error(codec.open_image, data, limit)
            assert _error(codec.read_header, data, limit) == expected, (data[:20], limit)
    header = codec.read_header(big, 10**8)
    assert (header.format, header.width, header.height, header.data) == ("JPEG", 64, 48, big)


def _error(step: Any, data: bytes, limit: int) -> tuple[int, str] | None:
    try:
        step(data, limit)
    except ApiError as error:
        return error.status, error.code
    return None


def test_a_request_gives_its_upload_encoded_over_http_and_v2_and_none_for_v2_pixels() -> None:
    data = upload(photo(40, 30), "png")
    raw = Request(body=data, content_type="image/png").encoded_image()
    assert raw is not None and (raw.format, raw.size) == ("PNG", (40, 30))
    v2 = Request(protocol="v2", inputs={"image": np.array([data], dtype=object)}).encoded_image()
    assert v2 is not None and v2.data == data
    assert Request(protocol="v2", inputs={"pixels": photo(4, 4)}).encoded_image() is None
    with pytest.raises(ApiError) as refused:
        Request(body=b"{}", content_type="application/json").encoded_image()
    assert refused.value.status == 415


def test_on_a_cpu_the_worker_makes_exactly_what_the_front_end_makes_of_mixed_formats() -> None:
    """JPEG, PNG and WebP uploads of several sizes in one batch: each decoded, resized and cropped by Pillow as the
    front end would, as uint8 HxWx3 tensors; plain values beside them untouched."""
    uploads = [upload(photo(500, 375)), upload(photo(300, 420, 1), "png"), upload(photo(256, 256, 2), "webp")]
    items = [{"image": left_encoded(data), "tag": index} for index, data in enumerate(uploads)]
    decoded, failed = decode_items(items, CPU)
    assert failed == {}
    for index, data in enumerate(uploads):
        image = decoded[index]["image"]
        assert isinstance(image, torch.Tensor) and image.dtype == torch.uint8 and decoded[index]["tag"] == index
        assert np.array_equal(image.numpy(), in_front_end(data))


def test_a_corrupt_upload_answers_400_alone_and_its_batch_is_decoded() -> None:
    good = upload(photo(64, 48))
    items = [left_encoded(good), left_encoded(corrupt_jpeg()), left_encoded(good)]
    decoded, failed = decode_items(items, CPU)
    assert list(failed) == [1] and failed[1].status == 400 and failed[1].code == "corrupt_image"
    assert np.array_equal(decoded[0].numpy(), in_front_end(good)) and np.array_equal(decoded[2], decoded[0])


class StandInBatchedDecoder:
    """MOCK of nvJPEG's batched decode (torchvision's decode_jpeg on a list, device="cuda"), which needs a GPU: it
    decodes with Pillow and, as the batched call does, fails the whole call when any JPEG in it is corrupt."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, datas: list[bytes], device: torch.device) -> list[torch.Tensor]:
        self.calls.append(len(datas))
        return [torch.from_numpy(np.array(codec.open_image(data, 10**8))) for data in datas]


def test_the_batched_decoder_takes_the_jpegs_in_one_call_and_the_rest_alone() -> None:
    batched = StandInBatchedDecoder()
    uploads = [upload(photo(500, 375)), upload(photo(200, 300, 1), "png"), upload(photo(640, 480, 2))]
    decoded, failed = decode_items([left_encoded(data) for data in uploads], CPU, batched)
    assert failed == {} and batched.calls == [2], "the two JPEGs were not decoded in one call"
    assert all(tuple(image.shape) == (224, 224, 3) for image in decoded)


def test_a_jpeg_that_fails_the_batched_call_is_decoded_alone_and_answers_400_alone() -> None:
    batched = StandInBatchedDecoder()
    good = upload(photo(64, 48))
    decoded, failed = decode_items([left_encoded(good), left_encoded(corrupt_jpeg()), left_encoded(good)], CPU, batched)
    assert batched.calls == [3, 1, 1, 1], "after the batch failed, each JPEG was not decoded alone"
    assert list(failed) == [1] and failed[1].status == 400
    assert decoded[0].shape == decoded[2].shape == (224, 224, 3)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size", [(500, 375), (1024, 768), (1920, 1080)])
def test_the_device_resize_is_within_two_levels_of_the_front_ends(size: tuple[int, int], interpolation: str) -> None:
    """The tensor resize and crop a GPU runs (antialiased, rounded) against the front end's Pillow resize, on the
    same decoded pixels: every value within 2 of 255, and on average within 0.25 (the tolerance docs state)."""
    preprocess = Preprocess(256, 224, interpolation)
    data = upload(photo(*size))
    pixels = torch.from_numpy(np.array(codec.open_image(data, 10**8)))
    on_device = cut_tensor(pixels, left_encoded(data, preprocess)).numpy().astype(int)
    difference = np.abs(on_device - in_front_end(data, preprocess).astype(int))
    assert on_device.shape == (224, 224, 3)
    assert difference.max() <= 2 and difference.mean() <= 0.25, (difference.max(), difference.mean())


def test_a_cut_outside_the_image_is_refused() -> None:
    header = codec.read_header(upload(photo(40, 30)), 10**8)
    with pytest.raises(ValueError):
        header.cut((20, 15), (10, 10, 20, 10))
    with pytest.raises(ValueError):
        header.cut(None, None, "lanczos")
    assert header.cut((40, 30), (0, 0, 40, 30)) == header, "a cut that changes nothing is dropped"
