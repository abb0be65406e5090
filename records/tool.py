"""Compare train_gpt.py runs and records. Standard library + numpy; matplotlib only for --png.

    python records/tool.py list                       # every record: hardware, runs, mean loss and time
    python records/tool.py diff A [B]                 # code diff of two records/logs/.py files (B: ./train_gpt.py)
    python records/tool.py compare A B ...            # step_avg, time, val loss at common steps, loss curves
    python records/tool.py stats LOGS_OR_DIRS ...     # mean/std and the one-sided t-test p-value vs --target
    python records/tool.py extract LOG [-o FILE]      # the exact train_gpt.py a log (or a record's logs) ran

A, B, ... are record directories (records/<date>_<name>/ with *.txt logs), log files, or (for diff) .py files.
A log that is malformed or cut off (no final "==== end ====") is an error naming the file and line; so is a failed
run's log ("==== failed ===="), with the error that ended it.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

RECORDS = Path(__file__).resolve().parent
REPO = RECORDS.parent
CODE_HEADER = re.compile(r"^==== code train_gpt\.py sha256=([0-9a-f]{64}) lines=(\d+) ====$")
STEP = re.compile(r"^step:(\d+)/(\d+)( val_loss:(\S+))? train_time:(\d+)ms step_avg:(\S+)ms(?: \S+:\S+)*$")
SECTION = re.compile(r"^==== (\S+) ====$")


class ToolError(Exception):
    pass


@dataclass
class Step:
    step: int
    total: int
    val_loss: float | None
    train_time_ms: int
    step_avg_ms: float


@dataclass
class Run:
    path: Path
    code: str
    sha256: str
    env: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)

    @property
    def validations(self) -> list[Step]:
        return [s for s in self.steps if s.val_loss is not None]

    @property
    def final(self) -> Step:
        return self.validations[-1]


def parse_log(path: Path) -> Run:
    """Read a log written by train_gpt.py; any departure from its layout is a ToolError naming the line."""
    lines = Path(path).read_text(encoding="utf-8", errors="replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()

    def fail(number: int, message: str):
        raise ToolError(f"{path}:{number}: {message}")

    if not lines or not lines[0].startswith("#### train_gpt.py log v1"):
        fail(1, "not a train_gpt.py log (it must start with '#### train_gpt.py log v1')")
    header = CODE_HEADER.match(lines[1]) if len(lines) > 1 else None
    if header is None:
        fail(2, "expected '==== code train_gpt.py sha256=... lines=N ===='")
    count = int(header.group(2))
    code_lines = lines[2: 2 + count]
    if len(code_lines) < count or len(lines) <= 2 + count:
        fail(len(lines), f"code block ends early: header says {count} lines, the file stops after {len(code_lines)}")
    if lines[2 + count] != "==== end code ====":
        fail(3 + count, "expected '==== end code ====' after the code block")
    run = Run(path=Path(path), code="\n".join(code_lines) + "\n", sha256=header.group(1))
    section, ended, error = None, False, ""
    for number, line in enumerate(lines[3 + count:], start=4 + count):
        heading = SECTION.match(line)
        if heading:
            section = heading.group(1)
            if section == "failed":  # the trainer's last line before it is the error that ended the run
                fail(number, f"the run failed: {error or 'no error line'}")
            ended = section == "end"
            continue
        if ended and line.strip():
            fail(number, "text after '==== end ===='")
        if line.startswith("error: "):
            error = line
        if section == "environment" and ": " in line:
            key, value = line.split(": ", 1)
            run.env[key] = value
        elif section == "config" and line.startswith("config: "):
            try:
                run.config = json.loads(line[len("config: "):])
            except json.JSONDecodeError as e:
                fail(number, f"config line is not JSON ({e.msg})")
        elif section == "training" and line.startswith("step:"):
            m = STEP.match(line)
            if m is None:
                fail(number, f"bad step line: {line[:80]!r}")
            run.steps.append(Step(int(m.group(1)), int(m.group(2)), float(m.group(4)) if m.group(3) else None,
                                  int(m.group(5)), float(m.group(6))))
    if not ended:
        fail(len(lines), "log is truncated: no '==== end ====' line (the run crashed or was cut off)")
    if not run.validations:
        fail(len(lines), "log has no validation line (step:... val_loss:...)")
    return run


def data_of(run: Run) -> str:
    """The training data a run read, by its --train_files: "FineWeb", or the shards' folder and name, starred: its
    losses are not FineWeb's and say nothing about the 3.28 target."""
    files = run.config.get("train_files")
    if files is None:
        return "?"
    if "fineweb" in files.lower():
        return "FineWeb"
    path = Path(files)
    return f"*{path.parent.name}/{path.name}" if path.parent.name else f"*{path.name}"


NOT_FINEWEB = "* not FineWeb: these losses are not comparable with the 3.28 target"


def runs_of(target: str) -> list[Run]:
    """A record directory's logs, or a single log."""
    path = Path(target)
    if path.is_dir():
        logs = sorted(path.glob("*.txt"))
        if not logs:
            raise ToolError(f"{path}: no *.txt logs in this directory")
        return [parse_log(log) for log in logs]
    if not path.exists():
        raise ToolError(f"{path}: no such file or directory")
    return [parse_log(path)]


def code_of(target: str) -> tuple[str, str]:
    """(code, label) of a record directory, a log, or a .py file."""
    path = Path(target)
    if path.suffix == ".py":
        if not path.exists():
            raise ToolError(f"{path}: no such file")
        return path.read_text(encoding="utf-8"), str(path)
    runs = runs_of(target)
    if len({r.sha256 for r in runs}) > 1:
        print(f"warning: the logs in {path} ran different code; using {runs[0].path.name}", file=sys.stderr)
    return runs[0].code, str(runs[0].path)


# ------------------------------------------------------------------------------------------- statistics

def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast only below this point
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            numerator = 1.0
        elif i % 2 == 0:
            numerator = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            numerator = -((a + m) * (a + b + m) * x) / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + numerator * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + numerator / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


def student_t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return tail if t < 0 else 1.0 - tail


def one_sided_p_value(values: list[float], target: float) -> float:
    """p-value of the one-sample t-test with H1: mean < target."""
    values = np.asarray(values, dtype=float)
    std = values.std(ddof=1)
    if std == 0:
        return 0.0 if values.mean() < target else 1.0
    t = (values.mean() - target) / (std / math.sqrt(len(values)))
    return student_t_cdf(t, len(values) - 1)


# ------------------------------------------------------------------------------------------- commands

def sparkline(values: list[float], low: float, high: float) -> str:
    bars = "▁▂▃▄▅▆▇█"
    span = (high - low) or 1.0
    return "".join(bars[min(len(bars) - 1, int((v - low) / span * len(bars)))] for v in values)


def cmd_list(args):
    directory = Path(args.records)
    rows = []
    for record in sorted(p for p in directory.iterdir() if p.is_dir() and any(p.glob("*.txt"))):
        runs = runs_of(str(record))
        rows.append((record.name, runs[0].env.get("hardware", "?"), data_of(runs[0]), len(runs),
                     np.mean([r.final.val_loss for r in runs]), np.mean([r.final.train_time_ms for r in runs]) / 1000,
                     runs[0].final.total))
    if not rows:
        print(f"no records in {directory}")
        return
    print(f"{'record':40s} {'hardware':26s} {'data':24s} {'runs':>4s} {'val loss':>9s} {'time s':>8s} {'steps':>6s}")
    for name, hardware, data, n, loss, seconds, steps in rows:
        print(f"{name:40s} {hardware[:26]:26s} {data[:24]:24s} {n:4d} {loss:9.4f} {seconds:8.1f} {steps:6d}")
    if any(row[2].startswith("*") for row in rows):
        print(NOT_FINEWEB)


def cmd_diff(args):
    a_code, a_label = code_of(args.a)
    b_code, b_label = code_of(args.b or str(REPO / "train_gpt.py"))
    sys.stdout.writelines(difflib.unified_diff(a_code.splitlines(True), b_code.splitlines(True), a_label, b_label))


def cmd_compare(args):
    """A record directory counts as the step-wise mean of its runs."""
    if args.png:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ToolError("matplotlib is not installed; pip install -r requirements-plot.txt for --png") from None
    groups = [(target, runs_of(target)) for target in args.targets]
    curves = []
    for target, runs in groups:
        common = set.intersection(*({s.step for s in r.validations} for r in runs))
        curve = {step: float(np.mean([next(s.val_loss for s in r.validations if s.step == step) for r in runs]))
                 for step in sorted(common)}
        curves.append(curve)
    shared = sorted(set.intersection(*(set(c) for c in curves)))
    print(f"{'':4s} {'run':40s} {'data':24s} {'runs':>4s} {'step_avg ms':>11s} {'time s':>8s} {'final val':>9s}")
    for number, ((target, runs), curve) in enumerate(zip(groups, curves), 1):
        print(f"{f'[{number}]':4s} {Path(target).name[:40]:40s} {data_of(runs[0])[:24]:24s} {len(runs):4d} "
              f"{np.mean([r.final.step_avg_ms for r in runs]):11.2f} "
              f"{np.mean([r.final.train_time_ms for r in runs]) / 1000:8.1f} {np.mean([r.final.val_loss for r in runs]):9.4f}")
    if any(data_of(runs[0]).startswith("*") for _, runs in groups):
        print(NOT_FINEWEB)
    if shared:
        print("\nval loss at common steps, by the runs' numbers above")
        print(f"{'step':>6s} " + " ".join(f"{f'[{n}]':>9s}" for n in range(1, len(groups) + 1)))
        for step in shared:
            print(f"{step:6d} " + " ".join(f"{c[step]:9.4f}" for c in curves))
    everything = [v for c in curves for v in c.values()]
    low, high = min(everything), max(everything)
    print(f"\nval loss curves ({low:.3f} .. {high:.3f})")
    for (target, _), curve in zip(groups, curves):
        print(f"{Path(target).name[:40]:40s} {sparkline(list(curve.values()), low, high)}")
    if args.png:
        for (target, _), curve in zip(groups, curves):
            plt.plot(list(curve), list(curve.values()), label=Path(target).name)
        plt.xlabel("step")
        plt.ylabel("val loss")
        plt.legend()
        plt.savefig(args.png)
        print(f"wrote {args.png}")


def cmd_stats(args):
    runs = [run for target in args.targets for run in runs_of(target)]
    if len(runs) < 2:
        raise ToolError(f"stats needs at least 2 runs, got {len(runs)}")
    losses = [r.final.val_loss for r in runs]
    seconds = [r.final.train_time_ms / 1000 for r in runs]
    print(f"runs: {len(runs)}")
    print(f"final val loss: {np.mean(losses):.4f} ± {np.std(losses, ddof=1):.4f}")
    print(f"train time: {np.mean(seconds):.2f} ± {np.std(seconds, ddof=1):.2f} s")
    print(f"p-value (mean val loss < {args.target}): {one_sided_p_value(losses, args.target):.4g}")
    if any(data_of(run).startswith("*") for run in runs):
        print(f"note: runs on {', '.join(sorted({data_of(run)[1:] for run in runs if data_of(run).startswith('*')}))}"
              f" are not on FineWeb: the test against {args.target} means nothing for them")


def cmd_extract(args):
    runs = runs_of(args.log)  # a log, or a record directory whose logs ran one code
    if len({run.sha256 for run in runs}) > 1:
        raise ToolError(f"{args.log}: its {len(runs)} logs ran different code; name one of them")
    run = runs[0]
    actual = hashlib.sha256(run.code.encode("utf-8")).hexdigest()
    if actual != run.sha256:
        raise ToolError(f"{args.log}:2: the code block does not match its sha256 (the log was edited or corrupted)")
    if args.output is None:
        sys.stdout.write(run.code)
        return
    out = Path(args.output)
    if out.exists() and not args.force:
        raise ToolError(f"{out} exists; pass --force to overwrite it")
    out.write_text(run.code, encoding="utf-8")
    print(f"wrote {out} (sha256 {actual[:12]}...)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="every record")
    p.add_argument("--records", default=str(RECORDS))
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("diff", help="unified diff of two runs' code")
    p.add_argument("a")
    p.add_argument("b", nargs="?")
    p.set_defaults(fn=cmd_diff)
    p = sub.add_parser("compare", help="side-by-side numbers and loss curves")
    p.add_argument("targets", nargs="+")
    p.add_argument("--png", help="also plot the curves to this file (needs matplotlib)")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("stats", help="mean, std and p-value of final val losses")
    p.add_argument("targets", nargs="+")
    p.add_argument("--target", type=float, default=3.28)
    p.set_defaults(fn=cmd_stats)
    p = sub.add_parser("extract", help="the code of a log")
    p.add_argument("log")
    p.add_argument("-o", "--output")
    p.add_argument("--force", action="store_true")
    p.set_defaults(fn=cmd_extract)
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
