"""Decompress the carried copies of a benchmark stream, SRC/*.bin.xz, into DST once (default: .bench2, copies of
../shared/bench2, into /tmp/bench2)."""
import lzma
import pathlib
import sys

src, dst = (sys.argv[1:3] if len(sys.argv) > 2 else (".bench2", "/tmp/bench2"))
out = pathlib.Path(dst)
out.mkdir(exist_ok=True)
for xz in sorted(pathlib.Path(src).glob("*.bin.xz")):
    target = out / xz.name[:-3]
    if not target.exists():
        target.write_bytes(lzma.decompress(xz.read_bytes()))
