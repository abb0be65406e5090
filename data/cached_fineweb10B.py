"""Download the GPT-2-tokenized FineWeb10B shards (Hugging Face dataset kjj0/fineweb10B-gpt2).

    python data/cached_fineweb10B.py 9      # the val shard and the first 9 train shards (900M tokens)
    python data/cached_fineweb10B.py 103    # all of FineWeb10B

Shards land in data/fineweb10B/ (--dir to change). A shard already there with a valid header and size
is kept; an invalid one is downloaded again; every download is checked before the next starts.
"""
import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DATASET = "kjj0/fineweb10B-gpt2"
TRAIN_SHARDS = 103  # 100M tokens each


def shard_names(num_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def shard_problem(path: Path) -> str | None:
    """Why a local shard is unusable, or None if it is fine."""
    if not path.exists():
        return "missing"
    # The trainer's own shard checks, imported only where there is a shard to check: importing torch takes seconds,
    # which a wrong argument or an unreachable hub need not wait for.
    from train_gpt import DataError, read_shard
    try:
        read_shard(str(path))
    except DataError as e:
        return str(e)
    return None


class DownloadError(Exception):
    pass


def hub_download(name: str, dest: Path, dataset: str) -> None:
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise DownloadError("huggingface_hub is not installed: pip install -r requirements.txt") from None
    try:
        hf_hub_download(repo_id=dataset, filename=name, repo_type="dataset", local_dir=str(dest))
    except Exception as e:  # the hub client raises many types (HTTP, connection, offline cache misses)
        raise DownloadError(f"cannot download {name} from the Hugging Face hub ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}). Check the network or HF_ENDPOINT; "
                            "shards already downloaded are kept") from None


def fetch(num_train: int, dest: Path, dataset: str = DATASET, download=hub_download, progress=True) -> list[str]:
    """Make sure the val shard and the first num_train train shards are in dest; returns what was done."""
    from tqdm import tqdm
    dest.mkdir(parents=True, exist_ok=True)
    done = []
    for name in tqdm(shard_names(num_train), desc="shards", unit="shard", disable=not progress):
        path = dest / name
        problem = shard_problem(path)
        if problem is None:
            done.append(f"{name}: ok (cached)")
            continue
        if problem != "missing":
            tqdm.write(f"{name}: downloading again ({problem})")
            path.unlink()
        download(name, dest, dataset)
        problem = shard_problem(path)
        if problem is not None:
            raise DownloadError(f"downloaded {path} is not a valid shard: {problem}")
        done.append(f"{name}: downloaded")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("num_train", type=int, help=f"how many train shards (1..{TRAIN_SHARDS}) besides the val shard")
    parser.add_argument("--dir", type=Path, default=REPO / "data" / "fineweb10B", help="where the shards go")
    parser.add_argument("--dataset", default=DATASET, help="Hugging Face dataset repository")
    args = parser.parse_args(argv)
    if not 1 <= args.num_train <= TRAIN_SHARDS:
        parser.error(f"num_train={args.num_train}: FineWeb10B has train shards 1..{TRAIN_SHARDS}")
    try:
        for line in fetch(args.num_train, args.dir, args.dataset):
            print(line)
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"shards are in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
