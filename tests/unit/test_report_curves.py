"""The goodput page carries loss and throughput curves as inline SVG, one point per step."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from trainer.report import goodput_html

pytestmark = pytest.mark.timeout(30)

SVG = "{http://www.w3.org/2000/svg}"


def _events() -> list[dict]:
    events = [{"kind": "launch", "time": 0.0}, {"kind": "attempt_start", "time": 0.1}]
    for step in range(1, 7):
        events.append(
            {"kind": "step", "time": float(step), "step": step, "loss": 3.0 - 0.1 * step, "duration_s": 0.5}
        )
    # a restart redid steps 5 and 6 (slower): the curve must hold them once, the later execution
    for step in (5, 6):
        events.append({"kind": "step", "time": 10.0 + step, "step": step, "loss": 9.0, "duration_s": 1.0})
    return events


def test_curves_are_inline_svg_with_one_point_per_step():
    page = goodput_html({"steps": 6, "target_steps": 6}, _events(), [], tokens_per_step=512)
    assert "<script" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    svgs = re.findall(r"<svg .*?</svg>", page, flags=re.S)
    curves = [ET.fromstring(svg) for svg in svgs if 'class="curve"' in svg]
    titles = {c.find(f"{SVG}title").text: c for c in curves}
    assert set(titles) == {"training loss", "throughput (tokens/s)"}
    loss_points = titles["training loss"].find(f"{SVG}polyline").get("points").split()
    assert len(loss_points) == 6
    throughput = titles["throughput (tokens/s)"]
    labels = [t.text for t in throughput.findall(f"{SVG}text")]
    assert "1024" in labels and "512" in labels  # 512 tokens / 0.5 s, and / 1.0 s for the redone steps


def test_a_run_without_steps_says_so():
    page = goodput_html({"steps": 0, "target_steps": 6}, [{"kind": "launch", "time": 0.0}], [])
    assert "No training loss recorded." in page
