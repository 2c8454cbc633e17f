#!/usr/bin/env python3
"""Step 05's model in PyTorch: the same GPT, the same weights, the same batches, the same
optimizer, so that its losses can be held against our trainer's step by step, and its speed and
memory measured beside ours.

What is the same as `cargo run --release -p step05-train -- train` (steps/05-train/src/):
  model      GPT-2's pre-LayerNorm blocks over bytes (model.rs): token and position embeddings;
             LayerNorm with eps 1e-5 and the biased variance; the fused q/k/v projection, its
             columns q's heads, then k's, then v's; causal attention scaled by 1/sqrt(head_dim);
             an MLP 4x wide with GELU in its tanh form; a final LayerNorm; the output layer tied
             to the token embedding; the mean cross-entropy of the next byte. Matrices are
             [in, out], as GPT-2's Conv1D and our checkpoints keep them, under the same names,
             so `load_state_dict` takes our safetensors file as it is.
  weights    --init PATH: a checkpoint our trainer wrote (`train --steps 0 --save PATH` writes
             the initial weights). Without it, our initialisation from --seed, reproduced here
             bit for bit: the same SplitMix64 stream and Box-Muller draws as Params::init.
  batches    our sampler (data.rs train_batch, heldout_batches), reproduced: SplitMix64 seeded
             with seed ^ step * 0xD1342543DE82EF95, one draw per sequence for its offset; the
             held-out windows spread evenly. The corpus is our token file (`--save-tokens`).
  optimizer  AdamW with betas (0.9, 0.95), eps 1e-8, weight decay on the matrices only (the two
             embeddings and the four matrices of each block), as optim.rs; the rate warmed up
             linearly then decayed by a cosine to --min-lr-frac of it (Schedule::lr); the
             gradients clipped to a global norm of --clip, scaled only when above it.

What differs by device: on CUDA the forward runs under bf16 autocast (the weights, gradients
and AdamW stay f32) and AdamW is fused; on the CPU everything is f32, as ours.

--precision picks how the CUDA run rounds: autocast (the default: PyTorch's bf16 autocast, as
people train), ours (bf16 where our GPU trainer rounds to bf16 and nowhere else: autocast rounds
every product's result to bf16, ours keeps in f32 the products that add into the residual
stream, the logits, and the input gradients that reach a LayerNorm, and every weight's
gradient; see OursProduct), or f32 (no bf16 at all, TF32 off: the exact run both approximate).

--attention picks the attention: sdpa (scaled_dot_product_attention as PyTorch chooses),
flash / cudnn / efficient / math (that backend forced with torch.nn.attention.sdpa_kernel),
by-hand (softmax(q.k^T/sqrt(d), causal mask) . v, the whole table). --compile compiles the model
with torch.compile.

Timing: each step from its batch to the optimizer's update, the GPU synchronised at both ends;
the held-out losses are not timed. The run's tokens/s is ours: every step but the first (which
compiles) over those steps' seconds. Peak memory: torch.cuda.max_memory_allocated over the run
(weights, gradients, AdamW's moments, activations), reset before the model is made.

--out writes the run in the schema of our RunRecord (train.rs), so the charts read both:
`trainer` is pytorch-eager or pytorch-compiled, `attention` the one used (sdpa-default,
flash-attention-2, cudnn, memory-efficient, math, by-hand). Besides, what only a PyTorch run
has: `framework` (PyTorch's version), `host` (the device in words), `weights` (where they came
from) and, with --profile, `kernels`: the attention operations and kernels torch.profiler saw
in one more forward and backward after the run.

# [step 09]
--documents packs files as `train --documents` does (step 09): a token attends to the earlier
tokens of its own file only, never across a file boundary inside its window. The boundaries are
the token file's (our --save-tokens writes where each file begins after the bytes); each window's
document ids are counted as data.rs window_documents counts them. The mask is the block-diagonal
causal one, given to scaled_dot_product_attention as a boolean attn_mask ([B, 1, T, T], True
where a query sees a key), or to --attention by-hand as its mask. Not FlexAttention: its document
mask (create_block_mask with a mask_mod comparing document ids) is the same mask, but PyTorch
2.15 refuses its backward on the CPU ("FlexAttention does not support backward on CPU"), and
this comparison trains on the CPU.

# [/step 09]
--like OUR_RUN.json takes the model and every setting from our trainer's record (written with
--out): the run then has our run's weights, batches and schedule. --check-against OUR_RUN.json
does the same, and compares the two runs' losses step by step; it exits with status 1 if any
differs by more than --tolerance, relatively.

Usage (see steps/05-train/README.md):
  cargo run --release -p step05-train -- train --steps 0 --save-tokens corpus.tokens
  python3 steps/05-train/peers/gpt_pytorch.py --data corpus.tokens --check-against ours.json
  python3 steps/05-train/peers/gpt_pytorch.py --device cuda --preset gpt2-small \\
      --data corpus.tokens --attention flash --steps 60 --out run.json
"""
import argparse
import datetime
import json
import math
import os
import platform
import statistics
import struct
import subprocess
import sys
import time

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as e:  # --help still works; main() says what is missing
    torch = F = None
    nn = type("nn", (), {"Module": object})
    TORCH_MISSING = str(e)

MASK64 = (1 << 64) - 1
# SplitMix64's increment (steps/00-core/src/inputs.rs), and the odd constant data.rs mixes the
# step into the seed with
GAMMA = 0x9E3779B97F4A7C15
STEP_MIX = 0xD1342543DE82EF95
TOKEN_MAGIC = b"GPTBYTES"
LAYERNORM_EPS = 1e-5
ATTENTIONS = ("sdpa", "flash", "cudnn", "efficient", "math", "by-hand")
# --precision: in words, and as the run's record names it (RunRecord::precision)
PRECISIONS = {
    "autocast": "bf16 autocast",
    "ours": "bf16 where our trainer rounds",
    "f32": "f32",
}
PRECISION_NAMES = {"autocast": "bf16-mixed", "ours": "bf16-as-ours", "f32": "f32"}
# our trainer's defaults (steps/05-train/src/main.rs), so a run without flags is the same run
DEFAULTS = dict(
    layers=4, d_model=128, heads=4, context=128, batch=16, steps=1000, lr=3e-3,
    min_lr_frac=0.1, warmup=50, weight_decay=0.1, clip=1.0, seed=1337, eval_every=100,
    eval_batches=8,
)
# GPT-2 small (Radford et al. 2019) over bytes, at llm.c's batch for one GPU
PRESETS = {
    "gpt2-small": dict(layers=12, d_model=768, heads=12, context=2048, batch=12, lr=6e-4),
}
ADAMW = dict(beta1=0.9, beta2=0.95, eps=1e-8)


class Failure(Exception):
    """A mistake of the caller's, said in a sentence: printed without a traceback."""


# ---------------------------------------------------------------------------------------------
# The random streams: SplitMix64 (Steele, Lea & Flood 2014), as steps/00-core/src/inputs.rs


class SplitMix64:
    def __init__(self, seed):
        self.state = seed & MASK64

    def next_u64(self):
        self.state = (self.state + GAMMA) & MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        return z ^ (z >> 31)


def signed64(x):
    """A 64-bit pattern as the int64 that holds it."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def shr(z, k):
    """A logical right shift of int64 values taken as 64-bit patterns (>> on int64 is
    arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def splitmix_draws(seed, first, count):
    """Draws first+1 ... first+count of SplitMix64(seed), at once: the k-th draw is the mix of
    seed + k * GAMMA, so a stream can be cut anywhere and computed as a tensor (int64 products
    wrap as the u64 ones do; the shifts are made logical)."""
    k = torch.arange(first + 1, first + count + 1, dtype=torch.int64)
    z = signed64(seed) + k * signed64(GAMMA)
    z = (z ^ shr(z, 30)) * signed64(0xBF58476D1CE4E5B9)
    z = (z ^ shr(z, 27)) * signed64(0x94D049BB133111EB)
    return z ^ shr(z, 31)


def our_init(cfg, seed):
    """Params::init (model.rs): every matrix normal with sigma 0.02, the two projections into
    the residual stream 0.02/sqrt(2*layers), LayerNorm gains 1, biases 0; one stream of the
    seed, tensor after tensor in the order of Params::tensors, two draws per value (Box-Muller,
    the cosine of the pair)."""
    residual = 0.02 / math.sqrt(2.0 * cfg["layers"])
    drawn = 0
    out = {}
    for name, shape in tensor_shapes(cfg):
        count = math.prod(shape)
        if name.endswith("c_proj.weight"):
            sigma = residual
        elif name.endswith(".weight") and len(shape) == 2:
            sigma = 0.02
        elif "ln_" in name and name.endswith(".weight"):
            out[name] = torch.ones(shape)
            continue
        else:
            out[name] = torch.zeros(shape)
            continue
        z = splitmix_draws(seed, drawn, 2 * count)
        drawn += 2 * count
        # next_unit: uniform in (0, 1], never 0
        u = (shr(z, 11) + 1).double() / float(1 << 53)
        u1, u2 = u[0::2], u[1::2]
        normal = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        out[name] = (sigma * normal).float().reshape(shape)
    return out


def tensor_shapes(cfg):
    """Every weight's name and shape, in the order of Params::tensors (model.rs)."""
    c, v, t = cfg["d_model"], cfg["vocab"], cfg["context"]
    qkv = 3 * c
    qkv = c + 2 * cfg["kv_heads"] * (c // cfg["heads"])  # k and v: kv_heads heads each  # [step 08]
    yield "wte.weight", (v, c)
    yield "wpe.weight", (t, c)
    for i in range(cfg["layers"]):
        for what, shape in (
            ("ln_1.weight", (c,)), ("ln_1.bias", (c,)),
            ("attn.c_attn.weight", (c, qkv)), ("attn.c_attn.bias", (qkv,)),
            ("attn.c_proj.weight", (c, c)), ("attn.c_proj.bias", (c,)),
            ("ln_2.weight", (c,)), ("ln_2.bias", (c,)),
            ("mlp.c_fc.weight", (c, 4 * c)), ("mlp.c_fc.bias", (4 * c,)),
            ("mlp.c_proj.weight", (4 * c, c)), ("mlp.c_proj.bias", (c,)),
        ):
            yield f"h.{i}.{what}", shape
    yield "ln_f.weight", (c,)
    yield "ln_f.bias", (c,)


# ---------------------------------------------------------------------------------------------
# Our files: safetensors checkpoints (checkpoint.rs) and token files (data.rs Corpus::save)


def read_checkpoint(path):
    """(config, {name: f32 tensor}, step) of a checkpoint our trainer wrote. safetensors is read
    here (8 bytes of header length, the JSON header, the little-endian data) so that nothing
    beyond PyTorch is needed."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise Failure(f"--init {path}: {e.strerror}")
    bad = lambda why: Failure(f"--init {path}: {why}; it takes a checkpoint written by `train --save`")
    if len(data) < 8:
        raise bad("too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        raise bad("not a safetensors file")
    meta = header.pop("__metadata__", {}) or {}
    if meta.get("format") != "step05-train" or "config" not in meta:
        raise bad("no step05-train configuration in its metadata")
    cfg = json.loads(meta["config"])
    cfg.setdefault("kv_heads", cfg["heads"])  # a checkpoint from before grouped heads  # [step 08]
    tensors = {}
    for name, info in header.items():
        if name.startswith("adamw."):
            continue  # the optimizer's moments: zero in a checkpoint of the initial weights
        if info["dtype"] != "F32":
            raise bad(f"{name} is {info['dtype']}, not F32")
        start, end = info["data_offsets"]
        raw = bytearray(data[8 + n + start : 8 + n + end])
        tensors[name] = torch.frombuffer(raw, dtype=torch.float32).reshape(info["shape"]).clone()
    return cfg, tensors, int(meta.get("step", "0"))


def read_corpus(path):
    """(training bytes, held-out bytes, description) from a token file our trainer wrote with
    --save-tokens: `GPTBYTES`, four little-endian u64 (training bytes, held-out bytes, training
    files, held-out files), the training bytes, the held-out bytes. A plain text file is split
    as our trainer splits one: its last tenth held out."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise Failure(f"--data {path}: {e.strerror}")
    if data.startswith(TOKEN_MAGIC):
        if len(data) < 40:
            raise Failure(f"--data {path}: a token file shorter than its header")
        train, heldout, train_files, heldout_files = struct.unpack("<4Q", data[8:40])
        # [step 09]
        # after the bytes, where each file begins (data.rs Corpus::save), if the writer knew
        file_starts = read_file_starts(path, data[40 + train + heldout:], train, heldout)
        data = data[:40 + train + heldout]
        # [/step 09]
        if len(data) != 40 + train + heldout:
            raise Failure(
                f"--data {path}: the header says {train} + {heldout} bytes but {len(data) - 40} follow it"
            )
        body = torch.frombuffer(bytearray(data[40:]), dtype=torch.uint8)
        return body[:train], body[train:], dict(
            source=path, train_files=train_files, heldout_files=heldout_files,
            file_starts=file_starts,  # [step 09]
        )
    if os.path.isdir(path):
        raise Failure(
            f"--data {path}: a folder; write it as a token file with our trainer first "
            "(`train --data FOLDER --steps 0 --save-tokens corpus.tokens`), so both split it alike"
        )
    if len(data) < 2:
        raise Failure(f"--data {path}: {len(data)} bytes; a text file to train on needs some text")
    cut = len(data) - len(data) // 10
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return body[:cut], body[cut:], dict(
        source=path, train_files=1, heldout_files=1,
        file_starts=([0], [0]),  # one file: each part one document  # [step 09]
    )
# [step 09]


def read_file_starts(path, trailer, train, heldout):
    """The file starts after a token file's bytes: for the training and then the held-out
    part, a u64 count and that many u64 offsets, increasing from 0 inside the part; None for
    a file that has none (written before step 09)."""
    if not trailer:
        return None
    if len(trailer) % 8:
        raise Failure(f"--data {path}: not a valid token file: bytes follow its file starts")
    words = list(struct.unpack(f"<{len(trailer) // 8}Q", trailer))
    parts = []
    for what, n in (("training", train), ("held-out", heldout)):
        if not words or words[0] > len(words) - 1:
            raise Failure(f"--data {path}: not a valid token file: its {what} file starts end early")
        count, starts, words = words[0], words[1:1 + words[0]], words[1 + words[0]:]
        if not starts or starts[0] != 0 or any(a >= b for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
            raise Failure(
                f"--data {path}: not a valid token file: its {what} file starts are not increasing from 0 below {n}"
            )
        parts.append(starts)
    if words:
        raise Failure(f"--data {path}: not a valid token file: bytes follow its file starts")
    return tuple(parts)
# [/step 09]


# ---------------------------------------------------------------------------------------------
# The batches (data.rs)


# ANCHOR: batches
def train_starts(n, batch, tokens, seed, step):
    """train_batch's offsets: `batch` draws of one stream of seed and step, modulo the
    span."""
    rng = SplitMix64(seed ^ ((step * STEP_MIX) & MASK64))
    span = n - tokens  # starts 0..span leave room for the targets
    return [rng.next_u64() % span for _ in range(batch)]


def heldout_starts(n, batch, tokens, count):
    """heldout_batches's offsets: batch * count windows spread evenly over the held-out
    bytes."""
    span, windows = n - tokens, batch * count
    return [[(c * batch + b) * span // windows for b in range(batch)] for c in range(count)]
# ANCHOR_END: batches


def windows(data, starts, tokens):
    """inputs [B, T] and targets [B, T], the next byte of each input, as int64 on data's
    device."""
    at = torch.tensor(starts, dtype=torch.int64, device=data.device)
    idx = at[:, None] + torch.arange(tokens + 1, device=data.device)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]
# [step 09]


def documents_mask(file_starts, starts, tokens, device):
    """The block-diagonal causal mask of windows of `tokens` bytes at `starts`, in a part whose
    files begin at `file_starts`: [B, 1, T, T], True where query q sees key k, that is k <= q
    and both from the same file (data.rs window_documents: each token's id, the files begun by
    it less those begun by its window's first byte)."""
    begun = torch.tensor(file_starts, dtype=torch.int64)
    at = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(tokens)
    ids = torch.searchsorted(begun, at, right=True)
    same = ids[:, :, None] == ids[:, None, :]
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    return (same & causal)[:, None].to(device)
# [/step 09]


# ---------------------------------------------------------------------------------------------
# The model (model.rs), named as GPT-2 so that our checkpoint's names are its state_dict's


# ANCHOR: ours_product
class OursProduct(torch.autograd.Function if torch else object):
    """x . W as each of our GPU trainer's cuBLAS calls computes it (steps/05-train/src/cuda/
    gemm.rs): operands rounded to bf16, the products summed in f32, the result in f32
    (the caller rounds it to bf16 where ours writes bf16). The backward rounds the incoming
    gradient to bf16, as ours keeps every operand of a product; dW stays f32, as ours writes
    every weight's gradient; dx is rounded to bf16 where ours writes it in bf16 (`dx_bf16`).

    The f32 products run on TF32 tensor cores (precision "ours" turns TF32 on): TF32 holds a
    bf16 value exactly and sums in f32, so this is a bf16 product with an f32 result."""

    @staticmethod
    def forward(ctx, x, w, dx_bf16):
        xb, wb = x.bfloat16(), w.bfloat16()
        ctx.save_for_backward(xb, wb)
        ctx.dx_bf16 = dx_bf16
        return xb.float() @ wb.float()

    @staticmethod
    def backward(ctx, g):
        xb, wb = ctx.saved_tensors
        g = g.bfloat16().float()
        dx = g @ wb.float().t()
        if ctx.dx_bf16:
            dx = dx.bfloat16().float()
        return dx, xb.float().t() @ g, None


def ours_product(x, w, dx_bf16):
    """OursProduct over x's last dimension."""
    y = OursProduct.apply(x.reshape(-1, x.shape[-1]), w, dx_bf16)
    return y.view(*x.shape[:-1], -1)
# ANCHOR_END: ours_product


class Conv1D(nn.Module):
    """GPT-2's linear layer: y = x . W + b with W [in, out] (layers.rs linear)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], -1
        )


# ANCHOR: attention
class Attention(nn.Module):
    def __init__(self, cfg, attention, precision):
        super().__init__()
        c = cfg["d_model"]
        self.heads = cfg["heads"]
        self.kv_heads = self.heads
        self.kv_heads = cfg["kv_heads"]  # [step 08]
        self.attention = attention
        self.ours = precision == "ours"
        self.mask = None  # --documents: this batch's mask, set by GPT.set_documents  # [step 09]
        self.c_attn = Conv1D(c, c + 2 * self.kv_heads * (c // self.heads))
        self.c_proj = Conv1D(c, c)

    def forward(self, x):
        b, t, c = x.shape
        h, kv, d = self.heads, self.kv_heads, c // self.heads
        if self.ours:
            # bf16 q, k, v, the bias (in bf16) added before the rounding, as cuBLASLt's
            # epilogue
            qkv = ours_product(x, self.c_attn.weight, dx_bf16=False)
            qkv = (qkv + self.c_attn.bias.bfloat16().float()).bfloat16()
        else:
            qkv = self.c_attn(x)
        # the columns: q's heads side by side, then k's, then v's (layers.rs split_qkv)
        q, k, v = qkv.split([h * d, kv * d, kv * d], dim=2)
        q = q.view(b, t, h, d).transpose(1, 2)
        k, v = (y.view(b, t, kv, d).transpose(1, 2) for y in (k, v))
        if self.attention == "by-hand":
            # [step 08]
            # each key and value head repeated for its group of query heads (repeat_kv)
            k, v = (y.repeat_interleave(h // kv, dim=1) for y in (k, v))
            # [/step 08]
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            mask = mask if self.mask is None else self.mask  # [step 09]
            scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ v
        # [step 09]
        elif self.mask is not None:
            # --documents: the block-diagonal causal mask, as a boolean attn_mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=kv != h)
        # [/step 09]
        else:
            # the backend, if one is forced, is chosen around the whole step (sdpa_context)
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True,
                enable_gqa=kv != h,  # [step 08]
            )
        out = out.transpose(1, 2).reshape(b, t, c)
        if self.ours:
            # an f32 result into the residual stream; its input gradient in bf16, for the
            # attention's backward
            return ours_product(out, self.c_proj.weight, dx_bf16=True) + self.c_proj.bias
        return self.c_proj(out)
# ANCHOR_END: attention


class MLP(nn.Module):
    def __init__(self, c, precision):
        super().__init__()
        self.ours = precision == "ours"
        self.c_fc = Conv1D(c, 4 * c)
        self.c_proj = Conv1D(4 * c, c)

    def forward(self, x):
        if self.ours:
            # the product rounded to bf16, then its bias and GELU in f32 (train.cu bias_gelu);
            # GELU's output is rounded as the next product reads it
            up = ours_product(x, self.c_fc.weight, dx_bf16=False).bfloat16().float()
            hidden = F.gelu(up + self.c_fc.bias, approximate="tanh")
            return ours_product(hidden, self.c_proj.weight, dx_bf16=True) + self.c_proj.bias
        # GELU's tanh form, as GPT-2 and layers.rs gelu
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg, attention, precision):
        super().__init__()
        c = cfg["d_model"]
        self.ln_1 = nn.LayerNorm(c, eps=LAYERNORM_EPS)
        self.attn = Attention(cfg, attention, precision)
        self.ln_2 = nn.LayerNorm(c, eps=LAYERNORM_EPS)
        self.mlp = MLP(c, precision)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg, attention, precision="autocast"):
        super().__init__()
        self.ours = precision == "ours"
        self.wte = nn.Embedding(cfg["vocab"], cfg["d_model"])
        self.wpe = nn.Embedding(cfg["context"], cfg["d_model"])
        self.h = nn.ModuleList(Block(cfg, attention, precision) for _ in range(cfg["layers"]))
        self.ln_f = nn.LayerNorm(cfg["d_model"], eps=LAYERNORM_EPS)
    # [step 09]

    def set_documents(self, mask):
        """The mask every block's attention takes from now on: documents_mask's, or None for
        causal attention over the whole window."""
        for block in self.h:
            block.attn.mask = mask
    # [/step 09]

    def forward(self, inputs, targets):
        t = inputs.shape[1]
        x = self.wte(inputs) + self.wpe(torch.arange(t, device=inputs.device))
        for block in self.h:
            x = block(x)
        # the output layer is the token embedding, transposed (tied, as GPT-2)
        if self.ours:
            # f32 logits, and an f32 gradient into the last LayerNorm
            logits = ours_product(self.ln_f(x), self.wte.weight.t(), dx_bf16=False)
        else:
            logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------
# The optimizer's schedule and the clipping (optim.rs)


def f32(x):
    """x rounded to the nearest f32."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def schedule_lr(s, step):
    """Schedule::lr: linear warm-up to max over `warmup` steps, then a cosine to min at the last
    step; rounded to f32 after each operation, as ours computes it (the cosine itself in f64,
    then rounded: within an ulp of f32's)."""
    hi, lo = f32(s["max"]), f32(s["min"])
    if step < s["warmup"]:
        return f32(f32(hi * (step + 1)) / s["warmup"])
    decay_steps = max(s["steps"] - s["warmup"], 1)
    progress = min(f32((step - s["warmup"]) / decay_steps), 1.0)
    cosine = f32(0.5 * f32(1.0 + f32(math.cos(f32(f32(math.pi) * progress)))))
    return f32(lo + f32(cosine * f32(hi - lo)))


# ANCHOR: clip
def clip_grad_norm(grads, max_norm, exact):
    """clip_grad_norm (optim.rs): the global norm, and every gradient scaled by
    max_norm / norm when it is above max_norm, as ours (torch.nn.utils.clip_grad_norm_
    divides by norm + 1e-6 instead: too small a difference for the check to see, but not
    ours). `exact` sums the squares in f64, as ours."""
    if exact:
        norm = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().float()
    else:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    limit = torch.tensor(max_norm, dtype=torch.float32, device=norm.device)
    scale = torch.clamp(limit / norm, max=1.0)
    torch._foreach_mul_(grads, scale)
    return norm
# ANCHOR_END: clip


# ---------------------------------------------------------------------------------------------
# The run


def sdpa_context(attention):
    from contextlib import nullcontext

    if attention in ("sdpa", "by-hand"):
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[attention]
    return sdpa_kernel(backend)


def describe(device):
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, PyTorch {torch.__version__})"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model} ({torch.get_num_threads()} threads, PyTorch {torch.__version__})"


def row_a_line(value, sort_keys=False):
    """`value` as JSON laid out one row a line, as the Rust side writes every file of
    charts/data/ (flash_core::row::row_a_line): a list whose first item is an object, when it
    is the whole file or one of the file's fields, puts each item on a line of its own; an
    object that is the whole file puts each field on a line of its own; everything else stays
    on one line."""
    def one(v):
        return json.dumps(v, sort_keys=sort_keys, ensure_ascii=False)

    def rows(v, indent):
        if isinstance(v, list) and v and isinstance(v[0], dict):
            inner = indent + "  "
            return "[\n" + ",\n".join(inner + one(x) for x in v) + "\n" + indent + "]"
        return one(v)

    if isinstance(value, dict) and value:
        fields = sorted(value.items()) if sort_keys else value.items()
        return "{\n" + ",\n".join(f"  {one(k)}: {rows(v, '  ')}" for k, v in fields) + "\n}\n"
    return rows(value, "") + "\n"


def commit():
    """`BENCH_COMMIT` if set (a copy of the tree on another machine is no checkout: the caller
    names the commit it came from); else the commit as the Rust binaries name theirs
    (steps/00-core/build.rs): git's short hash, `-dirty` if tracked files differ from it, where
    the git repository around this file is this one, and `unknown` elsewhere."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    root = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

    def git(*args):
        out = subprocess.run(["git", "--no-optional-locks", "-C", root, *args], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None

    try:
        # a copy of the tree inside another repository is not that repository's commit
        top = git("rev-parse", "--show-toplevel")
        head = git("rev-parse", "--short", "HEAD")
        if top is None or os.path.realpath(top) != root or not head:
            return "unknown"
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except OSError:
        return "unknown"


# the attention as the run's record names it (RunRecord::attention: a peer names its own)
ATTENTION_NAMES = {
    "sdpa": "sdpa-default",
    "flash": "flash-attention-2",
    "cudnn": "cudnn",
    "efficient": "memory-efficient",
    "math": "math",
    "by-hand": "by-hand",
}


def throughput(steps, tokens_per_step):
    """train.rs throughput: the tokens of every step but the first over those steps' seconds
    (the first compiles kernels, and with --compile the model)."""
    if len(steps) < 2:
        return 0.0
    return (len(steps) - 1) * tokens_per_step / sum(r["ms"] / 1e3 for r in steps[1:])


def kernels_seen(step_fn, cuda):
    """One more forward and backward (no update) under torch.profiler: the attention operations
    PyTorch dispatched to and, on the GPU, the attention kernels it launched."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step_fn()
        if cuda:
            torch.cuda.synchronize()
    seen = []
    for e in prof.events():
        name = e.name
        is_op = name.startswith("aten::_scaled_dot_product") or name.startswith("aten::_flash")
        is_op = is_op or name.startswith("aten::_efficient_attention") or name.startswith("aten::_cudnn_attention")
        is_kernel = cuda and getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")
        keep = is_op or (
            is_kernel and any(w in name.lower() for w in ("flash", "fmha", "attn", "attention", "sdpa", "cudnn"))
        )
        if keep:
            short = name.split("(")[0]
            if short.startswith("void "):
                short = short[5:]
            short = short.split("<")[0]
            if short not in seen:
                seen.append(short)
    return seen


def settings_from(args, record, init_cfg):
    """The model and every setting: our run's record's with --like or --check-against (flags
    that disagree with it are refused), else the preset's, the flags' and our trainer's defaults;
    with --init the model is the checkpoint's (flags that disagree are refused)."""
    given = {k: getattr(args, k) for k in DEFAULTS if getattr(args, k) is not None}
    if record is not None:
        cfg = dict(record["config"])
        cfg.setdefault("kv_heads", cfg["heads"])  # a run from before grouped heads  # [step 08]
        s = record["settings"]
        from_record = dict(
            layers=cfg["layers"], d_model=cfg["d_model"], heads=cfg["heads"],
            context=cfg["context"], batch=s["batch"], steps=s["steps"], clip=s["clip"],
            seed=s["seed"], eval_every=s["eval_every"], eval_batches=s["eval_batches"],
            weight_decay=s["adamw"]["weight_decay"],
        )
        for k, v in given.items():
            if k in from_record and from_record[k] != v and not (k == "steps" and v < from_record[k]):
                raise Failure(
                    f"--{k.replace('_', '-')} {v}, but the run to check against has {from_record[k]}: "
                    "--like and --check-against take every setting from the run (fewer --steps may be given)"
                )
        # [step 08]
        if args.kv_heads is not None and args.kv_heads != cfg["kv_heads"]:
            raise Failure(
                f"--kv-heads {args.kv_heads}, but the run to check against has {cfg['kv_heads']}: "
                "--like and --check-against take the model from the run"
            )
        # [/step 08]
        # [step 09]
        if args.documents and not s.get("documents", False):
            raise Failure(
                "--documents, but the run to check against trained without it: --like and "
                "--check-against take every setting from the run (its --documents too)"
            )
        # [/step 09]
        settings = dict(s)
        settings["train_steps"] = given.get("steps", s["steps"])
        if record.get("started_at_step", 0) != 0:
            raise Failure("--like and --check-against take a run that started from step 0, not a resumed one")
        return cfg, settings
    v = dict(DEFAULTS)
    if args.preset:
        v.update(PRESETS[args.preset])
    if init_cfg is not None:
        for k in ("layers", "d_model", "heads", "context"):
            if k in given and given[k] != init_cfg[k]:
                raise Failure(
                    f"--{k.replace('_', '-')} {given[k]}, but --init {args.init} is a model of {init_cfg}; "
                    "leave out the model's flags to take the checkpoint's"
                )
            v[k] = init_cfg[k]
    if "lr" not in given and given.get("d_model", v["d_model"]) >= 768:
        v["lr"] = 6e-4  # as ours (main.rs, default_lr): GPT-2 small's rate from its width on
    v.update(given)
    cfg = dict(layers=v["layers"], d_model=v["d_model"], heads=v["heads"], context=v["context"], vocab=256)
    # [step 08]
    # one key and value head per query head, unless --kv-heads or the checkpoint says otherwise
    cfg["kv_heads"] = init_cfg["kv_heads"] if init_cfg is not None else cfg["heads"]
    if args.kv_heads is not None:
        if init_cfg is not None and args.kv_heads != init_cfg["kv_heads"]:
            raise Failure(
                f"--kv-heads {args.kv_heads}, but --init {args.init} is a model of {init_cfg}; "
                "leave out the model's flags to take the checkpoint's"
            )
        cfg["kv_heads"] = args.kv_heads
    if cfg["kv_heads"] < 1 or cfg["heads"] % cfg["kv_heads"]:
        raise Failure(
            f"--kv-heads {cfg['kv_heads']} does not divide --heads {cfg['heads']}: each key and value head "
            f"is shared by heads / kv_heads query heads; accepted: "
            + ", ".join(str(n) for n in range(1, cfg["heads"] + 1) if cfg["heads"] % n == 0)
        )
    # [/step 08]
    steps = v["steps"]
    settings = dict(
        batch=v["batch"],
        seq_len=args.seq_len or cfg["context"],
        steps=steps,
        schedule=dict(max=v["lr"], min=f32(f32(v["lr"]) * f32(v["min_lr_frac"])),
                      warmup=v["warmup"], steps=steps),
        adamw=dict(ADAMW, weight_decay=v["weight_decay"]),
        clip=v["clip"],
        seed=v["seed"],
        eval_every=v["eval_every"],
        eval_batches=v["eval_batches"],
        train_steps=steps,
        documents=bool(args.documents),  # [step 09]
    )
    return cfg, settings


def run(args):
    record = None
    if args.check_against and args.like:
        raise Failure("--like and --check-against both take the run's settings: give one")
    like = args.check_against or args.like
    if like:
        flag = "--check-against" if args.check_against else "--like"
        try:
            with open(like) as f:
                record = json.load(f)
        except (OSError, ValueError) as e:
            raise Failure(f"{flag} {like}: {e}")
        if not isinstance(record, dict) or "steps" not in record or "settings" not in record:
            raise Failure(f"{flag} {like}: not a run written by our trainer's --out")
    init = read_checkpoint(args.init) if args.init else None
    cfg, s = settings_from(args, record, init[0] if init else None)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise Failure(
            f"--device cuda, but this PyTorch ({torch.__version__}) sees no CUDA GPU; "
            "run with --device cpu, or on a machine with a GPU and a CUDA build of PyTorch"
        )
    if args.attention == "cudnn" and not cuda:
        raise Failure("--attention cudnn runs on the GPU only: use --device cuda, or sdpa/flash/math/by-hand")
    # [step 08]
    if args.attention == "efficient" and cfg["kv_heads"] != cfg["heads"]:
        raise Failure(
            f"--attention efficient with kv_heads {cfg['kv_heads']} of heads {cfg['heads']}: PyTorch's "
            "memory-efficient backend takes as many key and value heads as query heads; use sdpa, flash, "
            "cudnn, math or by-hand"
        )
    # [/step 08]
    torch.manual_seed(0)  # nothing here is random but what our streams give; dropout is absent
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    # the weights
    if init:
        init_cfg, weights, step = init
        if step != 0:
            raise Failure(f"--init {args.init}: a checkpoint after {step} steps; it takes the initial weights (`train --steps 0 --save PATH`)")
        if {k: init_cfg[k] for k in cfg} != cfg:
            raise Failure(f"--init {args.init}: a model of {init_cfg}, not of the {cfg} asked for")
        weights_from = args.init
    else:
        weights = our_init(cfg, s["seed"])
        weights_from = f"our initialisation from seed {s['seed']}"
    precision = args.precision or ("autocast" if cuda else "f32")
    if precision == "autocast" and not cuda:
        raise Failure("--precision autocast runs on the GPU only: on the CPU the run is f32 (the default) or ours")
    if cuda:
        # TF32 holds bf16 values exactly (OursProduct); with f32 it would round the operands
        torch.backends.cuda.matmul.allow_tf32 = precision == "ours"
    model = GPT(cfg, args.attention, precision)
    model.load_state_dict(weights, strict=True)
    model.to(device)
    if s["seq_len"] > cfg["context"]:
        raise Failure(f"--seq-len {s['seq_len']} is longer than the model's context of {cfg['context']}")

    # the corpus
    if args.data:
        train_text, heldout_text, corpus = read_corpus(args.data)
    elif args.random_data:
        g = torch.Generator().manual_seed(s["seed"])
        body = torch.randint(0, 256, (args.random_data,), dtype=torch.uint8, generator=g)
        cut = len(body) - len(body) // 10
        train_text, heldout_text = body[:cut], body[cut:]
        corpus = dict(source=f"{args.random_data} uniformly random bytes (seed {s['seed']})", train_files=0, heldout_files=0)
    else:
        raise Failure(
            "no --data: give the token file our trainer writes with --save-tokens "
            "(`cargo run --release -p step05-train -- train --steps 0 --save-tokens corpus.tokens`), "
            "or --random-data BYTES to time the model on random bytes"
        )
    for what, part in (("training", train_text), ("held-out", heldout_text)):
        if len(part) < s["seq_len"] + 1:
            raise Failure(f"{corpus['source']}: {len(part)} {what} bytes, fewer than one sequence of {s['seq_len']} tokens and its next")
    train_data = train_text.to(device)
    heldout_data = heldout_text.to(device)
    # [step 09]
    documents = s.get("documents", False)
    if documents and args.random_data:
        raise Failure("--documents packs the files of --data; --random-data has none")
    if documents and corpus["file_starts"] is None:
        raise Failure(
            f"--documents: {corpus['source']} does not say where its files begin (a token file written "
            "before step 09); accepted: a token file our trainer writes now (train --save-tokens), or a text file"
        )
    # [/step 09]

    # ANCHOR: adamw
    # AdamW with the decay on matrices only (optim.rs: `w.ndim() == 2`)
    params = list(model.parameters())
    decay = [p for p in params if p.dim() == 2]
    no_decay = [p for p in params if p.dim() != 2]
    a = s["adamw"]
    opt = torch.optim.AdamW(
        [dict(params=decay, weight_decay=a["weight_decay"]),
         dict(params=no_decay, weight_decay=0.0)],
        lr=s["schedule"]["max"], betas=(a["beta1"], a["beta2"]), eps=a["eps"],
        **(dict(fused=True) if cuda else dict(foreach=False)),
    )
    # ANCHOR_END: adamw

    forward = torch.compile(model) if args.compile else model
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if precision == "autocast"
        else torch.autocast(device.type, enabled=False)
    )
    batch, tokens = s["batch"], s["seq_len"]

    def loss_of(inputs, targets):
        with autocast, sdpa_context(args.attention):
            return forward(inputs, targets)

    # ANCHOR: train_step
    def train_step(step):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        starts = train_starts(len(train_text), batch, tokens, s["seed"], step)
        inputs, targets = windows(train_data, starts, tokens)
        # [step 09]
        if documents:
            model.set_documents(documents_mask(corpus["file_starts"][0], starts, tokens, device))
        # [/step 09]
        loss = loss_of(inputs, targets)
        loss.backward()
        norm = clip_grad_norm([p.grad for p in params], s["clip"], exact=not cuda)
        lr = schedule_lr(s["schedule"], step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss, norm = loss.item(), norm.item()  # waits for the GPU
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        return dict(step=step + 1, loss=loss, lr=lr, grad_norm=norm, ms=seconds * 1e3,
                    tokens_per_s=batch * tokens / seconds)
    # ANCHOR_END: train_step

    held_starts = heldout_starts(len(heldout_text), batch, tokens, s["eval_batches"])
    heldout = [windows(heldout_data, st, tokens) for st in held_starts]
    # [step 09]
    held_masks = [
        documents_mask(corpus["file_starts"][1], st, tokens, device) if documents else None
        for st in held_starts
    ]
    # [/step 09]

    @torch.no_grad()
    def evaluate(step, train_seconds):
        total = 0.0
        for i, (x, y) in enumerate(heldout):
            model.set_documents(held_masks[i])  # [step 09]
            total += loss_of(x, y).item()
        return dict(step=step, loss=total / len(heldout), train_seconds=train_seconds)

    n_params = sum(p.numel() for p in params)
    print(f"corpus: {corpus['source']}: {len(train_text)} training and {len(heldout_text)} held-out bytes")
    print(f"weights: {weights_from}")
    print(
        f"model: {cfg}, {n_params} parameters; {batch} sequences x {tokens} tokens a step; "
        f"{describe(device)}; attention {args.attention}{', compiled' if args.compile else ''}"
        f", {PRECISIONS[precision]}"
    )
    out = dict(
        config=dict(cfg, vocab=256),
        settings=dict({k: v for k, v in s.items() if k != "train_steps"}, max_seconds=args.max_seconds),
        params=n_params,
        corpus=corpus["source"],
        train_bytes=len(train_text),
        heldout_bytes=len(heldout_text),
        train_files=corpus["train_files"],
        heldout_files=corpus["heldout_files"],
        threads=torch.get_num_threads(),
        started_at_step=0,
        steps=[],
        evals=[],
        seconds=0.0,
        trainer="pytorch-compiled" if args.compile else "pytorch-eager",
        device=device.type,
        device_name=torch.cuda.get_device_name(device) if cuda else "cpu",
        attention=ATTENTION_NAMES[args.attention],
        precision=PRECISION_NAMES[precision],
        tokens_per_step=batch * tokens,
        tokens_per_s=0.0,
        peak_memory_bytes=None,
        commit=commit(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        profile=[],
        # what only a PyTorch run has
        framework=f"PyTorch {torch.__version__}",
        host=describe(device),
        weights=weights_from,
        kernels=[],
    )
    started = time.perf_counter()
    every = max(s["eval_every"], 1)
    last = s["train_steps"]
    # as train.rs: stop after the first step that ends past --max-seconds of training
    train_seconds = 0.0
    out_of_time = lambda: args.max_seconds is not None and train_seconds >= args.max_seconds
    if not args.no_eval:
        e = evaluate(0, train_seconds)
        out["evals"].append(e)
        print(f"step {0:>5} | held-out loss {e['loss']:.4f}", flush=True)
    for step in range(last):
        if out_of_time():
            print(f"stopped after {step} steps: --max-seconds {args.max_seconds}")
            break
        r = train_step(step)
        train_seconds += r["ms"] / 1e3
        r["train_seconds"] = train_seconds
        out["steps"].append(r)
        if r["step"] % args.print_every == 0 or r["step"] == last:
            print(
                f"step {r['step']:>5}/{last} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | norm {r['grad_norm']:.3f} "
                f"| {r['ms']:.1f} ms | {r['tokens_per_s']:.0f} tokens/s",
                flush=True,
            )
        if not args.no_eval and (r["step"] % every == 0 or r["step"] == last or out_of_time()):
            e = evaluate(r["step"], train_seconds)
            out["evals"].append(e)
            print(f"step {r['step']:>5} | held-out loss {e['loss']:.4f}", flush=True)
    out["seconds"] = time.perf_counter() - started
    out["tokens_per_s"] = throughput(out["steps"], batch * tokens)
    if cuda:
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    print(f"trained {len(out['steps'])} steps in {out['seconds']:.1f} s")
    if len(out["steps"]) > 1:
        ms = statistics.median(r["ms"] for r in out["steps"][1:])
        print(
            f"steps 2-{len(out['steps'])}: {out['tokens_per_s']:.0f} tokens/s, median {ms:.1f} ms a step"
            + (f"; peak memory {out['peak_memory_bytes'] / 2**30:.2f} GiB" if out["peak_memory_bytes"] else "")
        )
    if args.profile and out["steps"]:
        def one_step():
            first = train_starts(len(train_text), batch, tokens, s["seed"], 0)  # [step 09]
            model.set_documents(documents_mask(corpus["file_starts"][0], first, tokens, device) if documents else None)  # [step 09]
            x, y = windows(train_data, train_starts(len(train_text), batch, tokens, s["seed"], 0), tokens)
            loss_of(x, y).backward()
            opt.zero_grad(set_to_none=True)

        out["kernels"] = kernels_seen(one_step, cuda)
        print("attention as the profiler saw it: " + (", ".join(out["kernels"]) or "nothing it names"))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(row_a_line(out))
        print(f"run written to {args.out}")
    if args.check_against:
        return check(out, record, args.tolerance)
    return 0


def check(ours_py, theirs, tolerance):
    """Each step's training loss and each held-out loss of this run against the same of our
    trainer's run: the largest relative difference, and 1 if it is above `tolerance`."""
    pairs = []
    by_step = {r["step"]: r["loss"] for r in theirs["steps"]}
    for r in ours_py["steps"]:
        if r["step"] in by_step:
            pairs.append((f"step {r['step']}", by_step[r["step"]], r["loss"]))
    evals = {e["step"]: e["loss"] for e in theirs["evals"]}
    for e in ours_py["evals"]:
        if e["step"] in evals:
            pairs.append((f"held-out at step {e['step']}", evals[e["step"]], e["loss"]))
    if not pairs:
        print("no step in common with the run checked against")
        return 1
    print(f"\n{'':<24} {'ours':>10} {'PyTorch':>10} {'relative':>10}")
    worst = (0.0, "")
    for what, a, b in pairs:
        rel = abs(a - b) / abs(a)
        worst = max(worst, (rel, what))
        print(f"{what:<24} {a:>10.6f} {b:>10.6f} {rel:>10.2e}")
    n = len(ours_py["steps"])
    verdict = "within" if worst[0] <= tolerance else "ABOVE"
    print(
        f"\n{n} steps and {len(pairs) - sum(1 for p in pairs if p[0].startswith('step'))} held-out losses: "
        f"the largest relative difference is {worst[0]:.2e} ({worst[1]}), {verdict} the tolerance {tolerance:.0e}"
    )
    return 0 if worst[0] <= tolerance else 1


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Step 05's GPT in PyTorch: our weights, batches and optimizer; losses, speed and memory beside ours",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--attention", choices=ATTENTIONS, default="sdpa",
                   help="sdpa: PyTorch's own choice; flash, cudnn, efficient, math: that SDPA backend forced; by-hand: softmax(q.k^T) . v with a mask")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--precision", choices=tuple(PRECISIONS),
                   help="autocast: bf16 autocast (the default on cuda); ours: bf16 where our GPU trainer rounds to it, f32 elsewhere; f32: no bf16, TF32 off (the default on cpu)")
    p.add_argument("--init", help="the initial weights: a checkpoint of our trainer (train --steps 0 --save PATH); default: our initialisation from --seed, reproduced")
    p.add_argument("--data", help="our token file (train --save-tokens PATH), or a text file split as ours splits one")
    p.add_argument("--random-data", type=int, metavar="BYTES", help="without --data: this many random bytes, to time the model")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a model and batch: gpt2-small is 12 layers, d_model 768, 12 heads, context 2048, batch 12, lr 6e-4")
    for name, kind, what in (
        ("layers", int, "transformer blocks"), ("d-model", int, "width of the residual stream"),
        ("heads", int, "attention heads"), ("context", int, "positions the model has"),
        ("batch", int, "sequences per step"), ("steps", int, "steps of the whole run (the schedule's length)"),
        ("lr", float, "the largest learning rate"), ("min-lr-frac", float, "the last rate, as a fraction of --lr"),
        ("warmup", int, "steps of linear warm-up"), ("weight-decay", float, "AdamW's, on matrices only"),
        ("clip", float, "the gradients' largest global norm"), ("seed", int, "of the initial weights and of the batches"),
        ("eval-every", int, "the held-out loss every this many steps"), ("eval-batches", int, "batches of the held-out loss"),
    ):
        default = DEFAULTS[name.replace("-", "_")]
        p.add_argument(f"--{name}", type=kind, default=None, help=f"{what} [default: {default}, as ours]")
    p.add_argument("--seq-len", type=int, help="tokens per sequence [default: the context]")
    p.add_argument("--kv-heads", type=int, help="heads of keys and values, each shared by heads / kv-heads query heads (grouped-query attention, SDPA's enable_gqa) [default: --heads, as ours]")  # [step 08]
    p.add_argument("--documents", action="store_true", help="files packed as ours packs them with train --documents: a token attends to the earlier tokens of its own file only (the block-diagonal causal mask, as SDPA's boolean attn_mask); with --like or --check-against, taken from the run")  # [step 09]
    p.add_argument("--max-seconds", type=float, help="stop after the first step that ends past this many seconds of training (held-out losses not counted); the schedule still runs over --steps")
    p.add_argument("--no-eval", action="store_true", help="no held-out losses (a timing run)")
    p.add_argument("--print-every", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="after the run, one step under torch.profiler: the attention kernels it saw")
    p.add_argument("--out", help="write the run as JSON, in the schema of our trainer's --out")
    p.add_argument("--like", metavar="OUR_RUN.json", help="take the model and every setting from our trainer's run (its --out): the same weights, batches and schedule")
    p.add_argument("--check-against", metavar="OUR_RUN.json", help="take every setting from our trainer's run and compare the losses step by step")
    p.add_argument("--tolerance", type=float, default=1e-4, help="--check-against's largest relative difference [default: 1e-4]")
    args = p.parse_args(argv)
    args.print_every = max(args.print_every, 1)
    return args


def main(argv):
    args = parse_args(argv)
    if torch is None:
        print(
            f"error: this script needs PyTorch ({TORCH_MISSING}); "
            "install it, e.g. `python3 -m venv .venv && .venv/bin/pip install torch`",
            file=sys.stderr,
        )
        return 2
    try:
        return run(args)
    except Failure as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except torch.OutOfMemoryError as e:
        print(f"error: out of memory: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 3
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        if "No viable backend" in first or "No available kernel" in first:
            print(
                f"error: --attention {args.attention}: PyTorch has no such kernel for this device, "
                f"dtype and shape ({first}); the warnings above say why",
                file=sys.stderr,
            )
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
