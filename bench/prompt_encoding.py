"""What a prompt's token ids cost the router on their way through it, timed alone.

    python -m bench.prompt_encoding [--tokens 1500] [--out docs/bench/prompt_encoding.json]

The router receives a prompt as protobuf (`pdserve.v1.Router/Generate`, token ids), makes it
Python ints (`GenerateRequest.prompt_token_ids`: placement hashes them) and sends it to a
decode worker as a `SessionRequest` on the worker's Session call (`router.clients`). Each
step is timed here on its own, back to back, in one process pinned to one CPU: the medians
of `--repeats` calls after a warm-up. `session_request_nested` is how 580e226 built the
message (a `GenerateInput` passed to the constructors, then the request copied into the
writer's `SessionRequests`); `session_request_in_place` is how it is built now
(`convert.fill_input` into the message, serialized once, framed; the writer joins bytes);
`..._from_field` the same for a request the router read from protobuf, whose prompt is copied
from the field it arrived in (`GenerateRequest.prompt_wire`), as the router's own are.
`ids_to_int64_array` reads the same field into a numpy array (no Python ints made).
These are floors: inside the router, between requests, the same code runs slower
(docs/BENCHMARKS.md, "The router at scale").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.router_scale import machine
from pdserve.rpc import convert
from pdserve.types import GenerateRequest
from pdserve.v1 import decode_pb2, router_pb2
from router.clients import _framed


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(repeats // 10):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 2)


def measure(tokens: int, repeats: int) -> dict[str, float]:
    rng = random.Random(1)
    wire = router_pb2.GenerateRequest(
        request_id="r", token_ids=router_pb2.TokenIds(ids=[rng.randrange(49152)
                                                            for _ in range(tokens)])
    ).SerializeToString()
    msg = router_pb2.GenerateRequest.FromString(wire)
    ids = tuple(msg.token_ids.ids)
    req = GenerateRequest("r", ids)
    read = GenerateRequest("r", ids, prompt_wire=(ids, msg.token_ids.ids))  # as the servicer

    def nested() -> bytes:
        one = decode_pb2.SessionRequest(stream=1, generate=decode_pb2.DecodeGenerateRequest(
            input=convert.input_to_proto(req)))
        return decode_pb2.SessionRequests(requests=[one]).SerializeToString()

    def in_place() -> bytes:
        one = decode_pb2.SessionRequest(stream=1)
        convert.fill_input(one.generate.input, req)
        return b"".join([_framed(one)])

    def from_field() -> bytes:
        one = decode_pb2.SessionRequest(stream=1)
        convert.fill_input(one.generate.input, read)
        return b"".join([_framed(one)])

    assert nested() == in_place() == from_field()  # the same bytes on the wire
    return {
        "parse_request": _median_us(lambda: router_pb2.GenerateRequest.FromString(wire),
                                    repeats),
        "ids_to_python_ints": _median_us(lambda: tuple(msg.token_ids.ids), repeats),
        # The same ids as an int64 array: upb's field hands numpy its values (__array__)
        # with no Python int made; what a C hash reading a buffer would start from.
        "ids_to_int64_array": _median_us(
            lambda: np.array(msg.token_ids.ids, dtype=np.int64), repeats),
        "ids_python_ints_to_message": _median_us(
            lambda: decode_pb2.SessionRequest().generate.input.prompt_token_ids.extend(
                req.prompt_token_ids), repeats),
        "ids_message_to_message": _median_us(
            lambda: decode_pb2.SessionRequest().generate.input.prompt_token_ids.extend(
                msg.token_ids.ids), repeats),
        "session_request_nested": _median_us(nested, repeats),
        "session_request_in_place": _median_us(in_place, repeats),
        "session_request_in_place_from_field": _median_us(from_field, repeats),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--cpu", type=int, default=0, help="the CPU to pin to")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {args.cpu})
    us = measure(args.tokens, args.repeats)
    record: dict[str, Any] = {
        "bench": "bench/prompt_encoding.py", "tokens": args.tokens, "repeats": args.repeats,
        "median_us": us,
        "in_place_over_nested": round(us["session_request_in_place"]
                                      / us["session_request_nested"], 3),
        "from_field_over_nested": round(us["session_request_in_place_from_field"]
                                        / us["session_request_nested"], 3),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine()}  # CPU model and flags, commit (and whether the tree is dirty)
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
