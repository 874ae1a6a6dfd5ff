"""A raw binary request's body as the declared input (extension_binary_data.md, "Raw Binary Request"), and the
metadata's platform for each model format."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from torch import nn

from imgserve.errors import ApiError
from imgserve.frontend.v2.model import platform
from imgserve.frontend.v2.tensors import from_raw


def test_a_bytes_input_is_one_element_as_sent_or_serialized() -> None:
    for body in (b"\x89PNG...", struct.pack("<I", 7) + b"\x89PNG..."):
        tensor = from_raw("image", "BYTES", (1,), body)
        assert (tensor.shape, tensor.data) == ([1, 1], [b"\x89PNG..."])


def test_a_numeric_input_takes_its_one_variable_dimension_from_the_size() -> None:
    values = np.arange(12, dtype="<f4")
    tensor = from_raw("values", "FP32", (-1, 3), values.tobytes())
    assert tensor.shape == [1, 4, 3] and np.array_equal(tensor.data.reshape(-1), values)
    assert from_raw("pixels", "UINT8", (2, 2), bytes(4)).shape == [1, 2, 2]


@pytest.mark.parametrize(
    ("dims", "size"),
    [((-1, -1, 3), 12), ((-1, 3), 10), ((2, 2), 3), ((-1, 0), 0)],
    ids=["two variable dimensions", "not a whole number of rows", "fixed shape, wrong size", "empty rows"],
)
def test_a_body_that_cannot_say_its_shape_is_a_400(dims: tuple[int, ...], size: int) -> None:
    with pytest.raises(ApiError) as caught:
        from_raw("values", "UINT8", dims, bytes(size))
    assert caught.value.status == 400


def test_the_platform_names_the_format_not_the_suffix(tmp_path) -> None:
    scripted, exported, weights = tmp_path / "scripted.pt", tmp_path / "exported.pt2", tmp_path / "weights.pt"
    model = nn.Conv2d(3, 3, 1)
    torch.jit.save(torch.jit.script(model), str(scripted))
    torch.save(model.state_dict(), weights)
    exported.write_bytes(b"")  # the suffix says torch.export: the loader refuses anything else under it
    assert platform(str(scripted)) == "pytorch_torchscript"
    assert platform(str(exported)) == "pytorch_exportedprogram"
    assert platform(str(weights)) == platform("builtin:denoiser") == "pytorch_eager"
