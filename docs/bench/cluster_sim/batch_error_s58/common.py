"""Shared loading and step reconstruction for the batch-TPOT error analysis.
Run the scripts from the repository root with PYTHONPATH=. (see README.md)."""

import bisect
import glob
import itertools
import json
import os
import statistics as st

from bench.engine_profile import predict

VALIDATION = "docs/bench/cluster_sim/validation_spr_704c56d.json"
PROFILE = "docs/bench/cluster_sim/engine_profile_spr_5bfee06.json"
REAL = {
    "1p1d": "docs/bench/goodput_placement/run4/*/rate_*.json",
    "1p2d": "docs/bench/cluster_sim/real_1p2d_57b2528/*/rate_*.json",
}
# real sweep directory -> the policy name the validation record uses
POLICY = {
    "disaggregated": "threshold",
    "disaggregated-cost": "cost",
    "1p2d": "threshold",
    "1p2d-cost": "cost",
}
CALIB = {"1p1d": "1p1d run4", "1p2d": "1p2d real_1p2d_57b2528"}
EPS = 0.012  # token events closer than this on one worker belong to one engine step

if not os.path.exists(VALIDATION):
    raise SystemExit("run from the repository root")


def load(path):
    with open(path) as f:
        return json.load(f)


def real_files(layout):
    return sorted(glob.glob(REAL[layout]))


def policy_of(path):
    return POLICY[path.split("/")[-2]]


def token_times(r):
    """Client-side arrival time of each output token of a real request."""
    t = r["start_s"] + r["ttft_s"]
    out = [t]
    for g in r["itl_s"]:
        t += g
        out.append(t)
    return out


def prefill_end(r):
    """When the prefill worker finished computing a remote request's prompt."""
    t = r["server_timings_ms"]
    return (
        r["start_s"]
        + (r["ttft_s"] * 1e3 - t.get("kv_transfer_ms", 0) - t.get("handoff_ms", 0)) / 1e3
    )


def prefill_intervals(R):
    """(start, end) of each remote prompt's computation on the prefill worker."""
    iv = []
    for r in R.values():
        t = r.get("server_timings_ms") or {}
        if r["route"] == "local" or "prefill_compute_ms" not in t:
            continue
        end = prefill_end(r)
        iv.append((end - t["prefill_compute_ms"] / 1e3, end))
    return iv


# ---------------------------------------------------------------- 1P2D decode worker per request
def _sync(ta, tb, eps=0.006):
    """Fraction of a's tokens (first excluded) within eps of one of b's, over their overlap."""
    lo, hi = max(ta[0], tb[0]), min(ta[-1], tb[-1])
    pts = [t for t in ta[1:] if lo <= t <= hi]
    if len(pts) < 3:
        return None
    n = 0
    for t in pts:
        j = bisect.bisect_left(tb, t)
        if any(0 <= k < len(tb) and abs(tb[k] - t) <= eps for k in (j - 1, j)):
            n += 1
    return n / len(pts)


def assign(path):
    """Which of the two decode workers served each request of a real 1P2D run: streams on one
    worker emit tokens in the same engine steps. Union of strongly synchronous pairs (>= 0.6),
    then 2-colouring across overlapping, unsynchronous pairs (< 0.25). Returns
    ({index: worker label 0/1}, {index: True if nothing constrained it}, pair sync values,
    colouring conflicts)."""
    R = {r["index"]: r for r in load(path)["requests"] if r["ok"]}
    T = {i: token_times(r) for i, r in R.items()}
    same = {}
    for a, b in itertools.combinations(R, 2):
        s1, s2 = _sync(T[a], T[b]), _sync(T[b], T[a])
        if s1 is None or s2 is None:
            continue
        same[(a, b)] = min(s1, s2)
    parent = {i: i for i in R}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for (a, b), s in same.items():
        if s >= 0.6:
            parent[find(a)] = find(b)
    comps = {}
    for i in R:
        comps.setdefault(find(i), []).append(i)
    anti = {}
    for (a, b), s in same.items():
        if s < 0.25:
            ca, cb = find(a), find(b)
            if ca != cb:
                anti.setdefault(ca, set()).add(cb)
                anti.setdefault(cb, set()).add(ca)
    color, conflicts = {}, 0
    for c in sorted(comps, key=lambda c: min(comps[c])):
        if c in color:
            continue
        color[c] = 0
        stack = [c]
        while stack:
            x = stack.pop()
            for y in anti.get(x, ()):
                if y not in color:
                    color[y] = 1 - color[x]
                    stack.append(y)
                elif color[y] == color[x]:
                    conflicts += 1
    W = {i: color[find(i)] for i in R}
    unknown = {i: len(comps[find(i)]) == 1 and find(i) not in anti for i in R}
    return W, unknown, same, conflicts


def workers(path, layout, R):
    return assign(path)[0] if layout == "1p2d" else {i: 0 for i in R}


# ---------------------------------------------------------------- steps priced with the sim's model
COEF = load(PROFILE)["coef"]
VAL = load(VALIDATION)


def overheads(layout):
    return VAL["calibration"][CALIB[layout]]["overheads"]


def price(oh, pieces, streamed, ctx_term=True):
    """The simulator's step time: profile regression + 704c56d's calibrated overheads."""
    ctx = sum(c for c, n in pieces if n == 1)
    return (
        predict(COEF, pieces)
        + oh["step_s"]
        + oh["token_s"] * streamed
        + (oh["context_s_per_token"] * ctx if ctx_term else 0)
    )


def worker_steps(R, asg, w):
    """Engine steps of decode worker w rebuilt from client token times: [(t, [(index, k)])],
    k = token number (0: a local request's first token, i.e. its prefill step). A remote
    request's first token is its admission (KV landed), not a step, and is left out."""
    ev = []
    for i, r in R.items():
        if asg.get(i) != w:
            continue
        for k, t in enumerate(token_times(r)):
            ev.append((t, i, k))
    ev.sort()
    steps, cur = [], None
    for t, i, k in ev:
        if k == 0 and R[i]["route"] != "local":
            continue
        if cur and t - cur[0] <= EPS:
            cur[1].append((i, k))
        else:
            cur = [t, [(i, k)]]
            steps.append(cur)
    admissions = [t for t, i, k in ev if k == 0 and R[i]["route"] != "local"]
    return steps, admissions


def pieces_of(R, members):
    return [
        (0, R[i]["prompt_tokens"]) if k == 0 else (R[i]["prompt_tokens"] + k - 1, 1)
        for i, k in members
    ]


def step_intervals(path, layout):
    """Back-to-back step intervals on each decode worker (the next step holds a stream of the
    previous one), each measured and priced."""
    d = load(path)
    oh = overheads(layout)
    R = {r["index"]: r for r in d["requests"] if r["ok"]}
    asg = workers(path, layout, R)
    busy = prefill_intervals(R)
    res = []
    for w in (0, 1):
        steps, adm_t = worker_steps(R, asg, w)
        for a, b in itertools.pairwise(steps):
            if not {i for i, k in a[1]} & {i for i, k in b[1] if k > 0}:
                continue  # the worker may have idled between them
            pieces = pieces_of(R, b[1])
            batch = any(k > 0 and R[i]["latency_class"] == "batch" for i, k in b[1])
            prefill = any(k == 0 for i, k in b[1])
            adm = sum(1 for t in adm_t if a[0] < t <= b[0])
            pb = sum(max(0, min(b[0], e) - max(a[0], s)) for s, e in busy) / (b[0] - a[0])
            res.append(
                dict(
                    meas=b[0] - a[0],
                    pred=price(oh, pieces, len(b[1])),
                    pred0=price(oh, pieces, len(b[1]), False),
                    rows=sum(1 for i, k in b[1] if k > 0),
                    batch=batch,
                    prefill=prefill,
                    admit=adm,
                    pbusy=min(pb, 1.0),
                    t=b[0],
                    w=w,
                )
            )
    return res


def median(xs):
    return st.median(xs)
