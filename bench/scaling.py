"""Scaling efficiency from the step bench's logs in one folder (bench/multi_gpu_bench.sh's $OUT):

    python bench/scaling.py DIR [NAME]

NAME (default bench_fa3) is the bench at N GPUs. Its one-GPU rows are NAME_1.txt (fa3_1: GPU 0 alone) and
NAME_each_gpu*.txt (fa3_each: every GPU alone at once, on the same micro-batches), whichever are there. For each
one-GPU row it prints, per stage and over the schedule (its stages have equal steps), tokens/s per GPU at N over
that at 1, and marks the row of the slowest GPU alone. Synchronous data parallelism runs at its slowest GPU's pace:
measured against a faster GPU, the chips' own spread counts as lost scaling (two 2xH200, 2026-11-28: the same code
97.8% or 94.5% by which GPU ran the one-GPU row, docs/performance.md).
"""
import re
import sys
from pathlib import Path

STAGE = re.compile(r"^\s+(\d+)\s+(\d+)\s+\(\d+, \d+\)\s+([\d.]+)\s", re.M)
WORLD = re.compile(r"world size (\d+)")
GPU = re.compile(r"_gpu(\d+)\.txt$")


class BadInput(Exception):
    pass


def read_bench(path: Path) -> tuple[int, list[tuple[int, float]]]:
    """A step bench log's world size and, per stage, its micro-batches per rank and mean step ms."""
    if not path.is_file():
        raise BadInput(f"{path}: not found; give the folder of a bench run (bench/multi_gpu_bench.sh's $OUT)")
    text = path.read_text(errors="replace")
    world = WORLD.search(text)
    stages = [(int(micro), float(ms)) for _, micro, ms in STAGE.findall(text)]
    if not world or not stages:
        raise BadInput(f"{path}: no step bench results in it (a bench that failed or ran out of time?)")
    return int(world.group(1)), stages


def efficiencies(n_gpus: int, at_n: list[tuple[int, float]], at_1: list[tuple[int, float]]) -> list[float]:
    """Per stage and then over the schedule: tokens/s per GPU at n_gpus over tokens/s at one GPU."""
    if [micro * n_gpus for micro, _ in at_n] != [micro for micro, _ in at_1]:
        raise BadInput(f"the stages' micro-batches differ: {[m for m, _ in at_n]} per rank at {n_gpus} GPUs against "
                       f"{[m for m, _ in at_1]} at one; compare benches of one schedule")
    per_stage = [one / (n_gpus * many) for (_, many), (_, one) in zip(at_n, at_1)]
    schedule = sum(one for _, one in at_1) / (n_gpus * sum(many for _, many in at_n))
    return per_stage + [schedule]


def report(folder: Path, name: str = "bench_fa3") -> list[str]:
    n_gpus, at_n = read_bench(folder / f"{name}.txt")
    ones = {}  # label -> stages, one GPU alone
    if (folder / f"{name}_1.txt").exists():
        ones[f"GPU 0 alone ({name}_1)"] = read_bench(folder / f"{name}_1.txt")[1]
    each = {int(GPU.search(path.name).group(1)): path for path in folder.glob(f"{name}_each_gpu*.txt")}
    for gpu in sorted(each):
        ones[f"GPU {gpu} alone (fa3_each)"] = read_bench(each[gpu])[1]
    if not ones:
        raise BadInput(f"{folder}: no one-GPU bench beside {name}.txt (run fa3_1 or fa3_each with it)")
    lines = [f"{name} at {n_gpus} GPUs: " + " / ".join(f"{ms:.1f}" for _, ms in at_n) + " ms by stage"]
    rows = {label: efficiencies(n_gpus, at_n, stages) for label, stages in ones.items()}
    slowest = max(ones, key=lambda label: sum(ms for _, ms in ones[label]))  # the longest schedule alone
    for label, row in rows.items():
        mark = "  <- the slowest GPU" if len(rows) > 1 and label == slowest else ""
        lines.append(f"  against {label}: " + " / ".join(f"{100 * e:.1f}%" for e in row[:-1])
                     + f" by stage, {100 * row[-1]:.1f}% over the schedule{mark}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python bench/scaling.py DIR [NAME]", file=sys.stderr)
        return 2
    try:
        for line in report(Path(argv[0]), *argv[1:]):
            print(line)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
