"""The figures chapter 8's "What decoding measured" quotes, from decode-bench's and the PyTorch
peer's rows: python3 summary.py decode.json decode-pytorch.json"""
import json, sys

rows = [r for r in json.load(open(sys.argv[1])) if not r.get("error")]
pt = {(r["head_dim"], r["batch"], r["kv_heads"], r["context"]): r["us"]
      for r in json.load(open(sys.argv[2])) if not r.get("error")}
by = {}
for r in rows:
    by[(r["method"], r["head_dim"], r["batch"], r["kv_heads"], r["context"])] = r
dec = [r for r in rows if r["method"] == "decode"]
key = lambda r: (r["head_dim"], r["batch"], r["kv_heads"], r["context"])

def frac(sel):
    xs = [r["fraction_of_read"] for r in dec if sel(r)]
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"

print("fraction of read, batch >= 8, >= 32k:", frac(lambda r: r["batch"] >= 8 and r["context"] >= 32768))
for d in (64, 128):
    for kv in (8, 32):
        print(f"batch 1, d{d}, kv{kv}, 128k: fraction", frac(lambda r: r["batch"] == 1 and r["head_dim"] == d and r["kv_heads"] == kv and r["context"] == 131072))
best = max(dec, key=lambda r: r["gb_s"])
best_read = max((r for r in rows if r["method"] == "read"), key=lambda r: r["gb_s"])
print(f"best GB/s: decode {best['gb_s']:.0f} at {key(best)}, read {best_read['gb_s']:.0f} at {key(best_read)}")
for d in (128, 64):
    for t in (1024, 8192, 32768, 131072):
        k = (d, 1, 8, t)
        r, rd = by.get(("decode",) + k), by.get(("read",) + k)
        if r and rd:
            print(f"batch 1, d{d}, 8 kv, {t}: {r['bytes']/1e6:.1f} MB, read {rd['us']:.1f} µs, decode {r['us']:.1f} ({r['fraction_of_read']:.0%}), splits {r['splits']}")
paged = [by[("decode_paged",) + key(r)]["us"] / r["us"] for r in dec if ("decode_paged",) + key(r) in by]
print(f"paged / contiguous: {min(paged):.3f} .. {max(paged):.3f}, median {sorted(paged)[len(paged)//2]:.3f}")
print("cuDNN's time over ours (>1: ours faster):")
for d in (128, 64):
    for b in (1, 8, 64):
        for kv in (8, 32):
            xs = [(r["context"], pt[key(r)] / r["us"]) for r in dec if r["head_dim"] == d and r["batch"] == b and r["kv_heads"] == kv and key(r) in pt]
            print(f"  d{d} b{b} kv{kv}: " + " ".join(f"{t//1024}k {x:.2f}" for t, x in xs))
rs = sorted((pt[key(r)] / r["us"], key(r)) for r in dec if key(r) in pt)
print("lowest:", [(round(a, 2), k) for a, k in rs[:8]])
print("cuDNN over read, batch 1, 8 kv:", " ".join(f"d{d} {t//1024}k {by[('read', d, 1, 8, t)]['us'] / pt[(d, 1, 8, t)]:.2f}" for d in (128, 64) for t in (8192, 131072) if (d, 1, 8, t) in pt and ('read', d, 1, 8, t) in by))
big_read = max((r for r in rows if r["method"] == "read" and r["bytes"] > 100e6), key=lambda r: r["gb_s"])
print(f"read kernel's best past the L2 (> 100 MB): {big_read['gb_s']:.0f} at {key(big_read)}")
def ratio_range(sel):
    xs = [pt[key(r)] / r["us"] for r in dec if key(r) in pt and sel(r)]
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"
print("cuDNN/ours from batch 8 and 8k:", ratio_range(lambda r: r["batch"] >= 8 and r["context"] >= 8192))
print("cuDNN/ours batch 1 d128:", ratio_range(lambda r: r["batch"] == 1 and r["head_dim"] == 128))
print("cuDNN/ours batch 1 d64:", ratio_range(lambda r: r["batch"] == 1 and r["head_dim"] == 64))
print("cuDNN/ours everywhere:", ratio_range(lambda r: True))
print("fraction of read, d128, batch 1, >= 32k:", frac(lambda r: r["batch"] == 1 and r["head_dim"] == 128 and r["context"] >= 32768))
