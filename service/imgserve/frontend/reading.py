"""Reading an HTTP call into the `Request` that an API's `decode_request` gets: the body (already received and held
to the limits by admission), its media type, the query and headers, and a multipart or urlencoded body's files and
fields. A multipart body that is malformed or cut short is 400, before any hook sees it."""

from __future__ import annotations

from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as StarletteRequest

from imgserve.api import FORM_TYPES, Request, UploadedFile
from imgserve.errors import ApiError

MAX_FILES = 16
MAX_FIELDS = 64


async def read_request(request: StarletteRequest, max_image_pixels: int) -> Request:
    """The call as a Request (protocol "http")."""
    body = await request.body()
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    files: list[UploadedFile] = []
    form: dict[str, str] = {}
    if media in FORM_TYPES:
        if media == "multipart/form-data":
            _check_multipart_closed(request.headers["content-type"], body)
        try:
            parsed = await request.form(max_files=MAX_FILES, max_fields=MAX_FIELDS)
        except StarletteHTTPException as exc:
            raise ApiError(400, "bad_multipart", str(exc.detail)) from None
        for name, value in parsed.multi_items():
            if isinstance(value, UploadFile):
                files.append(UploadedFile(name, value.filename, value.content_type, await value.read()))
            else:
                form[name] = value
    return Request(
        protocol="http",
        body=body,
        content_type=media,
        query=request.query_params,
        headers=request.headers,
        files=files,
        form=form,
        max_image_pixels=max_image_pixels,
    )


def _check_multipart_closed(content_type: str, body: bytes) -> None:
    """A body cut before its closing boundary is malformed (Starlette would parse it as a form without the file)."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary", b"")
    if not boundary or body.rfind(b"--" + boundary + b"--") < 0:
        raise ApiError(400, "bad_multipart", "the multipart body has no boundary or is not closed by it")


def call_size(request: Request) -> int:
    """The bytes a call carries: what decides whether its hooks run on the event loop or a codec thread."""
    return len(request.body)
