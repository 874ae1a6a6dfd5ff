"""Preprocessing is exactly torchvision's Resize(N) + CenterCrop(S) + Normalize, written here independently."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from reference import IMAGENET_MEAN, IMAGENET_STD, photo, to_tensor, torchvision_by_hand
from toy_models import Recording

from imgserve.api import Request
from imgserve.codec import full_size, open_image
from imgserve.config import Settings
from imgserve.models.builtin import LocalKinds, ModelAPI
from imgserve.models.preprocess import Geometry, Prepared, Preprocess
from imgserve.models.synthetic import clean_image
from imgserve.testing import InProcess


def prepare(data: bytes, preprocess: Preprocess) -> Prepared:
    """What the front end makes of an upload: the strict decode, then the resize and crop."""
    return preprocess(open_image(data, 10**8))


@pytest.mark.parametrize(("width", "height"), [(500, 375), (333, 501), (259, 256), (300, 398), (1001, 257), (256, 256)])
def test_imagenet_preset_is_resize_256_crop_224_normalize(width: int, height: int) -> None:
    settings = Settings(preprocess="imagenet")
    data = photo(width, height)
    model = Recording()
    api = ModelAPI(settings, LocalKinds(), pad=False)
    api.model_loader = lambda device: model
    worker = InProcess(api).setup()
    # What the model is given: the built-in API's decode in the front end, then its batch in the worker.
    worker.predict([api.decode_request(Request(body=data, content_type="image/png"))])
    tensor = model.seen[-1][0]
    expected = torchvision_by_hand(data, 256, 224, Image.Resampling.BILINEAR)
    assert tensor.shape == (3, 224, 224)
    assert torch.equal(tensor, torch.from_numpy(expected))  # bit for bit


def test_explicit_settings_override_the_preset_and_parse_as_flags_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IMGSERVE_STD", "0.5, 0.5,0.5")
    settings = Settings(preprocess="imagenet", resize_size="232", interpolation="bicubic")
    assert (settings.resize_size, settings.input_size, settings.interpolation) == (232, 224, "bicubic")
    assert settings.mean == (0.485, 0.456, 0.406) and settings.std == (0.5, 0.5, 0.5)
    data = photo(300, 240)
    prepared = prepare(data, Preprocess.from_settings(settings))
    by_hand = torchvision_by_hand(data, 232, 224, Image.Resampling.BICUBIC) * IMAGENET_STD[:, None, None]
    torch.testing.assert_close(to_tensor(prepared.pixels), torch.from_numpy(by_hand + IMAGENET_MEAN[:, None, None]))
    for bad in ({"mean": "1,2"}, {"std": "1,0,1"}, {"resize_size": 100, "input_size": 224}):
        with pytest.raises(ValueError):
            Settings(**bad)


def test_geometry_maps_model_input_points_back_to_the_upload() -> None:
    prepared = prepare(photo(500, 375), Preprocess(resize_size=256, input_size=224))
    assert prepared.geometry == Geometry(original=(500, 375), resized=(341, 256), crop=(58, 16, 224, 224))
    assert prepared.geometry.to_original(0, 0) == pytest.approx((58 * 500 / 341, 16 * 375 / 256))
    squashed = Preprocess(input_size=100)(Image.new("RGB", (400, 50)))
    assert squashed.geometry.to_original(100, 100) == (400, 50)
    shorter_side = Preprocess(resize_size=20)(Image.new("RGB", (40, 80)))
    assert shorter_side.pixels.shape == (40, 20, 3) and shorter_side.geometry.crop == (0, 0, 20, 40)


REDUCED_TOLERANCE = 1.0  # mean |difference| of the model's uint8 input from a full decode's (docs/models.md)


def photo_jpeg(width: int, height: int, **options: object) -> bytes:
    """A photo-like JPEG (gradient, shapes, soft texture) at quality 90."""
    pixels = clean_image(np.random.default_rng(width + height), height, width)
    buffer = io.BytesIO()
    Image.fromarray((pixels * 255).round().astype(np.uint8)).save(buffer, format="JPEG", quality=90, **options)
    return buffer.getvalue()


@pytest.mark.parametrize(("width", "height", "decoded"), [(1024, 1024, (256, 256)), (1920, 1080, (480, 270))])
def test_a_large_jpeg_is_decoded_no_larger_than_imagenet_preprocessing_needs(
    width: int, height: int, decoded: tuple[int, int]
) -> None:
    """libjpeg's DCT scaling decodes a quarter of each side, still at least the 256 the resize needs; the model's
    input is within the stated tolerance of a full decode's, and its geometry is the upload's own."""
    data = photo_jpeg(width, height)
    reduced = open_image(data, 10**8, at_least=256)
    assert (reduced.size, full_size(reduced)) == (decoded, (width, height))
    api = ModelAPI(Settings(preprocess="imagenet"), LocalKinds(), pad=False)
    request = Request(body=data, content_type="image/jpeg")
    served = api.decode_request(request)
    full = prepare(data, Preprocess(256, 224))
    assert served.shape == full.pixels.shape == (224, 224, 3)
    assert request.context["geometry"] == full.geometry
    difference = np.abs(served.astype(np.float32) - full.pixels.astype(np.float32))
    assert 0 < difference.mean() <= REDUCED_TOLERANCE, difference.mean()


def test_a_rotated_jpeg_keeps_its_upright_full_size() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 1920x1080, shown rotated a quarter turn: 1080x1920
    reduced = open_image(photo_jpeg(1920, 1080, exif=exif), 10**8, at_least=256)
    assert (reduced.size, full_size(reduced)) == ((270, 480), (1080, 1920))


@pytest.mark.parametrize(
    ("data", "at_least"),
    [(photo(1024, 1024), 256), (photo_jpeg(500, 375), 256), (photo_jpeg(1024, 1024), 600)],
    ids=["png", "no smaller scale fits 500x375", "1/2 would be under 600"],
)
def test_an_image_no_scale_can_reduce_is_decoded_whole(data: bytes, at_least: int) -> None:
    image = open_image(data, 10**8, at_least=at_least)
    assert image.size == full_size(image) == Image.open(io.BytesIO(data)).size
