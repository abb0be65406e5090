"""bench/scaling.py: scaling efficiency from the step bench's logs, against each one-GPU row and the slowest GPU's."""
import pytest

from helpers import load_script


def bench_log(world_size: int, stages: list[tuple[int, float]]) -> str:
    """The lines of a bench_step.py log that scaling.py reads: the model line and one line per stage."""
    lines = [f"model: 1,000 parameters, attention backend fa3, compute dtype torch.bfloat16, world size {world_size}, "
             "8 micro-batch(es) of 16384 tokens per forward",
             "stage micro     windows  step ms max/med      tok/s    MFU  phase split (ms per step)"]
    windows = ["(128, 384)", "(384, 896)", "(640, 1408)"]
    for stage, (micro, ms) in enumerate(stages):
        lines.append(f"{stage:>5} {micro:>5} {windows[stage]:>11} {ms:8.1f}    1.01    640,000  45.0%  forward 1.0")
        lines.append(f"{'':>31}Adam steps {ms + 1:.1f} ms (forward 1.0); the others {ms - 1:.1f} ms")
    return "\n".join(lines) + "\n"


def test_scaling_against_each_gpu_and_the_slowest(tmp_path):
    scaling = load_script("bench/scaling.py")
    (tmp_path / "bench_fa3.txt").write_text(bench_log(2, [(4, 110.0), (8, 210.0), (12, 320.0)]))
    (tmp_path / "bench_fa3_each_gpu0.txt").write_text(bench_log(1, [(8, 200.0), (16, 400.0), (24, 600.0)]))
    (tmp_path / "bench_fa3_each_gpu1.txt").write_text(bench_log(1, [(8, 209.0), (16, 410.0), (24, 620.0)]))
    assert scaling.report(tmp_path) == [
        "bench_fa3 at 2 GPUs: 110.0 / 210.0 / 320.0 ms by stage",
        "  against GPU 0 alone (fa3_each): 90.9% / 95.2% / 93.8% by stage, 93.8% over the schedule",
        "  against GPU 1 alone (fa3_each): 95.0% / 97.6% / 96.9% by stage, 96.8% over the schedule  <- the slowest GPU"]
    (tmp_path / "bench_fa3_1.txt").write_text(bench_log(1, [(8, 200.0), (16, 400.0), (24, 600.0)]))
    assert scaling.report(tmp_path)[1] == ("  against GPU 0 alone (bench_fa3_1): 90.9% / 95.2% / 93.8% by stage, 93.8% "
                                           "over the schedule")


def test_scaling_refuses_what_it_cannot_compare(tmp_path, capsys):
    scaling = load_script("bench/scaling.py")
    (tmp_path / "bench_fa3.txt").write_text(bench_log(2, [(4, 110.0), (8, 210.0), (12, 320.0)]))
    with pytest.raises(scaling.BadInput, match=r"no one-GPU bench beside bench_fa3\.txt \(run fa3_1 or fa3_each"):
        scaling.report(tmp_path)
    (tmp_path / "bench_fa3_1.txt").write_text(bench_log(1, [(8, 200.0), (8, 400.0), (24, 600.0)]))
    with pytest.raises(scaling.BadInput, match=r"^the stages' micro-batches differ: \[4, 8, 12\] per rank at 2 GPUs "
                                               r"against \[8, 8, 24\] at one"):
        scaling.report(tmp_path)
    (tmp_path / "bench_fa3_1.txt").write_text("Traceback (most recent call last):\n")
    assert scaling.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'bench_fa3_1.txt'}: no step bench results in it (a bench "
                                       "that failed or ran out of time?)\n")
    assert scaling.main([str(tmp_path / "missing")]) == 1
    assert "missing/bench_fa3.txt: not found; give the folder of a bench run" in capsys.readouterr().err
