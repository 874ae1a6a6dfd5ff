"""Convolution weights packed for oneDNN in advance, inside a frozen package: the one seam over Inductor's graph passes.

Inductor's freezing packs a convolution's weights into oneDNN's blocked layout only for a graph of a fixed input size;
with a dynamic batch it leaves them plain, and oneDNN then copies each into its layout at every call (about 28 ms a
call for a ResNet-50's 53 convolutions on one core, whatever the batch: docs/benchmarks.md). `PackWeights`, run as
Inductor's first pass on the frozen graph, packs a convolution's weights where oneDNN wants one layout for every batch
size and thread count the worker runs it at, and leaves the others plain: oneDNN copies plain weights into a layout
quickly, but weights packed in another blocked layout slowly (its generic reorder, about 11 ms for a 1024x256 1x1
convolution's, where a 1-thread call wanted 48-row blocks and a 2-thread batch of one 64). Answers are the same either
way. The packed weights go into the package as oneDNN tensors.

It uses torch names that are not public API: the pass hook, and three mkldnn operators whose arguments it reads by
position. `PINNED` and `schema_problems` name them, and a unit test fails readably when an upgrade moves one.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from imgserve.pins import Pinned

CONVOLUTION = torch.ops.mkldnn._convolution_pointwise.default  # what freezing turns a CPU convolution into
REORDER = torch.ops.mkldnn._reorder_convolution_weight.default  # packs a weight into oneDNN's layout for a shape
LAYOUT = torch.ops.mkldnn._get_mkldnn_serialized_md.default  # a packed tensor's layout, as bytes
# The arguments each operator is called with here, by position, as its schema names them.
SCHEMAS = {
    CONVOLUTION: ("X", "W", "B", "padding", "stride", "dilation", "groups", "attr", "scalars", "algorithm"),
    REORDER: ("self", "padding", "stride", "dilation", "groups", "input_size"),
    LAYOUT: ("mkldnn_tensor",),
}
PINNED = (
    Pinned("torch._inductor.config", "post_grad_custom_pre_pass"),
    Pinned("torch._inductor.custom_graph_pass", "CustomGraphPass.uuid", ("self",)),
)
CONFIG = "post_grad_custom_pre_pass"  # the Inductor setting that runs a pass first on the (frozen) post-grad graph
VERSION = "imgserve.models.packing.PackWeights/2"  # changes with what the pass does


def schema_problems() -> list[str]:
    """What the installed torch's operators no longer take as SCHEMAS says, one line each (empty: all as pinned)."""
    found = {op: tuple(argument.name for argument in op._schema.arguments) for op in SCHEMAS}
    return [f"{op}: arguments are {found[op]}, not {names}" for op, names in SCHEMAS.items() if found[op] != names]


class PackWeights(CustomGraphPass):
    """Replaces each frozen convolution's plain weights by the same weights packed for oneDNN, where the input's
    channels and image size are fixed and oneDNN wants one layout for every batch of `batches` on every count of
    `threads` (a weight computed in the graph, a size that varies or is not known, or a layout that varies is left as
    it is)."""

    def __init__(self, batches: Sequence[int], threads: Sequence[int]) -> None:
        self.batches, self.threads = tuple(batches), tuple(threads)

    def __call__(self, graph: torch.fx.Graph) -> None:
        module = graph.owning_module
        assert module is not None, "Inductor passes a graph of a GraphModule"
        for index, node in enumerate(graph.find_nodes(op="call_function", target=CONVOLUTION)):
            pixels, weight, _, *shape_of_call = node.args[:7]
            assert isinstance(pixels, torch.fx.Node) and isinstance(weight, torch.fx.Node)
            known = pixels.meta.get("val")  # the input's shape, where the graph carries it
            shape = known.shape[1:] if isinstance(known, torch.Tensor) else None
            if weight.op != "get_attr" or shape is None or not all(isinstance(size, int) for size in shape):
                continue
            plain = operator.attrgetter(str(weight.target))(module)  # a dotted path: a weight not folded
            packed = self._one_layout(plain, shape_of_call, [int(size) for size in shape])
            if packed is None:
                continue
            name = f"_imgserve_packed_{index}"
            module.register_buffer(name, packed)
            with graph.inserting_before(node):
                replacement = graph.get_attr(name)
            replacement.meta.update(weight.meta)
            node.update_arg(1, replacement)

    def _one_layout(self, plain: torch.Tensor, call: list[Any], shape: list[int]) -> torch.Tensor | None:
        """The weights packed, if oneDNN wants the same layout for them at every batch and thread count; else None
        (also where oneDNN cannot pack them ahead: packing is a speed-up, never a reason for a compile to fail)."""
        own_threads, layouts = torch.get_num_threads(), {}
        try:
            for count in self.threads:
                torch.set_num_threads(count)  # oneDNN picks its kernel, and so its layout, for the thread count too
                for batch in self.batches:
                    packed = REORDER(plain, *call, [batch, *shape])
                    layouts[bytes(LAYOUT(packed).tolist())] = packed
        except RuntimeError:
            return None
        finally:
            torch.set_num_threads(own_threads)
        return next(iter(layouts.values())) if len(layouts) == 1 else None

    def uuid(self) -> str:
        """Names the pass in Inductor's cache keys: what it does, and for which batches and thread counts."""
        return f"{VERSION}:{self.batches}:{self.threads}"
