"""Decoding of untrusted uploads: every mode Pillow can hand us becomes upright 8-bit RGB, or a clear ApiError."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from imgserve.codec import choose_format, decode_image, encode_image, from_pixels, open_image
from imgserve.errors import ApiError
from imgserve.models.preprocess import Preprocess

LIMIT = 10_000_000


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def test_exif_orientation_is_applied() -> None:
    image = Image.new("RGB", (40, 20), "red")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    assert decode_image(encode(image, "JPEG", exif=exif), LIMIT).shape == (40, 20, 3)


def test_alpha_is_composited_over_white() -> None:
    transparent = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    assert (decode_image(encode(transparent, "PNG"), LIMIT) == 255).all()


@pytest.mark.parametrize(("mode", "fmt"), [("L", "PNG"), ("CMYK", "JPEG"), ("P", "GIF"), ("LA", "PNG")])
def test_other_modes_become_rgb(mode: str, fmt: str) -> None:
    pixels = decode_image(encode(Image.new("RGB", (10, 6), (10, 200, 30)).convert(mode), fmt), LIMIT)
    assert pixels.shape == (6, 10, 3) and pixels.dtype == np.uint8


def test_16_bit_is_scaled_not_clipped() -> None:
    wide = Image.fromarray(np.full((4, 4), 65535, dtype=np.uint16))
    pixels = decode_image(encode(wide, "PNG"), LIMIT)
    assert pixels.min() == 255


def test_animated_gives_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("blue", "yellow")]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    pixels = decode_image(data, LIMIT)
    assert pixels[0, 0, 2] > 200 and pixels[0, 0, 0] < 50


def test_pixel_limit_is_checked_before_decoding() -> None:
    with pytest.raises(ApiError) as error:
        decode_image(encode(Image.new("RGB", (100, 100)), "PNG"), max_pixels=9_999)
    assert (error.value.status, error.value.code) == (413, "image_too_large")


def test_resize_to_input_size() -> None:
    """Preprocessing is a separate step on the opened image: the decode itself keeps the upload's size."""
    data = encode(Image.new("RGB", (30, 10)), "PNG")
    assert decode_image(data, LIMIT).shape == (10, 30, 3)
    prepared = Preprocess(input_size=16)(open_image(data, LIMIT))
    assert prepared.pixels.shape == (16, 16, 3)
    assert prepared.geometry.original == (30, 10)


def test_rgba_keeps_alpha_in_png_and_webp_and_is_over_white_in_jpeg() -> None:
    pixels = np.zeros((4, 6, 4), dtype=np.uint8)  # transparent black
    for fmt in ("png", "webp"):
        image = Image.open(io.BytesIO(encode_image(pixels, fmt, 100)))
        assert image.mode == "RGBA" and np.asarray(image)[..., 3].max() == 0
    jpeg = Image.open(io.BytesIO(encode_image(pixels, "jpeg", 100)))
    assert jpeg.mode == "RGB" and np.asarray(jpeg).min() > 250


@pytest.mark.parametrize("fmt", ["jpeg", "png", "webp"])
def test_encode_round_trip(fmt: str) -> None:
    pixels = np.zeros((5, 7, 3), dtype=np.uint8)
    image = Image.open(io.BytesIO(encode_image(pixels, fmt, 90)))
    assert (image.format.lower(), image.size) == (fmt, (7, 5))


def test_choose_format() -> None:
    assert choose_format("png", "image/webp", "jpeg") == "png"
    assert choose_format(None, "image/webp;q=0.8, image/png", "jpeg") == "webp"
    assert choose_format(None, "application/json", "jpeg") == "jpeg"


def test_decoded_pixels_meet_the_same_limit_and_preprocessing() -> None:
    """A v2 UINT8 tensor is held to the pixel limit, must be HxWx3 uint8, and is resized and cropped as an upload
    would be."""
    pixels = np.zeros((30, 40, 3), dtype=np.uint8)
    with pytest.raises(ApiError) as caught:
        from_pixels(pixels, max_pixels=1000)
    assert caught.value.status == 413
    with pytest.raises(ApiError) as caught:
        from_pixels(np.zeros((0, 5, 3), dtype=np.uint8), LIMIT)
    assert caught.value.status == 400
    for wrong in (np.zeros((30, 40), np.uint8), np.zeros((30, 40, 4), np.uint8), np.zeros((30, 40, 3), np.float32)):
        with pytest.raises(ApiError) as caught:
            from_pixels(wrong, LIMIT)
        assert (caught.value.status, caught.value.code) == (400, "bad_pixels")
    prepared = Preprocess(resize_size=20, input_size=16)(from_pixels(pixels, LIMIT))
    assert prepared.pixels.shape == (16, 16, 3) and prepared.geometry.original == (40, 30)


def ico() -> bytes:
    return encode(Image.new("RGB", (16, 16)), "ICO")


def many_scans_jpeg() -> bytes:
    data = encode(Image.new("RGB", (8, 8)), "JPEG")
    return data[:-2] + b"\xff\xda" * 101 + data[-2:]


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"", 400, "empty_body"),
        (b"not an image at all", 400, "not_an_image"),
        (encode(Image.new("RGB", (64, 64)), "PNG")[:60], 400, "corrupt_image"),
        (ico(), 415, "unsupported_image_type"),
        (many_scans_jpeg(), 400, "corrupt_image"),
    ],
    ids=["empty", "garbage", "truncated", "ico", "jpeg-scans"],
)
def test_bad_bytes_are_a_clear_client_error(data: bytes, status: int, code: str) -> None:
    """Whatever the bytes, open_image answers an RGB image or an ApiError: never another exception."""
    with pytest.raises(ApiError) as caught:
        open_image(data, LIMIT)
    assert (caught.value.status, caught.value.code) == (status, code)
