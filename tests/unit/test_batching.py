"""Memory-bounded batching on the CPU, through the built-in API's hooks as a worker runs them: chunk planning, results
equal to one-by-one runs, padding, OOM split, a failing item alone, channels_last, the conversion threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from toy_models import Recording

from imgserve.config import Settings
from imgserve.errors import ApiError
from imgserve.models.builtin import LocalKinds, ModelAPI
from imgserve.models.denoiser import build_denoiser
from imgserve.models.loader import ModelLoadError
from imgserve.models.outputs import to_pixels
from imgserve.startup import time_batch
from imgserve.testing import InProcess
from imgserve.worker.batching import Shape, plan_chunks

NHWC = torch.channels_last
SIZES = [(32, 40), (32, 40), (24, 24), (64, 48), (24, 24), (40, 32)]


def built_in(pad: bool, model: torch.nn.Module | None = None, **settings: object) -> InProcess:
    """The built-in API around `model` (the denoiser by default), set up in this process."""
    api = ModelAPI(Settings(**settings), LocalKinds(), pad=pad)
    module = model or build_denoiser()
    api.model_loader = lambda device: module
    return InProcess(api).setup()


def images() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]


def close(a: np.ndarray, b: np.ndarray, atol: int = 1) -> None:
    """uint8 results equal up to `atol` levels (one rounding step)."""
    assert a.shape == b.shape
    assert np.abs(a.astype(int) - b.astype(int)).max(initial=0) <= atol


def test_chunks_hold_the_budget_and_group_same_shapes_or_pad_close_ones() -> None:
    shapes = [Shape.of(image) for image in images()]
    for chunk in plan_chunks(shapes, budget=12_000, group_by_shape=False):
        height = max(SIZES[i][0] for i in chunk)
        width = max(SIZES[i][1] for i in chunk)
        assert len(chunk) == 1 or len(chunk) * height * width * 3 <= 12_000
    same = plan_chunks(shapes, budget=10**9, group_by_shape=True)
    assert sorted(sorted(c) for c in same) == [[0, 1], [2, 4], [3], [5]]
    padded = plan_chunks(shapes, budget=10**9, group_by_shape=False)
    assert sorted(i for chunk in padded for i in chunk) == list(range(len(SIZES)))
    assert len(padded) < len(same)  # close sizes share a padded chunk


def test_items_that_are_not_images_group_by_their_arrays_shapes_and_the_budget() -> None:
    items = [{"a": np.zeros(4), "t": 0.5}, {"a": np.zeros(4), "t": 0.1}, {"a": np.zeros(5), "t": 0.5}, "text"]
    shapes = [Shape.of(item) for item in items]
    assert plan_chunks(shapes, budget=100, group_by_shape=True) == [[0, 1], [2], [3]]
    assert plan_chunks(shapes, budget=7, group_by_shape=True) == [[0], [1], [2], [3]]


def in_process(model: torch.nn.Module, image: np.ndarray) -> np.ndarray:
    """The same model run by hand on one image: float NCHW in [0, 1] -> uint8 HxWx3."""
    tensor = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255
    with torch.inference_mode():
        output = model(tensor)[0]
    return output.clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def test_same_size_batches_equal_single_runs_and_the_model_run_by_hand() -> None:
    batch = built_in(pad=False).predict(images())
    single = built_in(pad=False)
    for image, output in zip(images(), batch, strict=True):
        assert output.dtype == np.uint8 and output.shape == image.shape
        close(output, single.predict([image])[0])
        close(output, in_process(build_denoiser(), image))


def test_padded_batches_match_away_from_the_padded_edges() -> None:
    batch = built_in(pad=True).predict(images())
    single = built_in(pad=False)
    for image, output in zip(images(), batch, strict=True):
        alone = single.predict([image])[0]
        assert output.shape == image.shape
        margin = 6  # the 5-layer model's receptive-field radius, plus one
        close(output[:-margin, :-margin], alone[:-margin, :-margin])


def test_a_padded_chunk_repeats_each_image_edge_into_the_padding() -> None:
    model = Recording()
    small = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    large = np.zeros((4, 5, 3), dtype=np.uint8)
    outputs = built_in(pad=True, model=model).predict([small, large])
    padded = (model.seen[-1][0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert padded.shape == (4, 5, 3)
    assert (padded[:2, :3] == small).all()
    assert (padded[2:, :3] == small[-1]).all() and (padded[:, 3:] == padded[:, 2:3]).all()
    assert (outputs[0] == small).all() and outputs[1].shape == (4, 5, 3)


class OutOfMemoryAboveOne(torch.nn.Module):
    """SIMULATED out-of-memory on the CPU: raises torch.OutOfMemoryError for batches of more than one image."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("simulated")
        return x


def test_out_of_memory_splits_down_to_single_images() -> None:
    splits: list[int] = []
    running = built_in(pad=True, model=OutOfMemoryAboveOne())
    running.runner.on_oom = lambda: splits.append(1)
    outputs = running.predict(images())
    assert all(isinstance(o, np.ndarray) for o in outputs)
    assert len(splits) >= 3


def test_the_example_request_is_measured_per_element() -> None:
    running = built_in(pad=False)
    item = running.api.decode_request(running.api.example_request())
    measured = running.runner.measure(item)
    assert measured.bytes_per_element >= 2 * 4  # at least the fp32 input and output
    assert measured.example_elements == item.size and running.runner.bytes_per_element == measured.bytes_per_element


def test_a_failing_image_fails_alone() -> None:
    class FailsOnTall(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-2] == 64:
                raise ValueError("too tall")
            return x

    outputs = built_in(pad=True, model=FailsOnTall()).predict(images())
    failed = [i for i, o in enumerate(outputs) if isinstance(o, ApiError)]
    assert failed == [3] and outputs[3].status == 500 and "too tall" in outputs[3].message


def test_channels_last_gives_the_same_outputs_in_nhwc_memory() -> None:
    model = build_denoiser()
    seen: list[bool] = []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous(memory_format=NHWC)))
    for image, output in zip(images(), built_in(pad=False, model=model).predict(images()), strict=True):
        close(output, in_process(build_denoiser(), image))
    assert seen and all(seen)


def test_output_pixels_are_the_same_whichever_memory_layout_and_cast_made_them() -> None:
    """to_pixels casts a channels-last output with numpy and a strided one with torch: the same uint8 pixels, exactly
    those of clamp, x255, round, cast, and laid out NHWC."""
    values = torch.rand(2, 3, 37, 53, generator=torch.Generator().manual_seed(0)) * 1.4 - 0.2
    expected = values.clamp(0, 1).mul(255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for layout in (torch.contiguous_format, NHWC):
        pixels = to_pixels(values.clone().contiguous(memory_format=layout))
        assert pixels.dtype == np.uint8 and pixels.flags.c_contiguous
        assert (pixels == expected).all()


def test_a_model_that_refuses_channels_last_falls_back_to_nchw_at_warm_up() -> None:
    class ViewsItsInput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x).view(x.shape[0], -1).view(x.shape)  # flattening with .view needs NCHW memory

    running = built_in(pad=False, model=ViewsItsInput())
    assert not running.api.runner.channels_last
    outputs = running.predict(images())
    assert [o.shape for o in outputs] == [i.shape for i in images()]


def test_a_model_answering_with_a_broadcast_view_still_gets_its_pixels() -> None:
    class Grey(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean(dim=(1, 2, 3), keepdim=True).expand(-1, 3, x.shape[2], x.shape[3])

    image = images()[0]
    [output] = built_in(pad=False, model=Grey()).predict([image])
    assert output.shape == image.shape and (output == output[0, 0, 0]).all()
    assert abs(int(output[0, 0, 0]) - round(float(image.mean()))) <= 1


def test_the_probe_times_the_batch_work_and_the_predict_call() -> None:
    running = built_in(pad=False)
    count, cpu_s, device_s = time_batch(running.runner, [np.zeros((32, 32, 3), dtype=np.uint8)] * 2)
    assert count == 2 and device_s > 0 and cpu_s >= 0


def test_a_small_cpu_batch_is_converted_on_one_thread_and_the_model_runs_on_all_of_them(monkeypatch) -> None:
    """The uint8 <-> float passes of a small batch run on one thread (a passive OpenMP thread costs more to wake
    than they take), the model on the worker's thread count, which is back in place afterwards; the answers are
    the same as with every pass on all threads, and a large batch is converted on all of them."""
    model_threads = []

    class Clamp(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            model_threads.append(torch.get_num_threads())
            return x.clamp(0, 1)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        small = [np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)]
        large = [np.random.default_rng(2).integers(0, 256, (640, 640, 3), dtype=np.uint8)]
        fast = built_in(pad=False, model=Clamp())
        model_threads.clear()  # the warm-up's
        results = [fast.predict(batch)[0] for batch in (small, large)]
        assert model_threads == [2, 2] and torch.get_num_threads() == 2
        observed = []
        original = torch.set_num_threads
        with monkeypatch.context() as patch:  # a spy on the real call
            patch.setattr(torch, "set_num_threads", lambda n: (observed.append(n), original(n)))
            fast.predict(small)
            fast.predict(large)
        assert observed == [1, 2, 1, 2]  # the small batch's input and output passes; none for the large one
        for batch, result in zip((small, large), results, strict=True):
            np.testing.assert_array_equal(result, batch[0])  # clamp(x / 255) * 255 rounds back to x
    finally:
        torch.set_num_threads(before)


def test_a_user_api_whose_predict_returns_the_wrong_count_answers_500_for_its_batch() -> None:
    from imgserve.api import ImageAPI

    class Short(ImageAPI):
        def predict(self, batch: np.ndarray) -> list[int]:
            return [1]

    outputs = InProcess(Short()).setup().predict([np.zeros((4, 4, 3), dtype=np.uint8)] * 3)
    assert all(isinstance(o, ApiError) and o.status == 500 and "3" in o.message for o in outputs)


def test_out_of_memory_on_a_single_item_is_a_503_for_it_and_at_warm_up_a_clear_failure() -> None:
    class OutOfMemoryWhenTall(torch.nn.Module):
        """SIMULATED out-of-memory on the CPU for any input 64 rows high, alone or not."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-2] == 64:
                raise torch.OutOfMemoryError("simulated")
            return x

    outputs = built_in(pad=False, model=OutOfMemoryWhenTall()).predict(images())
    assert [i for i, o in enumerate(outputs) if isinstance(o, ApiError)] == [3]
    assert (outputs[3].status, outputs[3].code, outputs[3].retry_after) == (503, "out_of_memory", 1)
    with pytest.raises(ModelLoadError, match="failed warm-up on cpu with a 64x64 image: OutOfMemoryError"):
        built_in(pad=False, model=OutOfMemoryWhenTall(), input_size=64)
