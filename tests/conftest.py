"""pytest setup: the repository and tests/ on sys.path, frozen imports, and tiny-data fixtures."""
import gc
import os
import sys
from pathlib import Path

import pytest

# Under pytest-xdist (README: one worker per core) every worker, and every process a test starts, computes on one
# thread: OpenMP's threads spin while they wait, so two workers' pools of a thread per core would oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # train_gpt
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helpers

from helpers import learnable_documents, write_shard  # noqa: E402


def write_tiny_data(data: Path) -> tuple[str, str]:
    """Two train shards and a val shard in data/; returns the (train, val) glob patterns."""
    data.mkdir()
    write_shard(data / "tiny_train_000001.bin", learnable_documents(60_000, seed=1))
    write_shard(data / "tiny_train_000002.bin", learnable_documents(60_000, seed=2))
    write_shard(data / "tiny_val_000000.bin", learnable_documents(8_000, seed=3))
    return str(data / "tiny_train_*.bin"), str(data / "tiny_val_*.bin")


# The slowest files, slowest first (about 100, 70, 50, 35 and 20 s of the suite's 300): pytest-xdist hands out whole
# files in the order collected once its reordering by test count is off, so no long file starts last.
SLOW_FILES = ("test_runs.py", "test_diloco.py", "test_compile.py", "test_checkpoint.py", "test_train.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist 3.8+
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable: a file's own order stays


@pytest.fixture
def tiny_data(tmp_path):
    """Two train shards and a val shard; returns the (train, val) glob patterns."""
    return write_tiny_data(tmp_path / "data")


@pytest.fixture(scope="module")
def module_tiny_data(tmp_path_factory):
    """The same data, written once for a test module whose tests share runs on it."""
    return write_tiny_data(tmp_path_factory.mktemp("shared") / "data")


@pytest.fixture(scope="session", autouse=True)
def frozen_imports():
    """What the collection imported (torch, the trainer, the test modules), frozen for the garbage collector once, at the
    first test: a trainer run's full collection then walks only the objects made since (it leaves a caller's freeze
    alone), where walking everything took about 0.4 s a run."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
