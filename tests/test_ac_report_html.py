"""The step's memory as one HTML page (prime_ac.report_html): its numbers are the audit's, read
back from the file, and it renders in a real headless browser.

The browser test needs Chromium (scripts/test.sh installs Debian's where apt-get can, or name
one in PRIME_AC_BROWSER); without one it skips saying so.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import struct
import subprocess
import zlib

import numpy as np
import pytest
import torch

import prime_ac
from prime_ac import _compat, planner
from prime_ac.__main__ import main
from prime_ac.budget import profiles
from prime_ac.measure import measure_peak
from prime_ac.models import build_model
from prime_ac.report_html import KINDS, write

ATTENTION = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _tokens():
    return torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def offloading():
    """A selective audit whose attention results go to host memory."""
    torch.manual_seed(0)
    model = build_model("dense")
    tokens = _tokens()
    prime_ac.checkpoint_blocks(model, mode="selective", offload=[ATTENTION])
    model.loss(tokens).backward()
    model.zero_grad(set_to_none=True)
    return model, prime_ac.audit(model, lambda m: m.loss(tokens))


@pytest.fixture(scope="module")
def planned():
    """A full-mode audit and a peak plan over it (keep, offload and replay all chosen)."""
    torch.manual_seed(0)
    model = build_model("dense")
    tokens = _tokens()
    prime_ac.checkpoint_blocks(model, mode="full")
    report = prime_ac.audit(model, lambda m: m.loss(tokens))
    plan = planner.plan(profiles(report), 1_400_000)
    measured = measure_peak(model, lambda m: m.loss(tokens))
    return report, plan, measured


def _read(path):
    """The embedded numbers, and per bar group its (data-kind -> data-bytes, rect heights)."""
    text = path.read_text(encoding="utf-8")
    blob = re.search(
        r'<script type="application/json" id="prime-ac-data">(.*?)</script>', text, re.S
    )
    data = json.loads(blob.group(1).replace("<\\/", "</"))
    svg = re.search(r"<svg [^>]*>", text).group(0)
    top = float(re.search(r'data-top="([\d.]+)"', svg).group(1))
    height = float(re.search(r'data-plot-height="([\d.]+)"', svg).group(1))
    groups = []
    for g in re.findall(r'<g class="point"(.*?)</g>', text, re.S):
        bars = re.findall(r'data-kind="(\w+)" data-bytes="(\d+)"[^>]*height="([\d.]+)"', g)
        groups.append({kind: (int(n), float(h)) for kind, n, h in bars})
    levels = dict(re.findall(r'class="level" data-kind="(\w+)" data-bytes="(\d+)"', text))
    return data, groups, levels, top, height


def test_the_pages_numbers_are_the_audits(offloading, tmp_path):
    _, report = offloading
    path = tmp_path / "step.html"
    report.to_html(str(path), measured_peak=12345)
    data, groups, levels, top, height = _read(path)
    blocks = report.blocks
    assert [b["block"] for b in data["blocks"]] == blocks
    for b in data["blocks"]:
        name = b["block"]
        assert b["offloaded"] == report.block_offloaded_bytes[name] > 0
        assert b["kept"] == report.block_held_bytes[name] - b["offloaded"] > 0
        assert b["inputs"] == report.block_input_bytes[name]
        assert b["no_ac"] == report.block_held_bytes_no_ac[name]
        assert any(d.startswith(ATTENTION) for d in b["decisions"])
    points = data["points"]
    assert [p["label"] for p in points] == [f"{b} forward" for b in blocks] + ["forward end"] + [
        f"{b} backward" for b in reversed(blocks)
    ]
    for p in points:
        if p["label"] != "forward end":
            assert p["outside"] == report.outside_bytes_before.get(p["block"], 0)
            assert p["outside"] > 0 or not _compat.SAVED_TENSOR_DATA  # the embedding's ids
    outside = (
        report.held_bytes
        - sum(report.block_held_bytes.values())
        - sum(report.block_input_bytes.values())
    )
    end = points[len(blocks)]
    # at the forward's end the page holds exactly what the audit measured as held
    assert end["outside"] == outside > points[0]["outside"]  # the head's saves, the loss's
    assert end["outside"] + end["inputs"] + end["kept"] + end["offloaded"] == report.held_bytes
    assert end["device"] == report.held_bytes - end["offloaded"]
    assert data["measured_peak"] == 12345 and levels == {"measured_peak": "12345"}
    assert data["peak"] == max(p["device"] for p in points)
    # each bar is drawn at its bytes, on one scale
    assert len(groups) == len(points)
    for point, bars in zip(points, groups, strict=True):
        for key, _, _ in KINDS:
            if point[key]:
                nbytes, drawn = bars[key]
                assert nbytes == point[key]
                assert drawn == pytest.approx(nbytes / top * height, abs=0.01)
            else:
                assert key not in bars


def test_a_plans_page_draws_its_decisions_budget_and_predicted_peak(planned, tmp_path):
    report, plan, measured = planned
    path = tmp_path / "plan.html"
    data = write(report, str(path), plan=plan, measured_peak=measured)
    read, _, levels, _, _ = _read(path)
    assert read == json.loads(json.dumps(data))
    assert levels == {
        "budget": str(plan.budget),
        "predicted_peak": str(plan.simulation.peak),
        "measured_peak": str(measured),
    }
    for block, chosen, row in zip(plan.blocks, plan.decisions, data["blocks"], strict=True):
        for decision, key in (("keep", "kept"), ("offload", "offloaded")):
            assert row[key] == sum(
                c.bytes for c, d in zip(block.calls, chosen, strict=True) if d == decision
            )
    assert sum(b["offloaded"] for b in data["blocks"]) == plan.simulation.host_bytes > 0
    with pytest.raises(ValueError, match="not the report's"):
        write(report, str(path), plan=planner.plan(profiles(report)[:2], 1_400_000))


def test_audit_and_plan_commands_write_the_page(tmp_path, capsys):
    audit_page, plan_page = tmp_path / "audit.html", tmp_path / "plan.html"
    for where in (tmp_path / "missing" / "page.html", tmp_path):  # refused before the step
        with pytest.raises(SystemExit):
            main(["audit", "--html", str(where)])
    assert "--html" in capsys.readouterr().err
    assert main(["audit", "--html", str(audit_page)]) == 0
    assert main(["plan", "--budget", "5MiB", "--html", str(plan_page)]) == 0
    capsys.readouterr()
    audited, _, audit_levels, _, _ = _read(audit_page)
    assert audited["mode"] == "selective" and set(audit_levels) == {"measured_peak"}
    assert audited["measured_peak"] > 0
    planned_data, _, plan_levels, _, _ = _read(plan_page)
    assert planned_data["budget"] == 5 * 2**20 and {"budget", "predicted_peak"} <= set(plan_levels)


def _browser():
    for name in (
        os.environ.get("PRIME_AC_BROWSER"),
        "chromium",
        "chromium-browser",
        "google-chrome",
    ):
        found = name and shutil.which(name)
        if found:
            return found
    return None


def _png(path):
    """RGB pixels of an 8-bit, non-interlaced PNG (what Chromium writes): rows x columns x 3."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], None
    while pos < len(raw):
        (length,), kind = struct.unpack(">I", raw[pos : pos + 4]), raw[pos + 4 : pos + 8]
        body = raw[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and interlace == 0 and colour in (2, 6)
    channels = 3 if colour == 2 else 4
    data = zlib.decompress(b"".join(chunks))
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.int32)
    prev = np.zeros(stride, dtype=np.int32)
    for row in range(height):
        start = row * (stride + 1)
        kind = data[start]
        line = np.frombuffer(data, dtype=np.uint8, count=stride, offset=start + 1).astype(np.int32)
        if kind == 0:
            cur = line
        elif kind == 2:
            cur = (line + prev) & 255
        else:  # sub, average and Paeth depend on the pixel to the left: one at a time
            cur = np.zeros(stride, dtype=np.int32)
            for i in range(stride):
                a = cur[i - channels] if i >= channels else 0
                b, c = prev[i], prev[i - channels] if i >= channels else 0
                if kind == 1:
                    predictor = a
                elif kind == 3:
                    predictor = (a + b) // 2
                else:
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    predictor = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                cur[i] = (line[i] + predictor) & 255
        out[row], prev = cur, cur
    return out.reshape(height, width, channels)[:, :, :3]


def _in_runs(mask, length=8):
    """How many True pixels of ``mask`` lie in horizontal runs of at least ``length``: bars and
    legend swatches, not the anti-aliased text whose edge pixels happen to be a bar's grey."""
    padded = np.zeros((mask.shape[0], mask.shape[1] + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    edges = np.diff(padded, axis=1)
    starts, ends = np.nonzero(edges == 1), np.nonzero(edges == -1)
    widths = ends[1] - starts[1]  # row-major order pairs each run's start with its end
    return int(widths[widths >= length].sum())


def test_the_page_renders_in_a_headless_browser(planned, tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip(
            "no headless browser: install Debian's chromium (scripts/test.sh does where apt-get "
            "can) or set PRIME_AC_BROWSER to a Chromium binary"
        )
    report, plan, measured = planned
    page, shot = tmp_path / "plan.html", tmp_path / "plan.png"
    data = write(report, str(page), plan=plan, measured_peak=measured)
    command = [
        browser,
        "--headless",
        "--no-sandbox",  # root in CI containers
        "--disable-gpu",
        "--disable-dev-shm-usage",  # containers' small /dev/shm
        f"--user-data-dir={tmp_path / 'profile'}",
        "--hide-scrollbars",
        "--window-size=900,560",
    ]
    subprocess.run(
        [*command, f"--screenshot={shot}", page.as_uri()],
        check=True,
        capture_output=True,
        timeout=120,
    )
    pixels = _png(shot)
    _, groups, _, _, _ = _read(page)
    for key, _, colour in KINDS:
        rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)])
        if key == "offloaded":  # drawn at 55% over white
            rgb = np.round(0.55 * rgb + 0.45 * 255)
        found = _in_runs(np.abs(pixels - rgb).max(axis=2) <= 2)
        # every bar of this kind is 28 px wide at its drawn height; level lines cross some
        expected = sum(28 * g[key][1] for g in groups if key in g)
        assert expected > 0, key
        assert 0.8 * expected <= found <= 1.05 * expected + 200, (key, found, expected)
    budget = np.array([0xE1, 0x57, 0x59])
    assert (np.abs(pixels - budget).max(axis=2) <= 2).sum() > 200  # the budget line
    assert data["budget"] == plan.budget
    # the script ran: the panel shows the peak's point and its block's decisions
    dom = subprocess.run(
        [*command[:5], "--dump-dom", page.as_uri()],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    panel = re.search(r'<pre id="detail">(.*?)</pre>', dom, re.S).group(1)
    peak = max(data["points"], key=lambda p: p["device"])
    block = next(b for b in data["blocks"] if b["block"] == peak["block"])
    assert panel.startswith(f"{peak['label']}: ")
    assert html.unescape(panel).splitlines()[1:] == block["decisions"]
