"""What sharing in-flight counts costs a router's event loop (pdserve.control.inflight,
router.ledger): per record, the time to make it (a router's counts on every worker, 4
requests each; JSON, and with a cluster secret its HMAC), to read one (parse, verify,
check) and to merge it into the placement ledger, at 64 and 256 decode workers. No Redis:
the round trip is I/O, not the loop's CPU. Prints the CPU model and flags first.
usage: PYTHONPATH=. python docs/bench/placement_s81/inflight_cost.py"""
import platform
import re
import time
from pathlib import Path
from typing import Any

from pdserve.control.inflight import InflightBoard, InflightCounts
from pdserve.control.signing import RecordSigner
from router.ledger import PlacementLedger

cpu = Path("/proc/cpuinfo").read_text()
model = re.search(r"model name\s*:\s*(.*)", cpu)
flags = set(re.search(r"flags\s*:\s*(.*)", cpu).group(1).split())  # type: ignore[union-attr]
known = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
print(f"cpu: {model.group(1) if model else platform.processor()}; "
      f"{' '.join(f for f in known if f in flags)}")


class Registry:
    """What InflightBoard needs of a registry to make and read records (no Redis)."""

    def __init__(self, signer: RecordSigner | None) -> None:
        self.signer = signer

    def key(self, suffix: str) -> str:
        return "pdserve:bench:" + suffix

    class redis:
        @staticmethod
        def register_script(_: str) -> Any:
            return None


def per_call(fn: Any, n: int = 2000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


for workers in (64, 256):
    for signed in (False, True):
        board = InflightBoard(Registry(RecordSigner(b"k" * 32, "bench") if signed else None),
                              "me")  # type: ignore[arg-type]
        mine = PlacementLedger()
        for i in range(workers):
            for k in range(4):
                mine.place(f"r{i}-{k}", f"decode-{i}")
        raw = board._encode(InflightCounts("peer", *mine.shared(), 1))
        counts = board._decode(raw)
        other = PlacementLedger()
        for i in range(workers):
            other.place(f"x{i}", f"decode-{i}")
        make = per_call(lambda b=board, m=mine: b._encode(InflightCounts("peer", *m.shared(), 1)))
        read = per_call(lambda b=board, r=raw: b._decode(r))
        merge = per_call(lambda o=other, c=counts: o.merge([c]))  # type: ignore[misc]
        print(f"workers {workers}, {'signed' if signed else 'open mode'}: make {make * 1e6:.0f} us"
              f", read {read * 1e6:.0f} us, merge {merge * 1e6:.0f} us, record {len(raw)} bytes")
