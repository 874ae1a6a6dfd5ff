"""The models of a device fitted into its memory together (pod.fit_models): weights, worker processes, the request
slots' room and each worker's batch memory; max_batch_size auto; a set that does not fit is one line with the
numbers."""

from __future__ import annotations

import pytest

from imgserve.pod import DeviceMemory, Limits, Measured, MemoryRefusal, ModelNeed, fit_models

MIB = 2**20
IMAGE = 256 * 256 * 3  # elements of a 256x256 RGB example


def device(free_mib: int = 1000, workers: int = 2, overhead_mib: int = 100, reserved_mib: int = 0) -> DeviceMemory:
    return DeviceMemory("cpu", free_mib * MIB, 0.8, workers, overhead_mib * MIB, reserved_mib * MIB)


def need(name: str, weight_mib: int = 10, bytes_per_element: float = 100.0, batch: int | str = 8) -> ModelNeed:
    return ModelNeed(name, weight_mib * MIB, Measured(bytes_per_element, IMAGE), batch)  # type: ignore[arg-type]


def test_each_worker_gets_what_the_weights_and_the_processes_leave_and_every_model_may_use_it() -> None:
    """800 MiB budget - 30 MiB of weights - 2 x 100 MiB of processes = 570 MiB: 285 MiB per worker, for any model
    (a worker runs one batch at a time, whatever its model)."""
    limits = fit_models(device(), [need("a", 10), need("b", 20)])
    per_worker = (800 * MIB - 30 * MIB - 200 * MIB) // 2
    assert limits["a"] == limits["b"] == Limits(8, int(per_worker / 100.0), per_worker)


def test_auto_takes_the_largest_batch_of_example_items_that_fits() -> None:
    limits = fit_models(device(), [need("a", batch="auto"), need("b", bytes_per_element=400.0, batch="auto")])
    per_worker = (800 * MIB - 20 * MIB - 200 * MIB) // 2
    assert limits["a"].batch_size == int(per_worker / 100.0) // IMAGE
    assert limits["b"].batch_size == int(per_worker / 400.0) // IMAGE
    assert limits["a"].batch_size > limits["b"].batch_size >= 1


def test_the_slots_room_is_kept_but_takes_at_most_half() -> None:
    kept = fit_models(device(reserved_mib=100), [need("a", bytes_per_element=10.0)])["a"]
    assert kept.budget_bytes == (800 * MIB - 10 * MIB - 200 * MIB - 100 * MIB) // 2
    capped = fit_models(device(reserved_mib=10**6), [need("a", bytes_per_element=10.0)])["a"]
    assert capped.budget_bytes == (800 * MIB - 10 * MIB - 200 * MIB) // 2 // 2


def test_a_model_without_an_example_is_bounded_by_its_batch_size_alone() -> None:
    limits = fit_models(device(), [ModelNeed("plain", 0, None, 4)])
    assert limits["plain"] == Limits(4, 0, 0)


def test_models_that_do_not_fit_are_one_line_with_the_numbers() -> None:
    with pytest.raises(MemoryRefusal) as refused:
        fit_models(device(), [need("small"), need("huge", bytes_per_element=100.0, batch=10_000)])
    line = str(refused.value)
    assert "\n" not in line and line.startswith("model huge does not fit on cpu")
    assert "small 10 MiB weights" in line and "huge 10 MiB weights" in line and "per batch of 10000" in line
    assert "the device's budget is 800 MiB (0.8 of 1000 MiB free)" in line and "2 worker(s) x 100 MiB" in line
    with pytest.raises(MemoryRefusal, match="the models do not fit on cpu"):
        fit_models(device(), [need("a", weight_mib=700), need("b", weight_mib=100)])  # weights alone over the budget


def test_the_refusal_gives_the_slots_room_that_was_kept_not_what_was_asked() -> None:
    with pytest.raises(MemoryRefusal) as refused:
        fit_models(device(reserved_mib=10**6), [need("huge", batch=10_000)])
    assert "295 MiB kept for request slots" in str(refused.value)  # (800 - 10 - 200) / 2: at most half
