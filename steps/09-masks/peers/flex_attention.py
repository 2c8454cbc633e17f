"""The peers of mask-bench, measured the same way on the same GPU: PyTorch's FlexAttention
(torch.compile'd flex_attention with a block mask from create_block_mask) for every mask
mask-bench takes, and for the causal mask SDPA's FlashAttention-2 and cuDNN backends.

Each row: the method, the mask as mask-bench names it, the head dim, the tokens, the pass
(fwd or fwd+bwd) and the median milliseconds of triton.testing.do_bench (after its warm-up;
compilation and create_block_mask are not timed). Same shapes and dtype as mask-bench:
batch 4, 12 heads, bf16.

    python3 steps/09-masks/peers/flex_attention.py --head-dims 64 --out masks-peers-d64.json
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

MASKS = "causal;full;sliding:1024;prefix:1024;documents;causal,softcap:30;causal,alibi"


def bench_documents(tokens):
    """The document ids mask-bench's `documents` packs: 256 + (397·i mod 1792) tokens."""
    ids, i = [], 0
    while len(ids) < tokens:
        n = min(256 + (397 * i) % 1792, tokens - len(ids))
        ids += [i] * n
        i += 1
    return torch.tensor(ids, device="cuda", dtype=torch.int32)


def mods(spec, tokens, heads):
    """mask_mod (None: every key) and score_mod (None: the score) for a mask-bench mask."""
    mask, score = None, None
    for term in spec.split(","):
        key, _, value = term.partition(":")
        if key == "causal":
            mask = lambda b, h, q, k: q >= k
        elif key == "full":
            mask = None
        elif key == "sliding":
            w = int(value)
            mask = lambda b, h, q, k: (q >= k) & (q - k < w)
        elif key == "prefix":
            p = int(value)
            mask = lambda b, h, q, k: (k < p) | (q >= k)
        elif key == "documents":
            doc = bench_documents(tokens)
            mask = lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)
        elif key == "softcap":
            cap = float(value)
            score = lambda s, b, h, q, k: cap * torch.tanh(s / cap)
        elif key == "alibi":
            slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device="cuda") / heads)
            score = lambda s, b, h, q, k: s + slopes[h] * (k - q)
        else:
            raise SystemExit(f"unknown mask term {term!r}")
    return mask, score


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--masks", default=MASKS)
    p.add_argument("--lengths", type=lambda s: [int(t) for t in s.split(",")], default=[4096, 16384])
    p.add_argument("--head-dims", type=lambda s: [int(t) for t in s.split(",")], default=[64, 128])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        raise SystemExit(f"--out {args.out}: not a file in an existing folder")
    device = torch.cuda.get_device_name()
    # one compiled kernel for each mask, score function, shape and grad mode: past dynamo's
    # default of 8 it would fall back to the unfused path, which materialises the scores
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    for d in args.head_dims:
        for t in args.lengths:
            shape = (args.batch, args.heads, t, d)
            q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            for x in (q, k, v):
                x.requires_grad_(True)
            for spec in [s for s in args.masks.split(";") if s]:
                mask, score = mods(spec, t, args.heads)
                block = create_block_mask(mask, None, None, t, t, device="cuda") if mask else None
                calls = {"flex_attention": lambda: flex(q, k, v, score_mod=score, block_mask=block)}
                if spec == "causal":
                    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                        def sdpa(backend=backend):
                            with sdpa_kernel(backend):
                                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                        calls[name] = sdpa
                for name, call in calls.items():
                    for pass_ in ("fwd", "fwd+bwd"):
                        def once(call=call, pass_=pass_):
                            if pass_ == "fwd":
                                with torch.no_grad():
                                    call()
                            else:
                                call().backward(dout)
                        try:
                            once()
                            ms, error = median_ms(once), None
                        except Exception as e:  # a peer that cannot run this mask: a row saying why
                            ms, error = None, f"{type(e).__name__}: {e}"[:300]
                        rows.append(dict(method=name, device=device, torch=torch.__version__, batch=args.batch,
                                         heads=args.heads, tokens=t, head_dim=d, dtype="bf16", mask=spec,
                                         pass_=pass_, ms=ms, error=error))
                        print(f"{name:<15} {spec:<26} {d:>4} {t:>6} {pass_:>8} {ms if ms is None else round(ms, 3)} {error or ''}", flush=True)
    # a row a line, indented as flash_core::row::row_a_line lays out every file of charts/data/
    text = "[\n" + ",\n".join("  " + json.dumps(r).replace('"pass_"', '"pass"') for r in rows) + "\n]\n"
    folder = os.path.dirname(os.path.abspath(args.out))
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, args.out)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0 if all(r["ms"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
