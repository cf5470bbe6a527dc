"""What the router leaves in reference cycles (bench only; on PYTHONPATH with CYC_OUT set):
CYC_AT s after the router starts, collect, keep every object the collector frees for 5 s
(gc.DEBUG_SAVEALL), collect again and write their types (and code names of frames and
coroutines) to CYC_OUT as JSON."""

import collections
import gc
import json
import os
import sys
import threading
import time


def _run() -> None:
    time.sleep(float(os.environ.get("CYC_AT", "45")))
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    time.sleep(5)
    gc.collect()
    gc.set_debug(0)
    garbage = list(gc.garbage)
    gc.garbage.clear()
    types = collections.Counter(type(o).__qualname__ for o in garbage)
    names: collections.Counter[str] = collections.Counter()
    for o in garbage:
        co = (getattr(o, "f_code", None) or getattr(o, "cr_code", None)
              or getattr(o, "ag_code", None))
        if co is not None:
            names[f"{type(o).__name__}:{co.co_filename.split('/')[-1]}:{co.co_name}"] += 1
        elif isinstance(o, BaseException):
            names[f"exc:{type(o).__name__}"] += 1
    with open(os.environ["CYC_OUT"], "w") as f:
        json.dump({"n": len(garbage), "types": types.most_common(40),
                   "names": names.most_common(40)}, f, indent=1)


if "router" in " ".join(sys.argv) and os.environ.get("CYC_OUT"):
    threading.Thread(target=_run, daemon=True).start()
