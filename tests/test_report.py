"""The report: PNG encoding checked by decoding it back, lanes that show starvation, and a PNG
from a real `dflash-ipc up` run directory on CPU."""

import json
import os
import signal
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from dflash_ipc.errors import DataError
from dflash_ipc.report import COLORS, UNRECORDED, build_report, draw_text, encode_png, format_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def decode_png(data: bytes) -> np.ndarray:
    """Enough of a PNG decoder for what encode_png writes (truecolor, filter 0), checking CRCs."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks.append((kind, body))
        pos += 12 + length
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, color, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color) == (8, 2)
    raw = np.frombuffer(zlib.decompress(chunks[1][1]), np.uint8).reshape(height, 1 + width * 3)
    assert not raw[:, 0].any()  # filter 0 on every row
    return raw[:, 1:].reshape(height, width, 3)


def test_encode_png_round_trip():
    image = np.random.default_rng(0).integers(0, 256, (7, 13, 3), dtype=np.uint8)
    np.testing.assert_array_equal(decode_png(encode_png(image)), image)
    with pytest.raises(ValueError, match="uint8"):
        encode_png(image.astype(np.float32))


def test_draw_text_inks_glyphs_and_clips():
    image = np.full((20, 40, 3), 255, np.uint8)
    end = draw_text(image, 1, 1, "i/", color=(0, 0, 0), scale=1)
    assert end == 13
    ink = (image == 0).all(axis=2)
    assert ink[1, 2:5].all() and ink[7, 2:5].all()  # the I's top and bottom bars
    assert ink[:, 7:12].any() and not ink[9:].any()
    draw_text(image, 35, 15, "WWW", color=(0, 0, 0))  # past the border: clipped, no error


def _write_timeline(run_dir, role, rows):
    folder = run_dir / "metrics"
    folder.mkdir(exist_ok=True)
    with open(folder / (role.replace("/", "-") + ".jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _lane_pixels(image, color):
    """Per image row, how many pixels have exactly `color`."""
    return (image == np.array(color, np.uint8)).all(axis=2).sum(axis=1)


def test_report_shows_a_starved_target(tmp_path):
    t = 1_800_000_000.0
    # target/0 works 90% of the time, target/1 waits 90%: a starved target in the picture
    _write_timeline(tmp_path, "target/0", [{"t0": t + i, "t1": t + i + 0.9, "state": "busy", "tokens": 90}
                                           for i in range(10)])
    _write_timeline(tmp_path, "target/1", [{"t0": t, "t1": t + 9, "state": "wait_work"},
                                           {"t0": t + 9, "t1": t + 10, "state": "busy", "tokens": 100}])
    _write_timeline(tmp_path, "drafter/0", [
        {"t0": t, "t1": t + 5, "state": "wait_hidden"},
        {"t0": t + 5, "t1": t + 10, "state": "step", "loss": 3.0, "anchors": 50, "sequences": 5, "tokens": 900}])
    (tmp_path / "drafter_metrics.jsonl").write_text('{"loss": 4.0}\n{"loss": NaN}\n{"loss": 3.0}\n')
    report = build_report(str(tmp_path))
    assert report["png"] == str(tmp_path / "report.png")
    assert (report["loss_first"], report["loss_last"]) == (4.0, 3.0)
    workers = report["workers"]
    assert list(workers) == ["target/0", "target/1", "drafter/0"]
    assert workers["target/0"]["busy_fraction"] == pytest.approx(0.9 * 10 / 9.9)
    assert workers["target/1"]["busy_fraction"] == pytest.approx(0.1)
    assert workers["drafter/0"]["anchors_per_s"] == pytest.approx(5.0)

    image = decode_png(open(report["png"], "rb").read())
    orange, green, red = (_lane_pixels(image, COLORS[s]) for s in ("wait_work", "busy", "wait_hidden"))
    lanes = [row for row in range(image.shape[0]) if orange[row] + green[row] + red[row] > 500]
    assert len(lanes) >= 3 * 10  # three lanes, each many pixels tall
    starved = max(lanes, key=lambda row: orange[row])
    busy = max(lanes, key=lambda row: green[row])
    assert orange[starved] > 8 * green[starved]          # target/1: mostly orange
    assert green[busy] > 0.85 * (green[busy] + orange[busy] + _lane_pixels(image, UNRECORDED)[busy])
    assert red.max() > 0.4 * green[lanes].max() * 0.9     # drafter/0: half red
    assert "target/1" in format_summary(report) and "10.0%" in format_summary(report)


def test_report_without_metrics_names_the_folder(tmp_path):
    with pytest.raises(DataError, match="metrics"):
        build_report(str(tmp_path))


@pytest.mark.slow
def test_report_from_a_real_cpu_run(tmp_path, tiny_cache):
    """A small real job (2 targets, 1 drafter, 1 epoch) leaves timelines that report draws."""
    run_dir = tmp_path / "run"
    # test_pipeline_e2e's job, smaller; the target given by path skips the closing eval
    overrides = [
        "data.synthetic_samples=120", "data.synthetic_min_len=24", "data.synthetic_max_len=200",
        "data.bucket_boundaries=[64,128,200]", "data.token_budget=800", "data.num_epochs=1",
        "model.num_layers=1", "model.target_layer_ids=[1,2]", "objective.anchors_per_step=128",
        "objective.max_anchors_per_seq=32", "checkpoint.every_steps=10", "drafter.fifo_sequences=32",
        "target.num_workers=2", "drafter.num_workers=1", f"target.path={tiny_cache}/tiny-target"]
    argv = [sys.executable, "-m", "dflash_ipc.cli", "up", "-o", f"run.run_dir={run_dir}"]
    for o in overrides:
        argv += ["-o", o]
    env = dict(os.environ, DFLASH_IPC_CACHE=str(tiny_cache), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"dflash-ipc up did not finish in 120 s:\n{out.decode()[-3000:]}")
    assert proc.returncode == 0, out.decode()[-3000:]

    report = build_report(str(run_dir), str(tmp_path / "out.png"))
    workers = report["workers"]
    assert set(workers) == {"target/0", "target/1", "drafter/0"}
    final = json.loads((run_dir / "final_status.json").read_text())
    produced = sum(t["tokens"] for t in final["targets"].values())
    assert sum(workers[f"target/{r}"]["tokens"] for r in range(2)) == produced
    drafter = workers["drafter/0"]
    assert drafter["count"] > 0 and drafter["anchors"] > 0 and drafter["sequences"] > 0
    assert 0 < drafter["busy_fraction"] <= 1 and drafter["loss_last"] == drafter["loss_last"]
    assert all(0 < workers[f"target/{r}"]["busy_fraction"] < 1 for r in range(2))
    image = decode_png(open(report["png"], "rb").read())
    assert image.shape[1] == 1200 and (_lane_pixels(image, COLORS["step"]) > 100).any()
