"""What two runs' graph cache keys differ in (bench/startup_bench.sh with AUTOTUNE_PROBE=1):
    python3 compare_keys.py WRITE_DIR LOAD_DIR
Each DIR holds the probe's KIND_N.json files of one run (AUTOTUNE_PROBE_KEYS). For each kind (aot: AOTAutograd's key,
fx: inductor's FX graph key) it counts the load's keys the write also computed; for each key of the load the write
lacks, it pairs it with the write's key of the same rank and prints the hash details that differ, with a diff of
their values."""
import difflib
import json
import pathlib
import re
import sys

DETAIL = re.compile(r"\[(\w+)\] ([^:]+): ", re.S)


def read(folder: pathlib.Path, kind: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{kind}_*.json"))]


def details(entry: dict) -> dict[str, tuple[str, str]]:
    """name -> (hash, value) of each line '[hash] name: value'."""
    out = {}
    for line in entry["details"]:
        m = DETAIL.match(line)
        if m:
            out[m.group(2)] = (m.group(1), line[m.end():])
    return out


def main(write_dir: str, load_dir: str, most: int = 3) -> None:
    for kind in ("aot", "fx"):
        write, load = read(pathlib.Path(write_dir), kind), read(pathlib.Path(load_dir), kind)
        known = {e["key"] for e in write}
        missing = [i for i, e in enumerate(load) if e["key"] not in known]
        print(f"{kind}: the load computed {len(load)} keys, {len(load) - len(missing)} of them also the write's "
              f"(which computed {len(write)})")
        for i in missing[:most]:
            if i >= len(write):
                print(f"  key {i + 1}: the write computed no key of that rank")
                continue
            ours, theirs = details(write[i]), details(load[i])
            print(f"  key {i + 1}: write {write[i]['key'][:13]}, load {load[i]['key'][:13]}; details that differ:")
            for name in sorted(set(ours) | set(theirs)):
                a, b = ours.get(name, ("absent", "")), theirs.get(name, ("absent", ""))
                if a[0] == b[0]:
                    continue
                print(f"    {name}: write [{a[0][:12]}] load [{b[0][:12]}]")
                diff = list(difflib.unified_diff(a[1].splitlines(), b[1].splitlines(), "write", "load", n=1,
                                                 lineterm=""))[2:]
                for line in diff[:24]:
                    print(f"      {line[:240]}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
