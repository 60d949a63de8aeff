"""The simulator's built-in compute tables, one per built-in cluster (python bench/compute_tables/make.py).

- ``h200-emulated.json``: measured on an H200 (``lins-ds profile --compute``; bench/results/simulate/shapes/call20,
  with its timed layers), and its misaligned GEMMs from call 28's table (measured after call 20: odd widths and
  multiples of 2 and 4; each beside its aligned twin, and call 27's odd ones within 4 % on another machine).
- ``a800-ib.json``: **not measured** — the H200 table scaled by public figures: bf16 dense peak 312 TFLOP/s (A800 /
  A100 80 GB SXM) against the H200's 989, HBM bandwidth 2.04 TB/s against 4.8. An A800 reaches a smaller share of
  its peak on small GEMMs than this assumes (it is the same shape of curve, scaled); measure one to replace it. It
  carries no timed layers: the factor it is used at is the calibration's. Its misaligned GEMMs are the H200's scaled
  alike, so it assumes the H200's share of the aligned rate there.
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "..", "results", "simulate", "shapes")
MEASURED = os.path.join(SHAPES, "call20", "layers", "compute.json")
MISALIGNED = os.path.join(SHAPES, "call28", "compute_h200.json")
SCALED = {"a800-ib": ("A800-80GB (derived)", 312.0 / 989.0, 2039.0 / 4800.0)}


def main():
    with open(MEASURED) as f:
        h200 = json.load(f)
    with open(MISALIGNED) as f:
        h200["misaligned"] = json.load(f)["misaligned"]
    h200["source"] = ("measured on NVIDIA H200 (bench/results/simulate/shapes/call20/layers/compute.json; "
                      "misaligned GEMMs from call28/compute_h200.json)")
    with open(os.path.join(HERE, "h200-emulated.json"), "w") as f:
        json.dump(h200, f, indent=1)
    for name, (device, compute, bandwidth) in SCALED.items():
        t = dict(h200, device=device, bandwidth_gbs=h200["bandwidth_gbs"] * bandwidth,
                 gemm=[dict(g, tflops=g["tflops"] * compute) for g in h200["gemm"]],
                 attention=[dict(a, tflops=a["tflops"] * compute) for a in h200["attention"]], layers=[],
                 misaligned=[dict(g, tflops=g["tflops"] * compute, aligned_tflops=g["aligned_tflops"] * compute)
                             for g in h200["misaligned"]],
                 source=f"derived, not measured: the H200 table x {compute:.3f} (bf16 dense peak 312 vs 989 TFLOP/s) "
                        f"and bandwidth x {bandwidth:.3f} (HBM 2.04 vs 4.8 TB/s), public figures")
        with open(os.path.join(HERE, f"{name}.json"), "w") as f:
            json.dump(t, f, indent=1)


if __name__ == "__main__":
    main()
