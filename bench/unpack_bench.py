"""Decompress .bench/*.bin.xz (copies of ../shared/bench, carried to the device) into /tmp/bench once."""
import lzma
import pathlib

out = pathlib.Path("/tmp/bench")
out.mkdir(exist_ok=True)
for xz in sorted(pathlib.Path(".bench").glob("*.bin.xz")):
    target = out / xz.name[:-3]
    if not target.exists():
        target.write_bytes(lzma.decompress(xz.read_bytes()))
