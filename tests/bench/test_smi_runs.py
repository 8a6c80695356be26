"""scripts/smi_runs.py on nvidia-smi samples written here: each run's window and its last seconds,
plain and xz files, lines it cannot read skipped, and the HBM temperature where sampled."""
import importlib.util
import lzma
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("smi_runs", os.path.join(ROOT, "scripts", "smi_runs.py"))
smi = importlib.util.module_from_spec(spec)
spec.loader.exec_module(smi)


def write(tmp_path, xz=False):
    lines = ["Failed to query something"]  # nvidia-smi's own message: skipped
    for i in range(400):  # 8 s from 10:00:00, a sample every 20 ms
        t = 36000 + i * 0.02
        clock = 1980 if t < 36007 else 1755  # the last second at a lower clock
        lines.append(f"2026/12/08 {int(t // 3600):02d}:{int(t % 3600 // 60):02d}:{t % 60:06.3f}, {clock} MHz, 2619 MHz, {300 + i % 3}.00 W, 41")
    text = "\n".join(lines) + "\n"
    p = tmp_path / ("smi.csv.xz" if xz else "smi.csv")
    if xz:
        with lzma.open(p, "wt") as f:
            f.write(text)
    else:
        p.write_text(text)
    runs = tmp_path / "runs.txt"
    runs.write_text("10:00:00.000000000 main p4096 r1\n10:00:04.000000000 sx p4096 r1\n")
    return str(p), str(runs)


def test_each_run_gets_its_window_and_its_tail(tmp_path):
    for xz in (False, True):
        out = smi.report(*write(tmp_path, xz), last=1.0)
        assert len(out) == 2
        main, sx = out
        assert main.startswith("main p4096 r1") and "  4.0 s" in main
        assert "all: SM 1980 MHz (min 1980), power 301 W (max 302), 200 samples" in main
        # sx: 10:00:04 to the last sample; its last second is all at the lower clock.
        assert "all: SM 1980 MHz (min 1755)" in sx and "200 samples" in sx
        assert "last 1 s: SM 1755 MHz (min 1755)" in sx and "50 samples" in sx.split("last")[1]


def test_the_hbm_temperature_where_sampled(tmp_path):
    lines = [f"2026/12/08 10:00:{i * 0.5:06.3f}, 1980 MHz, 2619 MHz, 300.00 W, 41, {44 + i}" for i in range(4)]
    lines.append("2026/12/08 10:00:02.000, 1980 MHz, 2619 MHz, 300.00 W, 41, [N/A]")
    (tmp_path / "smi.csv").write_text("\n".join(lines) + "\n")
    (tmp_path / "runs.txt").write_text("10:00:00.000000000 main\n")
    (out,) = smi.report(str(tmp_path / "smi.csv"), str(tmp_path / "runs.txt"), last=1.0)
    assert "HBM max 47 C, 5 samples" in out.split("|")[1]
