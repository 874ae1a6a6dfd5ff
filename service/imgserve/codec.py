"""Bytes <-> image: strict decoding of untrusted uploads and encoding of answers, for every process and user API.

Whatever the bytes, decoding answers pixels or an ApiError (400, 413, 415), with the CPU it may cost bounded before
any decoding starts: the pixel count and a JPEG's scans are checked from the header. A caller that will scale the
image down says how small it may be, and a JPEG is then decoded at a reduced scale (libjpeg's DCT scaling, through
Pillow's `draft`): a quarter of a 1024x1024 upload's pixels for ImageNet preprocessing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from imgserve.errors import ApiError

# We check the pixel count ourselves (413), before Pillow decodes anything.
Image.MAX_IMAGE_PIXELS = None

ACCEPTED_FORMATS = {"JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "MPO"}
# A progressive JPEG's decode time grows with its scans (libjpeg has no limit); real encoders write about ten.
MAX_JPEG_SCANS = 100
OUTPUT_TYPES = {"jpeg": "image/jpeg", "png": "image/png", "webp": "image/webp"}
FILTERS = {  # the resizes' interpolations, by name: Pillow's filter for each
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}
INTERPOLATIONS = tuple(FILTERS)
FULL_SIZE = "imgserve.full_size"  # in a reduced image's `info`: the upload's own (upright) width and height
TURNED = (5, 6, 7, 8)  # the EXIF orientations that swap width and height


@dataclass(frozen=True)
class EncodedImage:
    """An upload to decode in the inference worker, next to its batch, instead of in the front end: its bytes, its
    format and its upright size as its header says (read and checked in the front end: `read_header`), and what the
    worker makes of it after decoding: resized to `resize` (width, height) with `interpolation`, then cropped to
    `crop` (left, top, width, height of the resized image). The worker hands the API's `batch` a uint8 HxWx3 torch
    tensor on the device instead (imgserve.worker.decoding)."""

    data: Any  # the bytes (in the worker's hands; a reference to the request's slot on the way)
    format: str
    width: int
    height: int
    resize: tuple[int, int] | None = None
    crop: tuple[int, int, int, int] | None = None
    interpolation: str = "bilinear"

    @property
    def size(self) -> tuple[int, int]:
        """The image's size once the worker has decoded, resized and cropped it: (width, height)."""
        if self.crop is not None:
            return self.crop[2], self.crop[3]
        return self.resize or (self.width, self.height)

    def cut(
        self,
        resize: tuple[int, int] | None = None,
        crop: tuple[int, int, int, int] | None = None,
        interpolation: str = "bilinear",
    ) -> EncodedImage:
        """The same upload, to be resized and cropped in the worker (a resize or crop that changes nothing is
        dropped); ValueError for a crop outside the resized image or an interpolation not in INTERPOLATIONS."""
        width, height = resize or (self.width, self.height)
        if crop is not None:
            left, top, crop_width, crop_height = crop
            if min(crop) < 0 or left + crop_width > width or top + crop_height > height or 0 in crop[2:]:
                raise ValueError(f"the crop {crop} is not inside the {width}x{height} image")
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation is one of {', '.join(INTERPOLATIONS)}")
        kept_resize = resize if resize is not None and resize != (self.width, self.height) else None
        kept_crop = crop if crop is not None and crop != (0, 0, width, height) else None
        return replace(self, resize=kept_resize, crop=kept_crop, interpolation=interpolation)


def read_header(data: bytes, max_pixels: int) -> EncodedImage:
    """Untrusted image bytes -> the upload to decode in the worker, after the checks `open_image` makes before it
    decodes (an image Pillow reads, an accepted format, the pixel limit, a JPEG's scans): the same 400, 413 and 415,
    with nothing decoded. Its size is upright (EXIF orientation applied), as the decode makes it."""
    image = _opened(data, max_pixels)
    try:
        turned = image.getexif().get(ExifTags.Base.Orientation) in TURNED
    except Exception as exc:  # a broken EXIF block, as open_image's transpose would meet it
        raise _corrupt(exc) from None
    width, height = image.size
    return EncodedImage(data, image.format or "", *((height, width) if turned else (width, height)))


def open_image(data: bytes, max_pixels: int, at_least: int | None = None) -> Image.Image:
    """Untrusted image bytes -> an RGB Pillow image: upright, first frame, alpha over white, 16-bit scaled.

    Pillow's plugins raise nearly every exception type on crafted input, so any of them means a corrupt image. Only
    the first frame is decoded, and its pixel count is checked (and JPEG scans counted) before decoding. With
    `at_least`, a JPEG is decoded at the smallest scale (1/2, 1/4, 1/8) whose sides are both still at least that,
    and `full_size` says the upload's own size.
    """
    image = _opened(data, max_pixels)
    full = _reduce(image, at_least) if at_least else None
    try:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)  # a copy would cost as much as a third of the decode
        rgb = _to_rgb(image)
    except Exception as exc:
        raise _corrupt(exc) from None
    if full is not None:
        rgb.info[FULL_SIZE] = full
    return rgb


def _opened(data: bytes, max_pixels: int) -> Image.Image:
    """The image opened from its header, not decoded: an accepted format, under the pixel limit and the scans."""
    if not data:
        raise ApiError(400, "empty_body", "the request carried no image bytes")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ApiError(400, "not_an_image", "the body is not an image Pillow can read") from None
    except Exception as exc:  # a known format whose header is broken
        raise _corrupt(exc) from None
    if image.format not in ACCEPTED_FORMATS:
        raise ApiError(415, "unsupported_image_type", f"{image.format} images are not supported")
    check_size(*image.size, max_pixels)
    if image.format in ("JPEG", "MPO") and data.count(b"\xff\xda") > MAX_JPEG_SCANS:
        raise ApiError(400, "corrupt_image", f"the JPEG has more than {MAX_JPEG_SCANS} scans")
    return image


def full_size(image: Image.Image) -> tuple[int, int]:
    """The upload's own width and height (upright): the image's, unless `open_image` decoded it at a reduced scale."""
    size: tuple[int, int] = image.info.get(FULL_SIZE, image.size)
    return size


def _reduce(image: Image.Image, at_least: int) -> tuple[int, int] | None:
    """Have a JPEG decoded at the smallest DCT scale whose sides are both at least `at_least`; the full upright size
    when that is smaller than the image, else None."""
    width, height = image.size
    if image.format not in ("JPEG", "MPO") or min(width, height) < 2 * at_least:  # no smaller scale would do
        return None
    image.draft(None, (at_least, at_least))
    if image.size == (width, height):
        return None
    return (height, width) if image.getexif().get(ExifTags.Base.Orientation) in TURNED else (width, height)


def decode_image(data: bytes, max_pixels: int) -> np.ndarray:
    """Untrusted image bytes -> uint8 HxWx3 RGB pixels (`open_image`), read-only."""
    return np.asarray(open_image(data, max_pixels))


def from_pixels(pixels: np.ndarray, max_pixels: int) -> Image.Image:
    """Already decoded uint8 HxWx3 RGB pixels (a v2 UINT8 tensor) -> a Pillow image, under the same pixel limit."""
    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8:
        raise ApiError(400, "bad_pixels", f"pixels are uint8 HxWx3 RGB (got {pixels.dtype} {list(pixels.shape)})")
    height, width = pixels.shape[:2]
    check_size(width, height, max_pixels)
    return Image.fromarray(np.ascontiguousarray(pixels))


def check_size(width: int, height: int, max_pixels: int) -> None:
    """413 over the pixel limit, 400 for an image without pixels."""
    if width * height > max_pixels:
        raise ApiError(413, "image_too_large", f"{width}x{height} is over the limit of {max_pixels} pixels")
    if width == 0 or height == 0:
        raise ApiError(400, "empty_image", f"a {width}x{height} image has no pixels")


def _corrupt(exc: Exception) -> ApiError:
    if isinstance(exc, Image.DecompressionBombError):
        return ApiError(413, "image_too_large", str(exc))
    return ApiError(400, "corrupt_image", f"the image could not be decoded: {type(exc).__name__}: {exc}"[:300])


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        wide = np.asarray(image, dtype=np.float32)
        scale = 255.0 / 65535.0 if wide.max(initial=0) > 255 else 1.0
        image = Image.fromarray(np.clip(wide * scale, 0, 255).astype(np.uint8), mode="L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        return _over_white(image.convert("RGBA"))
    return image if image.mode == "RGB" else image.convert("RGB")


def _over_white(rgba: Image.Image) -> Image.Image:
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def encode_image(pixels: np.ndarray, fmt: str, quality: int) -> bytes:
    """uint8 HxWxC -> JPEG/PNG/WebP bytes; RGBA keeps its alpha in PNG/WebP, JPEG gets it composited over white."""
    image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
    if image.mode == "RGBA" and fmt == "jpeg":
        image = _over_white(image)
    return save(image, fmt, quality)


def save(image: Image.Image, fmt: str, quality: int = 90) -> bytes:
    """A Pillow image -> JPEG/PNG/WebP bytes (PNG at fast compression)."""
    buffer = io.BytesIO()
    options = {"quality": quality} if fmt in ("jpeg", "webp") else {"compress_level": 1}
    image.save(buffer, format=fmt.upper(), **options)
    return buffer.getvalue()


def choose_format(requested: str | None, accept: str, default: str) -> str:
    """Output format from ?format=, else the first image type the Accept header names, else the default."""
    if requested:
        return requested
    for part in accept.split(","):
        media = part.split(";")[0].strip().lower()
        for fmt, media_type in OUTPUT_TYPES.items():
            if media == media_type:
                return fmt
    return default
