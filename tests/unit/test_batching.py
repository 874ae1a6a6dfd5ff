"""Memory-bounded batching on the CPU: chunk planning, results equal to one-by-one runs, OOM split and isolation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from imgserve.errors import ApiError
from imgserve.models.denoiser import build_denoiser
from imgserve.models.outputs import to_pixels
from imgserve.worker.batching import BatchRunner, InMemory, MemoryPlan, plan_chunks

NHWC = torch.channels_last
SIZES = [(32, 40), (32, 40), (24, 24), (64, 48), (24, 24), (40, 32)]


def runner(pad: bool, model=None, on_oom=lambda: None) -> BatchRunner:
    return BatchRunner(model or build_denoiser(), torch.device("cpu"), pad=pad, on_oom=on_oom)


def images() -> list[InMemory]:
    rng = np.random.default_rng(0)
    return [InMemory(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def close(a: np.ndarray, b: np.ndarray, atol: int = 1) -> None:
    """uint8 results equal up to `atol` levels (one rounding step)."""
    assert a.shape == b.shape
    assert np.abs(a.astype(int) - b.astype(int)).max(initial=0) <= atol


def test_chunks_respect_pixel_budget_and_same_size_mode() -> None:
    for chunk in plan_chunks(SIZES, pixel_budget=4000, max_waste=2.0):
        height = max(SIZES[i][0] for i in chunk)
        width = max(SIZES[i][1] for i in chunk)
        assert len(chunk) == 1 or len(chunk) * height * width <= 4000
    same = plan_chunks(SIZES, pixel_budget=10**9, max_waste=1.0)
    assert sorted(sorted(c) for c in same) == [[0, 1], [2, 4], [3], [5]]
    assert sorted(i for chunk in plan_chunks(SIZES, 10**9, 2.0) for i in chunk) == list(range(len(SIZES)))


def in_process(model: torch.nn.Module, image: InMemory) -> np.ndarray:
    """The same model run by hand on one image: float NCHW in [0, 1] -> uint8 HxWx3."""
    tensor = torch.from_numpy(image.array).permute(2, 0, 1)[None].float() / 255
    with torch.inference_mode():
        output = model(tensor)[0]
    return output.clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()


def test_same_size_batches_equal_single_runs_and_the_model_run_by_hand() -> None:
    batch = runner(pad=False)(images())
    for image, output in zip(images(), batch, strict=True):
        assert output.dtype == np.uint8 and output.shape == image.shape
        close(output, runner(pad=False)([image])[0])
        close(output, in_process(build_denoiser(), image))


def test_padded_batches_match_away_from_the_padded_edges() -> None:
    batch = runner(pad=True)(images())
    for image, output in zip(images(), batch, strict=True):
        single = runner(pad=False)([image])[0]
        assert output.shape == image.shape
        margin = 6  # the 5-layer model's receptive-field radius, plus one
        close(output[:-margin, :-margin], single[:-margin, :-margin])


def test_a_padded_chunk_repeats_each_image_edge_into_the_padding() -> None:
    seen = []

    class Records(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.clone())
            return x

    small = InMemory(np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3))
    large = InMemory(np.zeros((4, 5, 3), dtype=np.uint8))
    outputs = runner(pad=True, model=Records())([small, large])
    padded = (seen[0][0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert padded.shape == (4, 5, 3)
    assert (padded[:2, :3] == small.array).all()
    assert (padded[2:, :3] == small.array[-1]).all() and (padded[:, 3:] == padded[:, 2:3]).all()
    assert (outputs[0] == small.array).all() and outputs[1].shape == (4, 5, 3)


class _OutOfMemoryAboveOne(torch.nn.Module):
    """SIMULATED out-of-memory on the CPU: raises torch.OutOfMemoryError for batches of more than one image."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            raise torch.OutOfMemoryError("simulated")
        return x


def test_out_of_memory_splits_down_to_single_images() -> None:
    splits = []
    batch_runner = runner(pad=True, model=_OutOfMemoryAboveOne(), on_oom=lambda: splits.append(1))
    outputs = batch_runner(images())
    assert all(isinstance(o, np.ndarray) for o in outputs)
    assert len(splits) >= 3


def test_memory_plan_scales_batch_with_image_size() -> None:
    plan = MemoryPlan(bytes_per_pixel=100.0, budget_bytes=100 * 1_000_000)
    assert plan.pixel_budget == 1_000_000
    assert plan.batch_size_at(250_000) == 4
    assert plan.batch_size_at(4_000_000) == 1
    measured = runner(pad=False).measure(0.5)
    assert measured.bytes_per_pixel >= 2 * 3 * 4  # at least the fp32 input and output
    assert measured.pixel_budget > 0


def test_a_failing_image_fails_alone() -> None:
    class FailsOnTall(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-2] >= 64:
                raise ValueError("too tall")
            return x

    outputs = runner(pad=True, model=FailsOnTall())(images())
    failed = [i for i, o in enumerate(outputs) if isinstance(o, ApiError)]
    assert failed == [3] and outputs[3].status == 500


def test_channels_last_gives_the_same_outputs_in_nhwc_memory() -> None:
    nhwc = BatchRunner(build_denoiser(), torch.device("cpu"), channels_last=True)
    seen = []
    nhwc.model.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous(memory_format=NHWC)))
    for image, output in zip(images(), nhwc(images()), strict=True):
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

    batch_runner = BatchRunner(ViewsItsInput(), torch.device("cpu"), channels_last=True)
    batch_runner.measure(0.5)
    assert not batch_runner.channels_last
    outputs = batch_runner(images())
    assert [o.shape for o in outputs] == [i.shape for i in images()]


def test_a_model_answering_with_a_broadcast_view_still_gets_its_pixels() -> None:
    class Grey(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mean(dim=(1, 2, 3), keepdim=True).expand(-1, 3, x.shape[2], x.shape[3])

    image = images()[0]
    [output] = runner(pad=False, model=Grey())([image])
    assert output.shape == image.shape and (output == output[0, 0, 0]).all()
    assert abs(int(output[0, 0, 0]) - round(float(image.array.mean()))) <= 1


def test_the_memory_plan_shares_the_fraction_among_the_devices_workers_and_keeps_room_for_slots() -> None:
    alone = BatchRunner(build_denoiser(), torch.device("cpu")).measure(0.8).budget_bytes
    room = alone // 4
    shared = BatchRunner(build_denoiser(), torch.device("cpu")).measure(0.8, sharers=4, reserved_bytes=room)
    assert abs(4 * shared.budget_bytes + room - alone) < 0.05 * alone  # MemAvailable moves a little in between
    huge = BatchRunner(build_denoiser(), torch.device("cpu")).measure(0.8, sharers=1, reserved_bytes=2**50)
    assert abs(2 * huge.budget_bytes - alone) < 0.05 * alone  # the slots' room is at most half


def test_split_seconds_times_the_batch_work_and_the_model_call() -> None:
    runner = BatchRunner(build_denoiser(), torch.device("cpu"))
    batch, cpu_s, device_s = runner.split_seconds([InMemory(np.zeros((32, 32, 3), dtype=np.uint8))] * 2)
    assert batch == 2 and cpu_s >= 0 and device_s > 0


def test_split_seconds_halves_a_batch_the_device_has_no_memory_for() -> None:
    """The workers_per_device probe (a batch of 8 on a GPU) must not fail a server whose model fits fewer images;
    out of memory even on one image is raised (imgserve then exits 2 with one line)."""
    probe = [InMemory(np.zeros((16, 16, 3), dtype=np.uint8))] * 8
    batch, _, device_s = runner(pad=False, model=_OutOfMemoryAboveOne()).split_seconds(probe)
    assert batch == 1 and device_s > 0

    def always(x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("simulated")

    with pytest.raises(torch.OutOfMemoryError):
        runner(pad=False, model=always).split_seconds(probe)


def test_a_small_cpu_batch_is_converted_on_one_thread_and_the_model_runs_on_all_of_them(monkeypatch) -> None:
    """The uint8 <-> float passes of a small batch run on one thread (a passive OpenMP thread costs more to wake
    than they take), the model on the worker's thread count, which is back in place afterwards; the answers are
    the same as with every pass on all threads, and a large batch is converted on all of them."""
    model_threads = []

    def model(x: torch.Tensor) -> torch.Tensor:
        model_threads.append(torch.get_num_threads())
        return x.clamp(0, 1)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        small = [InMemory(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))]
        large = [InMemory(np.random.default_rng(2).integers(0, 256, (640, 640, 3), dtype=np.uint8))]
        fast = runner(pad=False, model=model)
        results = [fast(batch)[0] for batch in (small, large)]
        assert model_threads == [2, 2] and torch.get_num_threads() == 2
        observed = []
        original = torch.set_num_threads
        with monkeypatch.context() as patch:  # a spy on the real call
            patch.setattr(torch, "set_num_threads", lambda n: (observed.append(n), original(n)))
            fast(small)
            fast(large)
        assert observed == [1, 2, 1, 2]  # the small batch's input and output passes; none for the large one
        for batch, result in zip((small, large), results, strict=True):
            np.testing.assert_array_equal(result, batch[0].array)  # clamp(x / 255) * 255 rounds back to x
    finally:
        torch.set_num_threads(before)
