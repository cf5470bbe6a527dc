"""Summarize the stage trace: python summarize.py stages.txt.gz worker_records_light.json.gz

Each line of stages.txt is one request the router's own time counted (`OwnTime.parts` not
None): `id=` its label, `abs=` its arrival (perf_counter, s), then each stage mark in ms after
arrival (names: see stage_trace.patch), then fwd (the old `forward` stamp: after
`call.write` completed), rep (the worker's first reply read) and done (the old `done`:
after the servicer's yield returned). Joined with the emulated workers' records
(`t_recv`: CLOCK_MONOTONIC, as perf_counter on Linux) of the light phase."""

import gzip
import itertools
import json
import sys

ORDER = ["h", "t", "rq", "adm", "pl0", "pl1", "w0", "se", "msg", "put", "wk", "sub", "fwd",
         "rep", "ev", "y1", "y2", "resp", "done"]


def q(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {f"p{int(p * 100)}": round(xs[min(int(len(xs) * p), len(xs) - 1)], 4)
            for p in (0.1, 0.5, 0.9, 0.99)}


def main() -> None:
    recs = {r[0].rpartition(":")[2]: r for r in json.load(gzip.open(sys.argv[2], "rt"))}
    rows = []
    for line in gzip.open(sys.argv[1], "rt"):
        d: dict[str, object] = {}
        for kv in line.split():
            k, v = kv.split("=")
            d.setdefault(k, v if k == "id" else float(v))
        if d["id"] in recs:
            rows.append(d)
    out: dict[str, object] = {"requests": len(rows), "steps_ms": {}}
    for a, b in itertools.pairwise(ORDER):
        out["steps_ms"][f"{a}->{b}"] = q([r[b] - r[a] for r in rows])  # type: ignore
    out["arrival->h_ms"] = q([r["h"] for r in rows])  # type: ignore
    t = lambda r, k: r["abs"] + r[k] / 1e3  # noqa: E731
    out["worker_recv_after_sub_ms"] = q([(recs[r["id"]][2] - t(r, "sub")) * 1e3 for r in rows])
    out["worker_recv_after_fwd_ms"] = q([(recs[r["id"]][2] - t(r, "fwd")) * 1e3 for r in rows])
    out["in_to_fwd_ms"] = q([r["fwd"] for r in rows])  # type: ignore
    out["in_to_sub_ms"] = q([r["sub"] for r in rows])  # type: ignore
    out["out_rep_to_done_ms"] = q([r["done"] - r["rep"] for r in rows])  # type: ignore
    out["out_rep_to_resp_ms"] = q([r["resp"] - r["rep"] for r in rows])  # type: ignore
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
