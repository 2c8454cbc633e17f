#!/usr/bin/env python3
"""Step 08's peer: step 05's model in PyTorch (steps/05-train/peers/gpt_pytorch.py's GPT, the
same weights from our checkpoint) generating greedily with a static key/value cache, timed as
our `generate --device cuda` is, and its bytes held against ours.

The cache is each layer's keys and values, [1, kv_heads, context, head_dim] in bf16, allocated
once (with grouped heads, each kv head serves heads / kv_heads query heads: SDPA's enable_gqa). The prompt is read in one causal forward that fills the cache's first rows; then each
new token is one forward of one row: its q, k and v, its k and v written at its position, and
scaled_dot_product_attention of its q against the cache. Two ways, as people run it:

  eager     the cache sliced to the tokens so far; each step's attention is PyTorch's choice
            for one query row (cuDNN's on the H200, which its profiler names)
  compiled  --compile: the step over the whole cache with a mask of the positions so far
            (Hugging Face's static cache), so every step has the same shapes, compiled with
            torch.compile(mode="reduce-overhead"): CUDA graphs, one launch a step

The weights are bf16 (model.to(bfloat16)): LayerNorm, GELU and the residual stream too, as
inference in PyTorch runs; ours keeps the residual stream and LayerNorm's statistics in f32.
The next byte is the likeliest (temperature 0, the first of equals), chosen on the GPU, so the
loop never waits for the host; the bytes are read back at the end.

Timing: a whole call (the prefill, then `count - 1` steps) between two synchronisations, after
one untimed call (and the compilation); the median of --runs calls. --out adds a row to a JSON
list in the schema of our generate's rows where they overlap, with `same_text` and
`same_prefix` against --against (our rows' file): whether the bytes are ours, and how many of
the first agree.

Usage:
  python3 steps/08-inference/peers/generate_pytorch.py --checkpoint gpt2.safetensors \\
      --prompt "fn main() {" --count 500 --against charts/data/generate-gpu.json \\
      --out charts/data/generate-gpu-pytorch.json
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "05-train", "peers"))
import gpt_pytorch as g  # noqa: E402

torch, F = g.torch, g.F


class StaticCache:
    """Each layer's keys and values, [layers, 1, kv_heads, context, head_dim], allocated once."""

    def __init__(self, cfg, device):
        shape = (cfg["layers"], 1, cfg["kv_heads"], cfg["context"], cfg["d_model"] // cfg["heads"])
        self.k = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.v = torch.zeros(shape, dtype=torch.bfloat16, device=device)


def split_heads(x, heads):
    b, n, c = x.shape
    return x.view(b, n, heads, c // heads).transpose(1, 2)


def qkv_heads(blk, cfg, x):
    """q [1, heads, n, d], k and v [1, kv_heads, n, d] from the fused projection of `x`."""
    h, kv = cfg["heads"], cfg["kv_heads"]
    c = cfg["d_model"]
    kc = c // h * kv
    q, k, v = blk.attn.c_attn(blk.ln_1(x)).split([c, kc, kc], dim=2)
    return split_heads(q, h), split_heads(k, kv), split_heads(v, kv)


def attend(cfg, q, k, v, **kw):
    """SDPA, each kv head read by its group of query heads where the model shares them."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=cfg["kv_heads"] != cfg["heads"], **kw)


@torch.no_grad()
def prefill(model, cfg, cache, tokens):
    """The prompt `tokens` [1, n] in one causal forward; its keys and values fill the cache's
    rows 0..n. Returns the next byte's logits."""
    n, c = tokens.shape[1], cfg["d_model"]
    x = model.wte(tokens) + model.wpe(torch.arange(n, device=tokens.device))
    for l, blk in enumerate(model.h):
        q, k, v = qkv_heads(blk, cfg, x)
        cache.k[l, :, :, :n] = k
        cache.v[l, :, :, :n] = v
        out = attend(cfg, q, k, v, is_causal=True)
        x = x + blk.attn.c_proj(out.transpose(1, 2).reshape(1, n, c))
        x = x + blk.mlp(blk.ln_2(x))
    return F.linear(model.ln_f(x[:, -1]), model.wte.weight)


@torch.no_grad()
def step_sliced(model, cfg, cache, token, pos):
    """One token [1, 1] at position `pos` (an int): attention against the cache's rows
    0..pos, itself included."""
    c = cfg["d_model"]
    x = model.wte(token) + model.wpe.weight[pos]
    for l, blk in enumerate(model.h):
        q, k, v = qkv_heads(blk, cfg, x)
        cache.k[l, :, :, pos] = k[:, :, 0]
        cache.v[l, :, :, pos] = v[:, :, 0]
        out = attend(cfg, q, cache.k[l, :, :, : pos + 1], cache.v[l, :, :, : pos + 1])
        x = x + blk.attn.c_proj(out.transpose(1, 2).reshape(1, 1, c))
        x = x + blk.mlp(blk.ln_2(x))
    return F.linear(model.ln_f(x[:, -1]), model.wte.weight)


def step_masked(model, cfg, cache):
    """The same step with the same shapes at every position (`pos` a tensor [1]): the whole
    cache read, the positions after `pos` masked off."""
    c, t = cfg["d_model"], cfg["context"]
    positions = torch.arange(t, device=cache.k.device)

    @torch.no_grad()
    def step(token, pos):
        x = model.wte(token) + model.wpe(pos)[None]
        mask = (positions <= pos)[None, None, None, :]
        for l, blk in enumerate(model.h):
            q, k, v = qkv_heads(blk, cfg, x)
            cache.k[l].index_copy_(2, pos, k)
            cache.v[l].index_copy_(2, pos, v)
            out = attend(cfg, q, cache.k[l], cache.v[l], attn_mask=mask)
            x = x + blk.attn.c_proj(out.transpose(1, 2).reshape(1, 1, c))
            x = x + blk.mlp(blk.ln_2(x))
        return F.linear(model.ln_f(x[:, -1]), model.wte.weight)

    return step


def generate(model, cfg, cache, prompt, count, step):
    """`count` greedy bytes after `prompt` (a list of ints); the loop stays on the GPU."""
    device = cache.k.device
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    out = torch.empty(count, dtype=torch.long, device=device)
    logits = prefill(model, cfg, cache, tokens)
    for i in range(count):
        nxt = logits.argmax(dim=-1)  # the first of equals, as ours
        out[i] = nxt[0]
        if i + 1 < count:
            logits = step(nxt.view(1, 1), len(prompt) + i)
    return out


def read_ours(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise g.Failure(f"--against {path}: {e}; it takes the JSON list our generate --out writes")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by our train --save")
    p.add_argument("--prompt", default="\n", help="the text to go on from")
    p.add_argument("--prompt-len", type=int, help="repeat the prompt (or cut it) to this many bytes")
    p.add_argument("--count", type=int, default=64, help="bytes to generate")
    p.add_argument("--runs", type=int, default=3, help="timed calls after an untimed one")
    p.add_argument("--compile", action="store_true", help="the masked step over the whole cache, torch.compile'd with CUDA graphs")
    p.add_argument("--against", help="our generate's rows (--out): compare the bytes with the last row of the same checkpoint, prompt and count")
    p.add_argument("--out", help="add a row to this JSON list")
    args = p.parse_args(argv)
    if torch is None:
        print(f"error: this script needs PyTorch ({g.TORCH_MISSING})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA GPU: this peer times generation on the GPU", file=sys.stderr)
        return 2
    try:
        cfg, tensors, trained = g.read_checkpoint(args.checkpoint)
        prompt = list(args.prompt.encode())
        if args.prompt_len is not None:
            if args.prompt_len < 1 or not prompt:
                raise g.Failure("--prompt-len needs a positive length and a non-empty --prompt")
            prompt = (prompt * args.prompt_len)[: args.prompt_len]
        if not prompt or args.count < 1 or len(prompt) + args.count > cfg["context"]:
            raise g.Failure(
                f"a prompt of {len(prompt)} bytes and {args.count} new ones: the prompt needs a byte, "
                f"the count at least 1, and both must fit in the model's context (at most {cfg['context']})"
            )
        device = torch.device("cuda")
        model = g.GPT(cfg, "sdpa")
        model.load_state_dict(tensors)
        model.to(device=device, dtype=torch.bfloat16).eval()
        cache = StaticCache(cfg, device)
        if args.compile:
            # the cache is written in place at every step: marked as a buffer that stays
            # where it is, as Hugging Face's static cache marks it, so that the step is
            # captured as a CUDA graph rather than run launch by launch
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
            masked = torch.compile(step_masked(model, cfg, cache), mode="reduce-overhead")
            step = lambda token, pos: masked(token, torch.tensor([pos], device=device))
            how = "compiled, masked static cache"
        else:
            step = lambda token, pos: step_sliced(model, cfg, cache, token, pos)
            how = "eager, sliced static cache"

        def call():
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = generate(model, cfg, cache, prompt, args.count, step)
            torch.cuda.synchronize()
            return out, time.perf_counter() - start

        text = bytes(call()[0].tolist())
        seconds = statistics.median(call()[1] for _ in range(max(args.runs, 1)))
        tokens_per_s = args.count / seconds
        print(bytes(prompt).decode(errors="replace") + text.decode(errors="replace"))
        print(f"PyTorch ({how}): {args.count} tokens at {tokens_per_s:.0f} tokens/s (median of {max(args.runs, 1)} runs)")
        row = {
            "device": g.describe(device),
            "commit": g.commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "model": os.path.basename(args.checkpoint),
            "config": cfg,
            "trained_steps": trained,
            "how": how,
            "prompt_len": len(prompt),
            "count": args.count,
            "temperature": 0.0,
            "runs": max(args.runs, 1),
            "tokens_per_s_cached": tokens_per_s,
            "text": text.decode(errors="replace"),
        }
        if args.against:
            ours = [
                r for r in read_ours(args.against)
                if r.get("model") == row["model"] and r.get("prompt_len") == len(prompt)
                and r.get("count") == args.count and r.get("temperature") == 0.0 and "text" in r
            ]
            if not ours:
                raise g.Failure(f"--against {args.against}: no row of {row['model']} at temperature 0 with this prompt length and count")
            theirs = ours[-1]["text"]
            same = 0
            for a, b in zip(theirs, row["text"]):
                if a != b:
                    break
                same += 1
            row["same_text"] = theirs == row["text"]
            row["same_prefix"] = same
            # on the GPU, our fastest way: each step one graph, where the row has it
            graph = ours[-1].get("tokens_per_s_graph")
            row["ours_tokens_per_s"] = graph or ours[-1]["tokens_per_s_cached"]
            row["ours_how"] = "one graph a step" if graph else "with the cache"
            print(
                f"ours ({row['ours_how']}): {row['ours_tokens_per_s']:.0f} tokens/s, {row['ours_tokens_per_s'] / tokens_per_s:.2f}x; "
                + ("the same bytes" if row["same_text"] else f"the texts agree for {same} characters")
            )
        if args.out:
            rows = []
            if os.path.exists(args.out):
                with open(args.out) as f:
                    rows = json.load(f)
            rows.append(row)
            with open(args.out, "w") as f:
                f.write(g.row_a_line(rows))
            print(f"row added to {args.out}")
        return 0
    except g.Failure as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
