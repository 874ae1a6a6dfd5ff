"""Uploads decoded in the inference worker, next to their batch: every `codec.EncodedImage` among a batch's items
(what `Request.encoded_image` returns in the front end) becomes a uint8 HxWx3 torch tensor on the worker's device,
resized and cropped as it asks, before the API's `batch` sees the items.

On a GPU where torchvision's GPU JPEG decoder imports (nvJPEG), the batch's JPEGs are decoded in one batched call on
the device, and resized and cropped there as tensors (antialiased, as torchvision resizes tensors). A JPEG that the
batched call fails on is decoded alone; one that is corrupt answers 400 alone, and its batch is unharmed. Every other
upload, and every upload on a CPU, is decoded by the strict CPU decoder the front ends use (codec.open_image), and
on a CPU resized and cropped by Pillow exactly as the front ends do.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from imgserve import codec
from imgserve.codec import EncodedImage
from imgserve.errors import ApiError, fault, from_exception
from imgserve.handoff import items

log = logging.getLogger(__name__)
BatchedJpegDecode = Callable[[list[bytes], torch.device], list[torch.Tensor]]  # JPEG bytes -> HxWx3 uint8 tensors


@functools.cache
def gpu_jpeg_decoder() -> BatchedJpegDecode | None:
    """torchvision's batched JPEG decode on a CUDA device, where torchvision imports; None elsewhere."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except Exception:  # not installed, or built for another torch (it fails to import beside a CPU torch)
        return None

    def decode(datas: list[bytes], device: torch.device) -> list[torch.Tensor]:
        encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in datas]
        images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device, apply_exif_orientation=True)
        return [image.permute(1, 2, 0) for image in images]

    return decode


def decode_items(
    values: list[Any], device: torch.device, batched: BatchedJpegDecode | None = None
) -> tuple[list[Any], dict[int, ApiError]]:
    """The items with each EncodedImage replaced by its pixels on `device`, and the ApiError of each item that an
    upload of failed to decode (by index; such an item stays as it was). `batched` decodes JPEGs together (default:
    on a CUDA device, the GPU decoder where there is one; on a CPU none)."""
    uploads = [(index, upload) for index, value in enumerate(values) for upload in items.leaves_of(value, EncodedImage)]
    if not uploads:
        return values, {}
    if batched is None and device.type == "cuda":
        batched = gpu_jpeg_decoder()
    pixels = _decoded([upload for _, upload in uploads], device, batched)
    failed = {index: found for (index, _), found in zip(uploads, pixels, strict=True) if isinstance(found, ApiError)}
    by_upload = {id(upload): found for (_, upload), found in zip(uploads, pixels, strict=True)}
    return [value if index in failed else _with(value, by_upload) for index, value in enumerate(values)], failed


def _decoded(
    uploads: list[EncodedImage], device: torch.device, batched: BatchedJpegDecode | None
) -> list[torch.Tensor | ApiError]:
    """Each upload's pixels on `device` (or its ApiError): JPEGs in one batched call where there is one."""
    found: list[torch.Tensor | ApiError | None] = [None] * len(uploads)
    jpegs = [i for i, upload in enumerate(uploads) if batched is not None and upload.format == "JPEG"]
    if batched is not None and jpegs:
        try:
            for i, image in zip(jpegs, batched([uploads[i].data for i in jpegs], device), strict=True):
                found[i] = cut_tensor(image, uploads[i])
        except Exception:
            log.info("the batched decode of %d JPEGs failed: each is decoded alone", len(jpegs), exc_info=True)
            found = [None] * len(uploads)
    pairs = zip(uploads, found, strict=True)
    return [_alone(upload, device, batched) if done is None else done for upload, done in pairs]


def _alone(upload: EncodedImage, device: torch.device, batched: BatchedJpegDecode | None) -> torch.Tensor | ApiError:
    """One upload decoded on its own: by the batched decoder where it takes it, else (or where it fails) by the
    strict CPU decoder, whose ApiError says what is wrong with a corrupt image."""
    if batched is not None and upload.format == "JPEG":
        try:
            return cut_tensor(batched([upload.data], device)[0], upload)
        except Exception:
            log.debug("the GPU decoder failed on one JPEG: decoded on the CPU", exc_info=True)
    try:
        at_least = min(upload.resize) if upload.resize else None  # a JPEG decoded no larger, as in the front end
        image = codec.open_image(upload.data, upload.width * upload.height, at_least)  # the header's size, checked
        if batched is None and device.type == "cpu":
            return torch.from_numpy(np.array(_cut_image(image, upload)))
        return cut_tensor(torch.from_numpy(np.array(image)).to(device), upload)
    except Exception as exc:
        error = from_exception(exc)
        if error is None:
            log.exception("decoding an upload failed")
            error = fault(exc, "decoding the image")
        return error


def _cut_image(image: Image.Image, upload: EncodedImage) -> Image.Image:
    """Resized and cropped by Pillow, as the front ends' preprocessing does."""
    if upload.resize is not None:
        image = image.resize(upload.resize, codec.FILTERS[upload.interpolation])
    if upload.crop is not None:
        left, top, width, height = upload.crop
        image = image.crop((left, top, left + width, top + height))
    return image


def cut_tensor(image: torch.Tensor, upload: EncodedImage) -> torch.Tensor:
    """A decoded uint8 HxWx3 tensor resized (antialiased, as torchvision resizes tensors, rounded back to uint8) and
    cropped as the upload asks, where it lies."""
    if upload.resize is not None:
        width, height = upload.resize
        mode = upload.interpolation
        shaped = image.permute(2, 0, 1).unsqueeze(0).float()
        if mode == "nearest":
            resized = torch.nn.functional.interpolate(shaped, size=(height, width), mode=mode)
        else:
            resized = torch.nn.functional.interpolate(
                shaped, size=(height, width), mode=mode, align_corners=False, antialias=True
            )
        image = resized.round_().clamp_(0, 255).to(torch.uint8)[0].permute(1, 2, 0)
    if upload.crop is not None:
        left, top, width, height = upload.crop
        image = image[top : top + height, left : left + width]
    return image


def _with(value: Any, pixels: dict[int, Any]) -> Any:
    """The item with each EncodedImage replaced by its pixels."""
    if isinstance(value, EncodedImage):
        return pixels[id(value)]
    if isinstance(value, list | tuple):
        return type(value)(_with(item, pixels) for item in value)
    if isinstance(value, dict):
        return {key: _with(item, pixels) for key, item in value.items()}
    return value
