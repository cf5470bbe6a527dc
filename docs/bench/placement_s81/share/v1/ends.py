"""share.py (v1, as run at 8e8c0ef) kept the routers' decisions but not the requests' ends;
this adds them from the same run's router logs (each "request finished" line: when, which
request, its outcome), as ../share.py records them, for ../busier.py.
usage: python ends.py share.json LOG_DIR OUT.json"""
import json
import sys
from pathlib import Path

d = json.loads(Path(sys.argv[1]).read_text())
ends = []
for name in ("router", "router-1", "router-2", "router-3"):
    for line in (Path(sys.argv[2]) / f"{name}.log").read_text().splitlines():
        if '"request finished"' in line:
            x = json.loads(line)
            ends.append((x["timestamp"], x["request_id"], x.get("outcome")))
d["ends"] = ends
Path(sys.argv[3]).write_text(json.dumps(d, indent=1))
