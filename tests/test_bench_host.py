"""Tests of the host-memory parts of ``torpor bench``: the modes compared and their Markdown (no GPU needed)."""

from __future__ import annotations

from torpor.bench import Result, markdown
from torpor.bench.host import HOST_MODES, host_markdown
from torpor.statemachine.core.policy import AfterWake, HostMemoryPolicy, PinWhen
from torpor.units import GiB


def test_the_modes_cover_every_pin_and_after_wake_choice_with_the_default_among_them() -> None:
    """The benchmark compares all four (pin, after wake) pairs, the default one included."""
    assert {(m.pin, m.after_wake) for m in HOST_MODES} == {(p, a) for p in PinWhen for a in AfterWake}
    assert HostMemoryPolicy() in HOST_MODES


def test_host_mode_rows_render_pinned_bytes_per_phase() -> None:
    """A host-mode row shows its times against the floor and the pinned GiB awake, asleep and after wake."""
    r = Result("torpor", "w", GiB, 4, sleeps=[3.0, 1.0, 1.0], wakes=[1.0, 1.0], released=[GiB])
    r.host_mode, r.pinned_awake, r.pinned_asleep, r.pinned_after_wake = "at_sleep, keep", 0, GiB, GiB
    row = r.row(GiB, GiB)
    data = {"rows": [row], "host_modes": [row], "pageable_d2h": {"fresh_Bps": 1.5e9, "reused_Bps": 14.6e9}}
    data["floor_d2h_Bps"], data["transparent_huge_pages"] = 55.2e9, "madvise"
    text = host_markdown(data)
    assert (
        "| at_sleep, keep | w | 3.000 s (3.00x) | 1.000 s (1.00x) | 1.000 s (1.00x) | 0.00 | 1.00 | 1.00 | yes |"
        in text
    )
    assert "1.5 GB/s into fresh pages, 14.6 GB/s reused; pinned floor 55.2 GB/s" in text
    assert text in markdown(data)


def test_no_host_modes_render_nothing() -> None:
    """A run without host modes (an older bench.json) adds nothing to the Markdown."""
    assert host_markdown({"rows": []}) == ""
