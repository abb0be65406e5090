"""Decompress the carried copies of a benchmark stream, SRC/*.bin.xz, into DST once (default: .bench, copies of
../shared/bench, into /tmp/bench; `python3 bench/unpack_bench.py .bench2 /tmp/bench2` for ../shared/bench2)."""
import lzma
import pathlib
import sys

src, dst = (sys.argv[1:3] if len(sys.argv) > 2 else (".bench", "/tmp/bench"))
out = pathlib.Path(dst)
out.mkdir(exist_ok=True)
for xz in sorted(pathlib.Path(src).glob("*.bin.xz")):
    target = out / xz.name[:-3]
    if not target.exists():
        target.write_bytes(lzma.decompress(xz.read_bytes()))
