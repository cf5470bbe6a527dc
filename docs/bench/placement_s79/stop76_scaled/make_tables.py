"""How the scaled co-run tables here were made from stop 76's (a = 0.25, 0.5, 0.75)."""
import json

d = json.load(open("../../placement_s76/engine_corun_zen4_bd0e33f.json"))
for a in (0.25, 0.5, 0.75):
    e = json.loads(json.dumps(d))
    for v in e["corun"].values():
        v["slowdown"] = 1 + a * (v["slowdown"] - 1)
    json.dump(e, open(f"a{int(a * 100)}.json", "w"))
