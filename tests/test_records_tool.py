"""records/tool.py on logs written by the trainer's own RunLog and on synthetic ones."""
import hashlib
import math
import subprocess
import sys

import numpy as np
import pytest

import train_gpt as tg
from helpers import REPO, load_script

tool = load_script("records/tool.py")
CODE = 'print("hello")\n# a line that looks like a section end:\n==== end code ====\nx = 1\n'


def synthetic_log(path, code=CODE, val_losses=(10.8, 4.0, 3.27), step_ms=50.0, hardware="8x NVIDIA H100 80GB HBM3",
                  complete=True, train_files="data/fineweb10B/fineweb_train_*.bin"):
    """A log in train_gpt.py's layout: 100 steps, validation every 50."""
    lines = ["#### train_gpt.py log v1 run_id=x",
             f"==== code train_gpt.py sha256={hashlib.sha256(code.encode()).hexdigest()} lines={len(code.splitlines())} ====",
             *code.splitlines(), "==== end code ====", "==== environment ====", "python: 3.12.3",
             f"hardware: {hardware}", "==== nvidia-smi ====", "not available", "==== config ====",
             f'config: {{"num_iterations": 100, "train_files": "{train_files}"}}', "==== training ====",
             "compile_time:9.4s graphs:12 cache_hits:0"]
    for step in range(101):
        if step % 50 == 0:
            lines.append(f"step:{step}/100 val_loss:{val_losses[step // 50]:.4f} train_time:{step * step_ms:.0f}ms "
                         f"step_avg:{step_ms:.2f}ms" + (" train_loss:4.5" if step else ""))
        if step < 100:
            lines.append(f"step:{step + 1}/100 train_time:{(step + 1) * step_ms:.0f}ms step_avg:{step_ms:.2f}ms")
    if complete:
        lines += ["peak memory allocated: 100 MiB reserved: 120 MiB", "==== end ===="]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, str(REPO / "records" / "tool.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=60)


def test_reads_what_the_trainer_writes(tmp_path):
    cfg = tg.Config(log_dir=str(tmp_path), run_id="real", device="cpu")
    log = tg.RunLog(cfg, tg.Comm())
    log("step:0/10 val_loss:10.8258 train_time:0ms step_avg:0.00ms")
    log("step:1/10 train_time:12ms step_avg:12.00ms")
    log("step:10/10 val_loss:5.5000 train_time:120ms step_avg:12.00ms train_loss:5.7")
    log.finish()
    run = tool.parse_log(tmp_path / "real.txt")
    assert run.code == (REPO / "train_gpt.py").read_text() and "==== end code ====" in run.code
    assert run.final.val_loss == 5.5 and run.final.train_time_ms == 120 and run.env["hardware"].startswith("1x cpu")
    assert run.config["run_id"] == "real"


def test_list_diff_compare(tmp_path):
    records = tmp_path / "records"
    for i, loss in enumerate((3.27, 3.29)):
        synthetic_log(records / "2026-01-01_First" / f"run{i}.txt", val_losses=(10.8, 4.0, loss))
    synthetic_log(records / "2026-02-01_Second" / "run.txt", code=CODE.replace("x = 1", "x = 2"), step_ms=40.0,
                  train_files="/tmp/bench2/docs_train_*.bin")
    listing = cli("list", "--records", records)
    assert listing.returncode == 0
    first = next(line for line in listing.stdout.splitlines() if line.startswith("2026-01-01_First"))
    assert "8x NVIDIA H100" in first and " 2 " in first and "3.2800" in first and "5.0" in first and "100" in first
    assert "FineWeb" in first  # each record says what it trained on; a record on other data is starred
    assert "*bench2/docs_train_*.bin" in listing.stdout and listing.stdout.splitlines()[-1] == tool.NOT_FINEWEB
    diff = cli("diff", records / "2026-01-01_First", records / "2026-02-01_Second")
    assert "-x = 1" in diff.stdout and "+x = 2" in diff.stdout
    (tmp_path / "mine.py").write_text(CODE.replace("hello", "bye"))
    assert '+print("bye")' in cli("diff", records / "2026-01-01_First", tmp_path / "mine.py").stdout
    compare = cli("compare", records / "2026-01-01_First", records / "2026-02-01_Second")
    assert compare.returncode == 0
    assert "50.00" in compare.stdout and "40.00" in compare.stdout and "3.2800" in compare.stdout
    assert "█" in compare.stdout and "▁" in compare.stdout
    # the names in full once, then the losses by number: two records of one date never read alike
    assert "[1]  2026-01-01_First" in compare.stdout and "[2]  2026-02-01_Second" in compare.stdout
    assert any(line.split() == ["step", "[1]", "[2]"] for line in compare.stdout.splitlines())


def student_t_cdf_by_integration(t, df):
    """The t density integrated numerically from -inf; x = tan(theta) makes the range finite."""
    theta = np.linspace(-math.pi / 2, math.atan(t), 2_000_001)[1:]
    x = np.tan(theta)
    logpdf = (math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
              - (df + 1) / 2 * np.log1p(x * x / df))
    y = np.exp(logpdf) / np.cos(theta) ** 2
    y = np.concatenate([[1 / math.pi if df == 1 else 0.0], y])  # the integrand's limit at -pi/2
    theta = np.concatenate([[-math.pi / 2], theta])
    return float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(theta)))


@pytest.mark.parametrize("losses", [[3.270, 3.275, 3.281, 3.268, 3.279], [3.29, 3.30, 3.27], [3.2, 3.1]])
def test_stats_p_value_matches_numeric_integration(losses):
    n = len(losses)
    t = (np.mean(losses) - 3.28) / (np.std(losses, ddof=1) / math.sqrt(n))
    assert math.isclose(tool.one_sided_p_value(losses, 3.28), student_t_cdf_by_integration(t, n - 1), rel_tol=1e-4)


def test_stats_command(tmp_path):
    logs = [synthetic_log(tmp_path / f"r{i}.txt", val_losses=(10.8, 4.0, loss), step_ms=ms)
            for i, (loss, ms) in enumerate([(3.270, 50), (3.275, 52), (3.281, 51)])]
    out = cli("stats", *logs).stdout
    assert "runs: 3" in out and "final val loss: 3.2753 ± 0.0055" in out and "train time: 5.10 ± 0.10 s" in out
    p = tool.one_sided_p_value([3.270, 3.275, 3.281], 3.28)
    assert f"p-value (mean val loss < 3.28): {p:.4g}" in out
    assert "needs at least 2 runs" in cli("stats", logs[0]).stderr
    others = [synthetic_log(tmp_path / f"b{i}.txt", train_files="/tmp/bench2/docs_train_*.bin") for i in range(2)]
    assert "runs on bench2/docs_train_*.bin are not on FineWeb" in cli("stats", *others).stdout


def test_extract_round_trip_and_refusals(tmp_path):
    log = synthetic_log(tmp_path / "run.txt")
    assert cli("extract", log).stdout == CODE
    out = tmp_path / "code.py"
    assert cli("extract", log, "-o", out).returncode == 0 and out.read_text() == CODE
    again = cli("extract", log, "-o", out)
    assert again.returncode == 1 and "exists; pass --force" in again.stderr
    # a record directory: its logs' one code, or one line when they ran different code
    record = tmp_path / "record"
    record.mkdir()
    synthetic_log(record / "a.txt")
    synthetic_log(record / "b.txt")
    assert cli("extract", record).stdout == CODE
    synthetic_log(record / "b.txt", code=CODE.replace("x = 1", "x = 2"))
    mixed = cli("extract", record)
    assert mixed.returncode == 1 and mixed.stderr.strip() == f"error: {record}: its 2 logs ran different code; name one of them"


@pytest.mark.parametrize("cut, message", [(6, "code block ends early: header says 4 lines"),
                                          (40, "log is truncated: no '==== end ===='")])
def test_truncated_logs_are_named_errors_and_write_nothing(tmp_path, cut, message):
    full = synthetic_log(tmp_path / "full.txt").read_text().splitlines()
    log = tmp_path / "cut.txt"
    log.write_text("\n".join(full[:cut]) + "\n")
    out = tmp_path / "never.py"
    result = cli("extract", log, "-o", out)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: {log}:") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()
    assert message in cli("stats", log, log).stderr


def test_edited_code_fails_the_checksum(tmp_path):
    log = synthetic_log(tmp_path / "run.txt")
    log.write_text(log.read_text().replace("x = 1", "x = 3"))
    result = cli("extract", log)
    assert result.returncode == 1 and "does not match its sha256" in result.stderr


def test_bad_step_line_is_named(tmp_path):
    log = synthetic_log(tmp_path / "run.txt")
    log.write_text(log.read_text().replace("step:7/100 train_time:350ms", "step:7/100 train_time:oops"))
    result = cli("stats", log, log)
    assert result.returncode == 1 and f"{log}:" in result.stderr and "bad step line" in result.stderr


def test_png_needs_matplotlib(tmp_path):
    pytest.importorskip("numpy")
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed here")
    except ImportError:
        pass
    log = synthetic_log(tmp_path / "run.txt")
    result = cli("compare", log, "--png", tmp_path / "plot.png")
    assert result.returncode == 1 and "matplotlib is not installed" in result.stderr and result.stdout == ""
