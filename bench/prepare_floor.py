"""The read+write floor of `keel data prepare`: read every input file as stored (gzip-compressed ones
decompressed), then write files of the given sizes from those bytes. No parsing, cleaning or tokenizing: what any
program that turns these inputs into that output pays at least. Imports nothing beyond the standard library.

  python bench/prepare_floor.py FILE_LIST SIZES_JSON OUT_DIR
"""

import gzip
import json
import os
import sys


def main() -> None:
    files, sizes, out = sys.argv[1], sys.argv[2], sys.argv[3]
    chunks = []
    with open(files) as listing:
        for path in listing.read().splitlines():
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rb") as f:
                chunks.append(f.read())
    data = memoryview(b"".join(chunks))
    os.makedirs(out, exist_ok=True)
    at = 0
    with open(sizes) as f:
        wanted = json.load(f)
    for name, size in wanted.items():
        with open(os.path.join(out, name), "wb") as f:
            left = size
            while left:
                take = min(left, len(data) - at)
                f.write(data[at:at + take])
                left -= take
                at = (at + take) % len(data)


if __name__ == "__main__":
    main()
