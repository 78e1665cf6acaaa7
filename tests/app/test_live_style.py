"""The charts' colours (app.live.style): a request's colour never reads as one of the colours
that mean something else on the page (grey: waiting or wasted work; red: a stall)."""

from __future__ import annotations

import colorsys

import pytest

from app.live import style
from app.live.component import style as sent_style

RESERVED = {
    "waiting": style.WAIT_GREY,
    "wasted": style.WASTED_GREY,
    "stall": style.STALL_RED,
}


def _rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def _chroma(color: str) -> float:
    rgb = _rgb(color)
    return max(rgb) - min(rgb)


def _distance(a: str, b: str) -> float:
    return sum((x - y) ** 2 for x, y in zip(_rgb(a), _rgb(b), strict=True)) ** 0.5


@pytest.mark.parametrize("color", style.PALETTE)
def test_no_request_colour_is_a_grey_or_a_red(color: str) -> None:
    # a grey (no chroma) reads as "waiting" or "wasted" whatever its lightness
    assert _chroma(color) >= 0.2, f"{color} is a grey"
    hue = colorsys.rgb_to_hls(*_rgb(color))[0] * 360
    assert not (hue < 8 or hue > 330) or _chroma(color) < 0.3, f"{color} reads as red"
    for meaning, reserved in RESERVED.items():
        assert _distance(color, reserved) > 0.25, f"{color} is close to {meaning} {reserved}"


@pytest.mark.parametrize("uid", [0, 11, 23, 83, 1_000_003, -1])
def test_every_uid_gets_a_palette_colour_the_browser_gets_too(uid: int) -> None:
    color = style.request_color(uid)
    assert color in style.PALETTE and _chroma(color) >= 0.2  # request 83 was drawn grey
    assert sent_style()["palette"] == list(style.PALETTE)
    assert len(set(style.PALETTE)) == len(style.PALETTE)
