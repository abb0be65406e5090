"""Streaming DiLoCo against data parallelism at equal tokens, on the CPU (not run by the test suite):

    eval "$(../shared/gpt2/use_offline.sh)"   # tiktoken's GPT-2 files, to decode the token shards to text
    python bench/bench_diloco_quality.py 'TRAIN_SHARDS' 'VAL_SHARD' [STEPS] [CONFIGS]

The shards (GPT-2 tokens, e.g. ../shared/bench2's) are decoded back to text and re-encoded as bytes (vocabulary
257, BOS 256), so the tiny model trains on real text at CPU speed. Each configuration trains the tiny preset for STEPS
steps (default 320) on data that does not repeat, and prints its final validation loss:
  dp           plain data parallelism on 2 processes, twice a replica's batch (the same tokens as 2 replicas);
  LR:MOMENTUM[:H]  2 DiLoCo replicas of 1 process each (a lighthouse on this machine), --sync_every=H (default 8)
               --num_fragments=2, that outer lr and Nesterov momentum (1.0:0 is plain averaging).
CONFIGS is a comma-separated list (default dp,0.7:0,1.0:0); each may add train_gpt.py flags after "+", e.g.
dp+adam_period=1 or 0.7:0+seed=1. Needs torchft for the DiLoCo runs.
"""
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
import train_gpt as tg  # noqa: E402
from helpers import free_port, write_shard  # noqa: E402

BYTE_BOS = 256


def byte_shard(paths: list[str], out: Path, max_bytes: int, piece: int = 127) -> int:
    """Decode GPT-2 token shards document by document and write their UTF-8 bytes as a shard, in pieces of at most
    `piece` bytes each after a BOS (under the tiny preset's document length, so no text is cut away; the figures in
    docs/performance.md used 127)."""
    import tiktoken
    encoding = tiktoken.get_encoding("gpt2")
    pieces, total = [], 0
    for path in paths:
        tokens = tg.read_shard(path)
        starts = np.flatnonzero(tokens == 50256).tolist() + [len(tokens)]
        for start, end in zip(starts, starts[1:]):
            text = np.frombuffer(encoding.decode(tokens[start + 1: end].tolist()).encode("utf-8"), dtype=np.uint8)
            for first in range(0, len(text), piece):
                pieces.append(np.concatenate([[BYTE_BOS], text[first: first + piece]]).astype(np.uint16))
                total += len(pieces[-1])
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    tokens = np.concatenate(pieces)[:max_bytes]
    write_shard(out, tokens)
    return len(tokens)


def final_val_loss(log: str) -> float:
    return float(re.findall(r"^step:\d+/\d+ val_loss:(\S+)", log, re.M)[-1])


def main():
    train_glob, val_glob = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 320
    configs = (sys.argv[4] if len(sys.argv) > 4 else "dp,0.7:0,1.0:0").split(",")
    work = Path(tempfile.mkdtemp(prefix="diloco_quality_"))
    # tiny preset: 8/8/16 micro-batches of 256 tokens per replica and step; two replicas read twice that
    need = 2 * steps * 16 * 257 * 2  # a micro-batch's last piece is cut, and the rest of it skipped
    train_bytes = byte_shard(sorted(glob.glob(train_glob)), work / "train.bin", need)
    val_bytes = byte_shard(sorted(glob.glob(val_glob)), work / "val.bin", 200_000)
    print(f"{train_bytes:,} train bytes, {val_bytes:,} val bytes, {steps} steps, in {work}", flush=True)
    common = ["--device=cpu", "--preset=tiny", "--vocab_size=257", f"--bos_token={BYTE_BOS}",
              f"--train_files={work / 'train.bin'}", f"--val_files={work / 'val.bin'}", f"--num_iterations={steps}",
              "--val_loss_every=0", "--val_tokens=131072", f"--log_dir={work}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for config in configs:
        started = time.time()
        base, *extra = config.split("+")
        flags = [f"--{flag}" for flag in extra]
        if base == "dp":
            name = "dp" + "".join(f"_{flag.split('=')[0]}" for flag in extra)
            run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                  str(REPO / "train_gpt.py"), *common, "--batch_schedule=16,16,32", f"--run_id={name}",
                                  *flags], env=env, capture_output=True, text=True)
            assert run.returncode == 0, run.stderr[-3000:]
            losses = [final_val_loss((work / f"{name}.txt").read_text())]
        else:
            from torchft.coordination import LighthouseServer
            outer_lr, momentum, sync_every = (base.split(":") + ["8"])[:3]
            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
            name = f"diloco_{outer_lr}_{momentum}_{sync_every}" + "".join(f"_{flag.split('=')[0]}" for flag in extra)
            procs = [subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}",
                 str(REPO / "train_gpt.py"), *common, "--diloco=1", f"--replica={r}", f"--sync_every={sync_every}",
                 "--num_fragments=2", f"--outer_lr={outer_lr}", f"--outer_momentum={momentum}", f"--run_id={name}_{r}",
                 *flags],
                env=dict(env, TORCHFT_LIGHTHOUSE=lighthouse.address()), stdout=subprocess.DEVNULL,
                stderr=open(work / f"{name}_{r}.err", "w")) for r in range(2)]
            codes = [p.wait() for p in procs]
            lighthouse.shutdown()
            assert codes == [0, 0], f"replicas ended with {codes}: see {work}/{name}_*.err"
            losses = [final_val_loss((work / f"{name}_{r}.txt").read_text()) for r in range(2)]
        print(f"{config}: final val loss {' / '.join(f'{loss:.4f}' for loss in losses)} "
              f"({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
