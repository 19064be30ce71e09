"""mutwo turns on the CUDA allocator's expandable segments for the steps it plans, unless the user
configured the allocator (:mod:`mutwo.runtime.measurement.expandable_segments`). The settings are
torch's process-wide allocator configuration, which a CPU build parses too: these tests change it
and put it back."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mutwo.runtime.measurement import expandable_segments as segments
from mutwo.runtime.planning import plan_key

CUDA = torch.device("cuda")


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No allocator settings in the environment, expandable segments off; as before afterwards."""
    for name in segments.ALLOCATOR_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    before = segments.current_settings()
    segments.apply_settings("expandable_segments:False")  # off (torch's parser keeps an option until it is given again)
    segments.apply_settings("")  # and nothing given since
    yield
    segments.apply_settings("expandable_segments:False")
    segments.apply_settings(before)


def test_on_cuda_they_are_turned_on_and_the_log_says_how_to_keep_the_default(allocator: None) -> None:
    said = segments.use_expandable_segments(CUDA)
    assert segments.expandable_segments_on()
    assert said is not None and "expandable segments on" in said
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in said
    assert segments.use_expandable_segments(CUDA) is None  # already on: nothing more to say


def test_on_the_cpu_nothing_changes(allocator: None) -> None:
    assert segments.use_expandable_segments(torch.device("cpu")) is None
    assert not segments.expandable_segments_on()


@pytest.mark.parametrize("variable", segments.ALLOCATOR_VARIABLES)
@pytest.mark.parametrize("given", ["expandable_segments:False", "max_split_size_mb:128"])
def test_an_allocator_the_user_configured_is_left_as_it_is(allocator: None, monkeypatch: pytest.MonkeyPatch,
                                                           variable: str, given: str) -> None:  # fmt: skip
    monkeypatch.setenv(variable, given)
    said = segments.use_expandable_segments(CUDA)
    assert not segments.expandable_segments_on()
    assert said is not None and f"left as configured ({variable}={given})" in said


def test_settings_given_at_run_time_are_left_as_they_are(allocator: None) -> None:
    """A user who set ``max_split_size_mb`` at run time configured the allocator; with expandable
    segments it would make torch's cache grow without bound (pytorch/pytorch#123548)."""
    segments.apply_settings("max_split_size_mb:128")
    said = segments.use_expandable_segments(CUDA)
    assert not segments.expandable_segments_on()
    assert said is not None and "left as configured (set at run time: max_split_size_mb:128)" in said


def test_the_last_word_on_the_option_decides(allocator: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "current_settings", lambda: "expandable_segments:True,expandable_segments:False")
    assert not segments.expandable_segments_on()


def test_a_plan_made_with_them_is_not_a_plan_made_without(allocator: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan cache's key says whether the allocator maps expandable segments: what a calibrated
    plan holds over its allocation depends on it."""

    class Properties:
        name, total_memory, major, minor, multi_processor_count = "H200", 2**37, 9, 0, 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    without = plan_key.device_description(CUDA)
    segments.use_expandable_segments(CUDA)
    with_them = plan_key.device_description(CUDA)
    assert without != with_them
    assert (without["expandable_segments"], with_them["expandable_segments"]) == (False, True)


@pytest.fixture
def torch_2_11(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, object]]:
    """CUDA in use, torch 2.11's API: no settings getter; its memory snapshot (whose
    ``allocator_settings`` the H200 printed: the string last given and the flags in force)."""
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    snapshot: dict[str, dict[str, object]] = {"allocator_settings": {}}
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: snapshot)
    return snapshot


def test_without_torchs_getter_the_settings_are_read_from_a_memory_snapshot(
        torch_2_11: dict[str, dict[str, object]]) -> None:  # fmt: skip
    torch_2_11["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert segments.current_settings() == "expandable_segments:True"
    assert segments.expandable_segments_on()


def test_the_flag_in_force_decides_over_the_settings_last_given(torch_2_11: dict[str, dict[str, object]]) -> None:
    """Settings given after expandable segments, without them, leave them on."""
    torch_2_11["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8",
                                        "expandable_segments": True}  # fmt: skip
    assert segments.expandable_segments_on()


def test_an_allocator_that_refuses_snapshots_is_left_alone_without_a_crash(
        allocator: None, torch_2_11: dict[str, dict[str, object]],
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """torch refuses a snapshot under cudaMallocAsync; without a getter, nothing may ask for one."""

    def refuse() -> None:
        raise RuntimeError("Calling snapshot with backend:cudaMallocAsync is not meaningful")

    monkeypatch.setattr(torch.cuda.memory, "_snapshot", refuse)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync")
    said = segments.use_expandable_segments(CUDA)
    assert said is not None and "cudaMallocAsync, left as it is" in said
    assert not segments.expandable_segments_on() and segments.current_settings() == ""


def test_another_allocator_backend_is_left_as_it_is(allocator: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync")
    said = segments.use_expandable_segments(CUDA)
    assert said is not None and "cudaMallocAsync, left as it is" in said
    assert not segments.expandable_segments_on()
