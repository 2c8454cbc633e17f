"""Prints the sweep's decoding times beside cuDNN's: python3 table.py DIR (the unpacked sweep.tar.xz)."""
import glob, json, os, sys

d = sys.argv[1] if len(sys.argv) > 1 else "."
us, read, cudnn, splits = {}, {}, {}, {}
for f in glob.glob(os.path.join(d, "*-d*-b*.json")):
    name = os.path.basename(f).split("-d")[0]
    for r in json.load(open(f)):
        if r.get("error"):
            print("error:", f, r["error"]); continue
        k = (r["head_dim"], r["batch"], r["kv_heads"], r["context"])
        if r["method"] == "decode":
            us.setdefault(k, {})[name] = r["us"]; splits.setdefault(k, {})[name] = r["splits"]
        elif r["method"] == "read":
            read.setdefault(k, []).append(r["us"])
for f in glob.glob(os.path.join(d, "pytorch-b*.json")):
    for r in json.load(open(f)):
        if r.get("error"): continue
        k = (r["head_dim"], r["batch"], r["kv_heads"], r["context"])
        cudnn[k] = r["us"]
names = ["base"] + sorted({n for v in us.values() for n in v} - {"base"})
for hd in (64, 128):
    ns = [n for n in names if any(n in us[k] for k in us if k[0] == hd)]
    print(f"\nhead dim {hd}: µs (ratio cuDNN/ours); read = median read kernel over the variants' runs")
    print(f"{'b':>3} {'kv':>3} {'ctx':>7} {'read':>7} {'cuDNN':>7} " + " ".join(f"{n:>15}" for n in ns))
    for k in sorted(k for k in us if k[0] == hd):
        rd = sorted(read.get(k, [0]))[len(read.get(k, [0])) // 2]
        c = cudnn.get(k)
        cells = []
        for n in ns:
            t = us[k].get(n)
            cells.append(f"{t:7.1f} ({c / t:4.2f})" if t and c else f"{'':>15}")
        print(f"{k[1]:>3} {k[2]:>3} {k[3]:>7} {rd:7.1f} {c or 0:7.1f} " + " ".join(cells))
