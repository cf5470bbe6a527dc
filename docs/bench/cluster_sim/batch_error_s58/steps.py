"""Decode-worker steps of the real runs rebuilt from client token times (common.step_intervals),
each priced with the simulator's step model (engine_profile_spr_5bfee06 regression +
validation_spr_704c56d's calibrated overheads for that layout). Prints measured/priced per
kind of step. 'prefill worker idle/busy': the fraction of the interval during which the
prefill worker was computing a remote prompt (server timings) is 0 / >= 0.99."""

import statistics as st

from common import real_files, step_intervals


def summ(name, xs, key="pred"):
    if not xs:
        print(f"{name:62s} n=0")
        return
    r = [x["meas"] / x[key] for x in xs]
    print(
        f"{name:62s} n={len(xs):4d} meas={1e3 * st.median([x['meas'] for x in xs]):6.1f} ms"
        f" priced={1e3 * st.median([x[key] for x in xs]):6.1f} ms"
        f"  meas/priced median={st.median(r):.3f} mean={st.mean(r):.3f}"
    )


for layout in ("1p1d", "1p2d"):
    allr = []
    for f in real_files(layout):
        allr += step_intervals(f, layout)
    D = [x for x in allr if not x["prefill"] and not x["admit"]]
    idle = [x for x in D if x["pbusy"] == 0]
    busy = [x for x in D if x["pbusy"] >= 0.99]
    print("==", layout)
    summ(" decode-only, batch row (any prefill-worker state)", [x for x in D if x["batch"]])
    summ(
        " decode-only, batch row, WITHOUT the per-context-token term",
        [x for x in D if x["batch"]],
        "pred0",
    )
    summ(" decode-only, no batch row (any prefill-worker state)", [x for x in D if not x["batch"]])
    summ(" decode-only, batch row, prefill worker idle", [x for x in idle if x["batch"]])
    summ(
        " decode-only, batch row, idle, WITHOUT per-context term",
        [x for x in idle if x["batch"]],
        "pred0",
    )
    summ(" decode-only, batch row, prefill worker busy", [x for x in busy if x["batch"]])
    summ(" decode-only, no batch row, prefill worker idle", [x for x in idle if not x["batch"]])
    summ(" decode-only, no batch row, prefill worker busy", [x for x in busy if not x["batch"]])
    summ(" step with a local prefill", [x for x in allr if x["prefill"] and not x["admit"]])
    summ(" interval in which a remote request's KV landed", [x for x in allr if x["admit"]])
    for nb in (1, 2, 3, 4):
        for lab, xs in (("idle", idle), ("busy", busy)):
            summ(
                f"   prefill worker {lab}, rows={nb}, no batch row",
                [x for x in xs if x["rows"] == nb and not x["batch"]],
            )
            summ(
                f"   prefill worker {lab}, rows={nb}, batch row",
                [x for x in xs if x["rows"] == nb and x["batch"]],
            )
