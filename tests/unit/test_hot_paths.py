"""House rule, checked: no host copy on a hot path goes through torch's intra-op thread
pool (it spins for milliseconds on a busy host: a 256 KiB `copy_` measured 24 ms with two
threads, 25 us with one). The storage and transfer layers copy with
`transfer.copy.copy_bytes` (a single-threaded memcpy on the host, torch only for device
memory); this test fails if any of their modules calls torch's copy ops directly."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOT = ["kvstore", "transfer", "engine_adapter/connector.py"]
ALLOWED = {"transfer/copy.py"}  # the one helper
TORCH_COPY = re.compile(r"\.(copy_|index_copy_|index_select|index_put_)\(")


def hot_modules():
    for entry in HOT:
        path = ROOT / entry
        yield from ([path] if path.is_file() else sorted(path.rglob("*.py")))


def test_hot_path_modules_copy_through_the_one_helper():
    offenders = []
    for path in hot_modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if TORCH_COPY.search(line.split("#", 1)[0]):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "use transfer.copy.copy_bytes instead:\n" + "\n".join(offenders)


def test_the_rule_catches_a_torch_copy():
    assert TORCH_COPY.search("dst.copy_(src)") and TORCH_COPY.search("x.index_select(0, i)")
    assert not TORCH_COPY.search("copy_bytes(dst, src)")

