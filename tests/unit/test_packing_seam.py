"""The seam over Inductor's passes (imgserve/models/packing.py): the torch internals the weight packing uses are still
there as written against, and a moved one is named in one line."""

from __future__ import annotations

import pytest
import torch

from imgserve.models import packing
from imgserve.pins import pinned_problems


def test_the_installed_torch_has_every_internal_the_weight_packing_uses() -> None:
    problems = pinned_problems(packing.PINNED) + packing.schema_problems()
    assert not problems, "torch moved what models/packing.py uses:\n" + "\n".join(problems)


def test_an_operator_whose_arguments_moved_is_named_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = packing.SCHEMAS[packing.REORDER]
    swapped = ("self", "stride", "padding", "dilation", "groups", "input_size")
    monkeypatch.setitem(packing.SCHEMAS, packing.REORDER, swapped)
    assert packing.schema_problems() == [f"{packing.REORDER}: arguments are {installed}, not {swapped}"]


class Convolutions(torch.nn.Module):
    """Two of the convolutions freezing leaves: one on a weight held as a constant, one on a weight the graph
    computes (left plain by the pass)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.held = torch.nn.Buffer(torch.randn(16, 8, 3, 3).contiguous(memory_format=torch.channels_last))
        self.scaled = torch.nn.Buffer(torch.randn(16, 16, 1, 1))

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = packing.CONVOLUTION(x, self.held, None, [1, 1], [1, 1], [1, 1], 1, "none", [], "")
        return packing.CONVOLUTION(y, self.scaled * scale, None, [0, 0], [1, 1], [1, 1], 1, "none", [], "")


def test_a_held_weight_is_packed_for_onednn_and_the_answers_stay_the_same() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    module = torch.fx.symbolic_trace(Convolutions())
    pixels, scale = torch.rand(3, 8, 12, 12).contiguous(memory_format=torch.channels_last), torch.tensor(2.0)
    # The input's shape on each node, as Inductor's graphs carry it.
    FakeTensorProp(module, FakeTensorMode(allow_non_fake_inputs=True)).propagate(pixels, scale)
    computed = list(module.graph.find_nodes(op="call_function", target=packing.CONVOLUTION))[1].args[1]
    with torch.inference_mode():
        before = module(pixels, scale)
        packing.PackWeights(batches=(1, 2, 3), threads=(1,))(module.graph)
        module.recompile()
        after = module(pixels, scale)
    weights = [node.args[1] for node in module.graph.find_nodes(op="call_function", target=packing.CONVOLUTION)]
    assert weights[0].op == "get_attr" and getattr(module, weights[0].target).is_mkldnn
    assert weights[1] is computed  # a weight the graph computes: left as it was
    torch.testing.assert_close(after, before)


class OneConvolution(torch.nn.Module):
    """One convolution on a held weight of 3 input channels."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Buffer(torch.randn(16, 3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packing.CONVOLUTION(x, self.weight, None, [1, 1], [1, 1], [1, 1], 1, "none", [], "")


@pytest.mark.parametrize(
    "known",
    [torch.empty(3, 8, 12, 12), None],
    ids=["weights for 3 channels on an input of 8: oneDNN refuses them", "the input's shape not in the graph"],
)
def test_a_weight_that_cannot_be_packed_is_left_plain_and_fails_no_compile(known: torch.Tensor | None) -> None:
    module = torch.fx.symbolic_trace(OneConvolution())
    (pixels,) = module.graph.find_nodes(op="placeholder")
    if known is not None:
        pixels.meta["val"] = known  # the only shape the pass reads
    (convolution,) = module.graph.find_nodes(op="call_function", target=packing.CONVOLUTION)
    weight = convolution.args[1]
    packing.PackWeights(batches=(1,), threads=(1,))(module.graph)
    assert convolution.args[1] is weight and not module.weight.is_mkldnn
