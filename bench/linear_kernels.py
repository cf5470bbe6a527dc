"""The float32 linear kernels side by side on the model's own shapes, in one run.

    python -m bench.linear_kernels --rows 1,2,4,8,16,32,64,512 --out rec.json

For each batch of rows: one pass over every projection of the model (q/k/v fused, o,
gate/up fused, down, per layer, and the LM head) with random weights of those shapes, timed
for each kernel the engine could use (`PanelLinear`: the extension's panels; `OneDnnLinear`:
oneDNN's prepacked GEMM; `DenseLinear`: `F.linear`), median of `--reps`. Prints ms, the
weight-read rate it reached (weight bytes / time) and each kernel's time over the panels',
beside the machine's read bandwidth and CPU flags.

`--against REV` adds REV's panels (its cpu_ops.cpp compiled apart) as a fourth kernel and
the ratio of this tree's panels to them; every rep runs the kernels one after another, so
the two panel kernels see the same minutes of a drifting VM. Whole passes still drift apart
by +-20 % on a shared VM, so it then also alternates the two panel kernels call by call on
each distinct shape (`--reps` pairs, median ratio per shape) and checks they give the same
bits.

`--avx2` runs both sides as an AVX2-only CPU would on a newer one: the extension compiled
for x86-64-v3 (AVX2 + FMA, no AVX-512) into a scratch directory, and oneDNN held to AVX2
(`ONEDNN_MAX_CPU_ISA`). An emulation of the instruction set, not of an older core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import ModuleType

import torch

from bench import build_at, build_cpu_ops, commit_id
from bench.profile_step import read_bandwidth_gbs
from pdserve.engine.cpu import cpu_summary
from pdserve.engine.kernels import cpu_extension
from pdserve.engine.linear import DenseLinear, LinearKernel, OneDnnLinear, PanelLinear
from pdserve.engine.model_store import resolve_model


def model_shapes(model: str | None, head: bool = True) -> list[tuple[int, int]]:
    """(out, in) of every linear call of one forward, fused as the engine fuses them (the LM
    head last, unless `head` is False)."""
    cfg = json.loads((resolve_model(model) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    kvh = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    qkv = cfg["num_attention_heads"] * hd + 2 * kvh * hd
    layer = [(qkv, h), (h, cfg["num_attention_heads"] * hd), (2 * inter, h), (h, inter)]
    return layer * cfg["num_hidden_layers"] + ([(cfg["vocab_size"], h)] if head else [])


def pass_ms(kinds: dict[str, list[LinearKernel]], shapes: list[tuple[int, int]], rows: int,
            reps: int) -> dict[str, float]:
    """Median ms of one pass per kernel kind; each rep times every kind in turn."""
    xs = {k: torch.randn(rows, k) for k in {i for _, i in shapes}}
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for rep in range(reps + 1):
        for name, kernels in kinds.items():
            t = time.perf_counter()
            for (_, i), kernel in zip(shapes, kernels, strict=True):
                kernel(xs[i])
            if rep:  # the first rep warms up
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def per_shape_ratios(ext: ModuleType, other: ModuleType, shapes: list[tuple[int, int]],
                     rows: int, reps: int) -> dict[str, float]:
    """Median over `reps` of (ext's panel_linear time / other's), the two called in turn, for
    each distinct (out, in) shape; their outputs must be the same bits."""
    out = {}
    for n, k in dict.fromkeys(shapes):
        w, x = torch.randn(n, k) * 0.05, torch.randn(rows, k)
        mine, theirs = ext.pack_panels(w), other.pack_panels(w)
        if not torch.equal(ext.panel_linear(x, mine, n, None),
                           other.panel_linear(x, theirs, n, None)):
            raise SystemExit(f"{n}x{k} at {rows} rows: the two builds' bits differ")
        ratios = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ext.panel_linear(x, mine, n, None)
            t1 = time.perf_counter()
            other.panel_linear(x, theirs, n, None)
            ratios.append((t1 - t0) / (time.perf_counter() - t1))
        out[f"{k}->{n}"] = statistics.median(ratios)
    return out


def avx2_extension() -> ModuleType:
    """cpu_ops.cpp built for AVX2 + FMA without AVX-512, in a scratch directory."""
    import pdserve.engine.kernels as kernels

    return build_cpu_ops(kernels._SOURCE.read_text(), "pdserve_cpu_ops_avx2_bench",
                         march="x86-64-v3")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,512")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--avx2", action="store_true",
                    help="both kernels as on an AVX2-only CPU (see the module's docstring)")
    ap.add_argument("--no-head", action="store_true",
                    help="leave out the LM head: a prompt chunk's rows pass the layers only "
                         "(the head runs on each sequence's last token)")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also time REV's panels (its cpu_ops.cpp, compiled apart)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.avx2:
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"  # read when oneDNN first dispatches
    ext = avx2_extension() if args.avx2 else cpu_extension()
    if ext is None:
        sys.exit("the CPU extension could not be built here: nothing to compare")
    shapes = model_shapes(args.model, head=not args.no_head)
    weights = [torch.randn(o, i) * 0.05 for o, i in shapes]
    nbytes = sum(w.numel() * 4 for w in weights)
    kinds: dict[str, list[LinearKernel]] = {
        "panels": [PanelLinear(w, None, ext) for w in weights],
        "onednn": [OneDnnLinear(w, None) for w in weights],
        "F.linear": [DenseLinear(w, None) for w in weights],
    }
    if args.against:
        other = build_at(args.against)
        kinds[f"panels@{args.against}"] = [PanelLinear(w, None, other) for w in weights]
    against = f"panels@{args.against}" if args.against else None
    bw = read_bandwidth_gbs()
    isa = "; emulating AVX2 only (extension x86-64-v3, oneDNN AVX2)" if args.avx2 else ""
    print(f"CPU: {cpu_summary()}{isa}; torch threads {torch.get_num_threads()}; read bandwidth "
          f"{bw:.1f} GB/s; {nbytes / 1e6:.0f} MB of float32 weights in {len(shapes)} calls")
    print("\n| rows | " + " | ".join(f"{k} ms (GB/s)" for k in kinds)
          + " | onednn / panels | F.linear / panels |"
          + (f" panels / {against} |" if against else ""))
    print("|---:|" + "---:|" * (len(kinds) + 2 + bool(against)))
    out = []
    for rows in (int(r) for r in args.rows.split(",")):
        ms = pass_ms(kinds, shapes, rows, args.reps)
        out.append({"rows": rows, **{f"{k}_ms": v for k, v in ms.items()}})
        print(f"| {rows} | " + " | ".join(
            f"{v:.1f} ({nbytes / v / 1e6:.1f})" for v in ms.values())
            + f" | {ms['onednn'] / ms['panels']:.2f}x | {ms['F.linear'] / ms['panels']:.2f}x |"
            + (f" {ms['panels'] / ms[against]:.2f}x |" if against else ""))
    if args.against:
        print(f"\nthis tree's panels / {args.against}'s, called in turn on each shape "
              f"(in -> out), median of {args.reps}; same bits checked:")
        for row in out:
            row["per_shape_over_against"] = per_shape_ratios(ext, other, shapes, row["rows"],
                                                             args.reps)
            print(f"  {row['rows']:5d} rows: " + "  ".join(
                f"{shape} {r:.2f}x" for shape, r in row["per_shape_over_against"].items()))
    if args.out:
        record = {"benchmark": "bench.linear_kernels", "commit": commit_id(), "argv": sys.argv[1:],
                  "cpu": cpu_summary(), "threads": torch.get_num_threads(),
                  "read_bandwidth_gbs": bw, "weight_bytes": nbytes,
                  "panel_width": ext.panel_width(), "avx2_emulated": args.avx2,
                  "against": args.against, "head": not args.no_head, "rows": out}
        with open(args.out, "w") as fh:
            json.dump(record, fh, indent=1)


if __name__ == "__main__":
    main()
