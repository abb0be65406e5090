"""data/cached_fineweb10B.py with a fake hub: downloads, skips, repairs, and fails in one clear line."""
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO, load_script, write_shard

fw = load_script("data/cached_fineweb10B.py")


def fake_hub(calls):
    def download(name, dest, dataset):
        calls.append(name)
        write_shard(dest / name, np.full(50, 50256))
    return download


def test_downloads_missing_and_keeps_valid(tmp_path):
    calls = []
    fw.fetch(2, tmp_path, download=fake_hub(calls), progress=False)
    assert calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    calls.clear()
    report = fw.fetch(3, tmp_path, download=fake_hub(calls), progress=False)
    assert calls == ["fineweb_train_000003.bin"]
    assert report[0] == "fineweb_val_000000.bin: ok (cached)"


def test_corrupt_shard_is_downloaded_again(tmp_path):
    write_shard(tmp_path / "fineweb_val_000000.bin", np.arange(100))
    (tmp_path / "fineweb_val_000000.bin").write_bytes((tmp_path / "fineweb_val_000000.bin").read_bytes()[:-6])
    calls = []
    fw.fetch(0, tmp_path, download=fake_hub(calls), progress=False)
    assert calls == ["fineweb_val_000000.bin"]


def test_bad_download_is_an_error(tmp_path):
    def broken(name, dest, dataset):
        (dest / name).write_bytes(b"<html>rate limited</html>")
    with pytest.raises(fw.DownloadError, match="is not a valid shard: .*too short"):
        fw.fetch(1, tmp_path, download=broken, progress=False)


def test_unreachable_hub_is_one_line(tmp_path):
    pytest.importorskip("huggingface_hub")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the hub client then fails at once, as with no network
    result = subprocess.run([sys.executable, str(REPO / "data" / "cached_fineweb10B.py"), "1", "--dir", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "cannot download fineweb_val_000000.bin from the Hugging Face hub" in lines[0]


def test_shard_count_is_checked(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "data" / "cached_fineweb10B.py"), "500", "--dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "train shards 1..103" in result.stderr
