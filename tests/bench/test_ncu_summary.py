"""scripts/ncu_summary.py on a small Nsight Compute raw-page CSV written here: grouping by kernel and
launch shape, units, shares, bandwidth, stall ranking, and the error on a CSV without a header."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("ncu_summary", os.path.join(ROOT, "scripts", "ncu_summary.py"))
ncu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu)

HEADER = ['"ID"', '"Kernel Name"', '"launch__grid_size"', '"launch__block_size"', '"launch__registers_per_thread"',
          '"gpu__time_duration.sum"', '"dram__bytes_read.sum"',
          '"smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio"',
          '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"']
UNITS = ['""', '""', '""', '""', '"register/thread"', '"us"', '"byte"', '"ratio"', '"ratio"']


def write_csv(tmp_path, rows):
    p = tmp_path / "ncu.csv"
    lines = ["==PROF== Connected to process 1", ",".join(HEADER), ",".join(UNITS)]
    lines += [",".join(f'"{v}"' for v in r) for r in rows]
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_groups_by_kernel_and_shape(tmp_path):
    path = write_csv(tmp_path, [
        (0, "gemv_q", "396", "256", "80", "20", "10,000,000", "4", "2"),
        (1, "gemv_q", "17", "256", "80", "10", "500,000", "3", "1"),
        (2, "gemv_q", "396", "256", "80", "30", "14,000,000", "2", "2"),
        (3, "moe_down", "256", "256", "72", "20", "5,000,000", "8", "3"),
    ])
    header, units, data = ncu.read_rows(path)
    rows, total = ncu.summarize(header, units, data, stalls=True)
    assert total == pytest.approx(80_000.0)  # microseconds converted to ns
    first = rows[0]
    assert (first["kernel"], first["grid"], first["launches"]) == ("gemv_q", "396", 2)
    assert first["mean_ns"] == pytest.approx(25_000.0)
    assert first["share"] == pytest.approx(50_000 / 80_000)
    assert first["read_bytes"] == pytest.approx(12_000_000)
    assert first["read_tb_s"] == pytest.approx(12_000_000 / 25_000 / 1e3)
    assert first["stalls"][0] == ("no_instruction", pytest.approx(3.0))
    shapes = {(r["kernel"], r["grid"]) for r in rows}
    assert shapes == {("gemv_q", "396"), ("gemv_q", "17"), ("moe_down", "256")}


def test_missing_header_is_a_clear_error(tmp_path):
    p = tmp_path / "bad.csv"
    p.write_text("==PROF== nothing profiled\n")
    with pytest.raises(SystemExit, match="Kernel Name"):
        ncu.read_rows(str(p))
