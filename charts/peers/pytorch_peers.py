#!/usr/bin/env python3
"""PyTorch beside us: causal attention in PyTorch on the benchmark's shapes, measured by the
benchmark's rules, written as the benchmark's JSON rows so the charts draw it next to our methods.

Methods:
  cpu:  pytorch_by_hand (q·kᵀ, mask, softmax, ·v, the whole table), pytorch_sdpa
        (scaled_dot_product_attention as PyTorch chooses it)
  cuda: pytorch_by_hand, pytorch_sdpa_flash (the FLASH_ATTENTION backend, FlashAttention-2),
        pytorch_sdpa_cudnn (the CUDNN_ATTENTION backend), pytorch_sdpa (no backend forced:
        PyTorch's default)

Which attention the default runs: after the sweep, at each length pytorch_sdpa measured, one
warm-up call and then one call under torch.profiler, which names the SDPA operation PyTorch
dispatched to (aten::_scaled_dot_product_cudnn_attention, ..._flash_attention,
..._efficient_attention, ..._flash_attention_for_cpu, ...) and, on the GPU, the CUDA kernels it
launched. The script prints them and adds them to the row's implementation string; no timed
call runs after the profiler has started.

Rules, as in `cargo run --release` (see book/src/measuring.md):
  time  one warm-up call, then the median of --runs calls; the inputs are made before. On the
        GPU each call is timed with CUDA events recorded around it.
  peak  CPU: a fresh process per method and length, which makes its inputs, resets the resident
        high-water mark (echo 5 > /proc/self/clear_refs) and reports the growth of VmHWM over one
        call. GPU: torch.cuda.max_memory_allocated() after one call, minus what was allocated
        before it (the inputs).
  a call that runs out of memory gives a row whose error says so, and the sweep goes on.

Usage (optional, outside the Rust build; needs only PyTorch):
  python3 charts/peers/pytorch_peers.py --out charts/data/cpu-pytorch.json
  python3 charts/peers/pytorch_peers.py --device cuda --out charts/data/gpu-pytorch.json
  python3 charts/peers/pytorch_peers.py --device cuda --backward --out charts/data/gpu-pytorch-fwd-bwd.json
  python3 charts/peers/pytorch_peers.py --decode --out charts/data/decode-pytorch.json  # [step 08]
  python3 charts/peers/pytorch_peers.py --decode --device cpu --out charts/data/decode-cpu-pytorch.json  # [step 08]
  python3 charts/peers/pytorch_peers.py --grouped --out charts/data/grouped-pytorch.json  # [step 08]
"""
import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # --help and the checks of the flags still work; main() says what is missing
    torch = F = None
    TORCH_MISSING = str(e)

SEED = 2024
EXIT_OOM = 3
HERE = os.path.dirname(os.path.abspath(__file__))
# the methods of each device; pytorch_sdpa is the default (no backend forced) on both, and the
# one whose operation and kernels the profiler names
METHODS = {
    "cpu": ("pytorch_by_hand", "pytorch_sdpa"),
    "cuda": ("pytorch_by_hand", "pytorch_sdpa_flash", "pytorch_sdpa_cudnn", "pytorch_sdpa"),
}
PROFILED = "pytorch_sdpa"


def by_hand(q, k, v):
    t = q.shape[-2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def sdpa(backend=None, **options):
    def call(q, k, v):
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **options)

    return call


def methods(device):
    """name -> (function, what runs)"""
    if device == "cpu":
        cap = torch.backends.cpu.get_cpu_capability()
        found = {
            "pytorch_by_hand": (by_hand, f"torch {torch.__version__} by hand: matmul, masked_fill, softmax, matmul ({cap})"),
            "pytorch_sdpa": (sdpa(), f"torch {torch.__version__} SDPA default ({cap})"),
        }
    else:
        from torch.nn.attention import SDPBackend

        found = {
            "pytorch_by_hand": (by_hand, f"torch {torch.__version__} by hand: matmul, masked_fill, softmax, matmul"),
            "pytorch_sdpa_flash": (sdpa(SDPBackend.FLASH_ATTENTION), f"torch {torch.__version__} SDPA, FLASH_ATTENTION backend (FlashAttention-2)"),
            "pytorch_sdpa_cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), f"torch {torch.__version__} SDPA, CUDNN_ATTENTION backend (cuDNN {torch.backends.cudnn.version()})"),
            "pytorch_sdpa": (sdpa(), f"torch {torch.__version__} SDPA default (no backend forced)"),
        }
    assert tuple(found) == METHODS[device]
    return found


def kernel_name(name):
    """A CUDA kernel as the profiler names it, less its return type, template arguments and
    parameters: `void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<...>, ...>(...)`
    -> `pytorch_flash::flash_fwd_kernel`. cuDNN's generated kernels have no template and stay
    whole (their names carry the architecture, the instruction and the tile)."""
    name = name.replace("(anonymous namespace)::", "")
    if name.startswith("void "):
        name = name[len("void "):]
    for stop in "<(":
        name = name.split(stop, 1)[0]
    return name.strip()


def first_seen(names):
    return list(dict.fromkeys(names))


def what_ran(fn, qkv, dout, cuda):
    """One call under torch.profiler: (the SDPA operations PyTorch dispatched to, the kernels
    they launched). On the CPU the operation is what runs; there are no kernels to list."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        result = one_call(fn, qkv, dout)
        if cuda:
            torch.cuda.synchronize()
    del result
    events = prof.events()
    # aten::scaled_dot_product_attention is the front door; the operation it chose is
    # aten::_scaled_dot_product_<backend>..., and the backward's is that name with _backward
    ops = first_seen(e.name for e in events if e.name.startswith("aten::_scaled_dot_product_"))
    kernels = []
    if cuda:
        kernels = first_seen(
            kernel_name(e.name)
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
        )
    return ops, kernels


def ran_line(what, ops, kernels, cuda):
    """The implementation string of a profiled row: what it is, then what ran."""
    line = f"{what} → {', '.join(ops) or 'no aten::_scaled_dot_product_* operation recorded'}"
    if cuda:
        line += f"; kernels: {', '.join(kernels) or 'none recorded (the profiler saw no CUDA kernels)'}"
    return line


def describe(device):
    if device == "cpu":
        model = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
        except (OSError, StopIteration):
            pass
        return f"{model} ({torch.get_num_threads()} threads)"
    p = torch.cuda.get_device_properties(0)
    return f"{p.name} (sm_{p.major}{p.minor}, CUDA {torch.version.cuda})"


def inputs(args, tokens, device):
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    g = torch.Generator(device=device).manual_seed(SEED)
    shape = (args.batch, args.heads, tokens, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=dtype) for _ in range(3))
    if not args.backward:
        return (q, k, v), None
    dout = torch.randn(shape, generator=g, device=device, dtype=dtype)
    return tuple(x.requires_grad_() for x in (q, k, v)), dout


def one_call(fn, qkv, dout):
    """The pass being measured: the forward, and for fwd+bwd the gradients of q, k and v."""
    if dout is None:
        with torch.no_grad():
            return fn(*qkv)
    o = fn(*qkv)
    return o, torch.autograd.grad(o, qkv, dout)


def hwm():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM")).split()[1]) * 1024


def peak_child(args):
    """The fresh process of one CPU peak: inputs, reset, one call, the growth."""
    fn, _ = methods("cpu")[args.methods[0]]
    qkv, dout = inputs(args, args.lengths[0], "cpu")
    # no warm-up call here: memory it freed could stay in the allocator's heap, and the measured
    # call would reuse it without raising the high-water mark
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # ru_maxrss would carry the parent's peak across fork+exec; VmHWM resets
    before = hwm()
    try:
        result = one_call(fn, qkv, dout)
    except RuntimeError as e:
        if "memory" in str(e).lower():
            print(f"out of memory: {str(e).splitlines()[0]}", file=sys.stderr)
            sys.exit(EXIT_OOM)
        raise
    print(hwm() - before)
    del result


def measure_cpu(args, name, fn, tokens):
    cmd = [sys.executable, os.path.abspath(__file__), "--peak-child", "--methods", name,
           "--lengths", str(tokens), "--batch", str(args.batch), "--heads", str(args.heads),
           "--head-dim", str(args.head_dim), "--dtype", args.dtype]
    if args.backward:
        cmd.append("--backward")
    child = subprocess.run(cmd, capture_output=True, text=True)
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or [""])[-1]
        if child.returncode == -9:
            raise MemoryError("out of memory: the measuring process was killed (SIGKILL, as the kernel's OOM killer does)")
        if child.returncode == EXIT_OOM:
            raise MemoryError(last)
        raise RuntimeError(f"the measuring process failed ({child.returncode}): {last}")
    peak = int(child.stdout.strip())
    qkv, dout = inputs(args, tokens, "cpu")
    one_call(fn, qkv, dout)
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        result = one_call(fn, qkv, dout)
        times.append((time.perf_counter() - start) * 1e3)
        del result
    return statistics.median(times), peak


def measure_cuda(args, name, fn, tokens, make=inputs):
    qkv, dout = make(args, tokens, "cuda")
    try:
        # warm up for at least 200 ms of device time, as the Rust benchmark does, so the clocks
        # have left their idle state
        warm = 0.0
        while warm < 200.0:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            del_me = one_call(fn, qkv, dout)
            end.record()
            torch.cuda.synchronize()
            warm += max(start.elapsed_time(end), 0.01)
            del del_me
        times = []
        for _ in range(args.runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # keep the GPU busy (about 0.5 ms) while Python launches the call, so the time is
            # the call's kernels, not the interpreter's work to start them; the Rust benchmark
            # queues the same spin
            torch.cuda._sleep(1_000_000)
            start.record()
            result = one_call(fn, qkv, dout)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
            del result
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = one_call(fn, qkv, dout)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        del result
        return statistics.median(times), peak
    except torch.OutOfMemoryError as e:
        raise MemoryError(f"out of memory: {str(e).splitlines()[0]}") from None
    finally:
        del qkv, dout
        torch.cuda.empty_cache()


def profile_default(args, fn, rows, cuda):
    """What PyTorch's default ran at each length it was measured at: one warm-up call (cuDNN
    builds its graph on the first), then one call under the profiler. It runs after the sweep,
    so that no timed call runs after the profiler has been started in this process. Adds what
    ran to each row's implementation string."""
    print(f"\nwhat {PROFILED}, PyTorch's default, ran (torch.profiler, one call per length after a warm-up):")
    said = None
    for row in rows:
        if row["method"] != PROFILED or row["error"]:
            continue
        qkv, dout = inputs(args, row["tokens"], args.device)
        try:
            one_call(fn, qkv, dout)
            ran = what_ran(fn, qkv, dout, cuda)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            print(f"  {row['tokens']:>7} tokens: not profiled: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            continue
        finally:
            del qkv, dout
            if cuda:
                torch.cuda.empty_cache()
        ops, kernels = ran
        row["implementation"] = ran_line(row["implementation"], ops, kernels, cuda)
        print(f"  {row['tokens']:>7} tokens: {', '.join(ops) or 'no aten::_scaled_dot_product_* operation recorded'}")
        if cuda and ran != said:
            for k in kernels or ["none recorded (the profiler saw no CUDA kernels)"]:
                print(f"                  kernel {k}")
        elif cuda:
            print("                  (the same kernels)")
        said = ran


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


def write_rows(path, rows):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(row_a_line(rows, sort_keys=True))


def commit():
    """`BENCH_COMMIT` if set (a copy of the tree on another machine is no checkout: the caller
    names the commit it came from); else the commit as the Rust binaries name theirs
    (steps/00-core/build.rs): git's short hash, `-dirty` if tracked files differ from it, where
    the git repository around this file is this one, and `unknown` elsewhere."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    root = os.path.realpath(os.path.join(HERE, "..", ".."))

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


# [step 08]
def decode_sweep(args):
    """Decoding, as decode-bench (the GPU, bf16) and decode-cpu (the CPU, f32) measure ours:
    scaled_dot_product_attention with one query row (or --q-rows) of every query head
    against a cache of --lengths tokens, enable_gqa where the kv heads are fewer than the
    query heads; no mask (with one row, the row sees the whole cache; is_causal would align
    the diagonal to the start). On the GPU timed as measure_cuda times (CUDA events, the
    spin, the median of --runs) after --warmup-ms of warm-up; on the CPU by this process's
    clock, the median of --runs after two untimed calls. After the sweep, one call of each
    shape under the profiler names the operation (and the kernels) that ran. Rows carry
    decode-bench's keys."""
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    cuda = args.device == "cuda"
    device = describe(args.device)
    print(f"device: {device}")
    warm = f"{args.warmup_ms} ms of warm-up" if cuda else "2 untimed calls"
    print(f"decoding: {args.heads} query heads, {args.q_rows} row(s) each, {args.dtype}; "
          f"median of {args.runs} runs after {warm}")
    print(f"{'d':>4} {'kv':>3} {'batch':>5} {'context':>7} | {'us':>9} {'GB/s':>7}  note")
    rows, sha = [], commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    what = f"torch {torch.__version__} SDPA default (no backend forced), one query row a head"

    def make(batch, kv, context, d):
        g = torch.Generator(device=args.device).manual_seed(SEED)
        q = torch.randn(batch, args.heads, args.q_rows, d, generator=g, device=args.device, dtype=dtype)
        k = torch.randn(batch, kv, context, d, generator=g, device=args.device, dtype=dtype)
        v = torch.randn(batch, kv, context, d, generator=g, device=args.device, dtype=dtype)
        return q, k, v

    def time_cuda(q, k, v):
        # CUDA events around the call, each behind a spin, after --warmup-ms of warm-up
        warm = 0.0
        while warm < args.warmup_ms:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call(q, k, v)
            end.record()
            torch.cuda.synchronize()
            warm += max(start.elapsed_time(end), 0.01)
        times = []
        for _ in range(args.runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            start.record()
            call(q, k, v)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times) * 1e3

    def time_cpu(q, k, v):
        # the clock of this process around the call, after two untimed calls
        for _ in range(2):
            call(q, k, v)
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            result = call(q, k, v)
            times.append((time.perf_counter() - start) * 1e6)
            del result
        return statistics.median(times)

    def call(q, k, v):
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=k.shape[1] != q.shape[1])

    shapes = [(d, kv, b, t) for d in args.head_dims for kv in args.kv_heads for b in args.batches
              for t in args.lengths]
    for d, kv, batch, context in shapes:
        nbytes = 2 * batch * kv * context * d * dtype.itemsize
        us = error = None
        free = torch.cuda.mem_get_info()[0] if cuda else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if nbytes > 0.9 * free:
            error = f"the cache needs {nbytes / 1e9:.1f} GB and the GPU has {free / 1e9:.1f} GB free"
        else:
            try:
                q, k, v = make(batch, kv, context, d)
                us = time_cuda(q, k, v) if cuda else time_cpu(q, k, v)
            except RuntimeError as e:  # torch.OutOfMemoryError is one
                error = f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            finally:
                q = k = v = None
                if cuda:
                    torch.cuda.empty_cache()
        gb_s = nbytes / (us * 1e-6) / 1e9 if us else None
        rows.append(dict(method="pytorch_sdpa", implementation=what, device=device, commit=sha,
                         date=date, batch=batch, q_heads=args.heads, kv_heads=kv, q_rows=args.q_rows,
                         context=context, head_dim=d, dtype=args.dtype, page_size=None, splits=None,
                         runs=args.runs, us=us, bytes=nbytes, gb_s=gb_s, fraction_of_read=None,
                         error=error))
        print(f"{d:>4} {kv:>3} {batch:>5} {context:>7} | {'-' if us is None else f'{us:.1f}':>9} "
              f"{'-' if gb_s is None else f'{gb_s:.0f}':>7}  {error or ''}", flush=True)
        if args.out:
            write_rows(args.out, rows)
    print("\nwhat SDPA ran (torch.profiler, one call per shape after a warm-up):")
    said = None
    for row in rows:
        if row["error"]:
            continue
        q, k, v = make(row["batch"], row["kv_heads"], row["context"], row["head_dim"])
        call(q, k, v)
        ops, kernels = what_ran(call, (q, k, v), None, cuda)
        q = k = v = None
        if cuda:
            torch.cuda.empty_cache()
        row["implementation"] = ran_line(row["implementation"], ops, kernels, cuda)
        ran = (ops, kernels)
        if ran != said:
            ran_kernels = f"; kernels: {', '.join(kernels)}" if cuda else ""
            print(f"  from d {row['head_dim']}, kv {row['kv_heads']}, batch {row['batch']}, "
                  f"context {row['context']}: {', '.join(ops)}{ran_kernels}")
        said = ran
    if args.out:
        write_rows(args.out, rows)
        print(f"\nwrote {len(rows)} rows to {args.out}")


def grouped_sweep(args):
    """Grouped-query attention, as grouped-bench measures ours: causal SDPA with k and v of
    --kv-heads heads (enable_gqa where they are fewer than --heads), FlashAttention-2, cuDNN
    and PyTorch's default, forward and forward+backward, at --lengths tokens with the batch
    --total-tokens over the length; timed and profiled as the main sweep's GPU rows. Rows
    carry grouped-bench's keys."""
    from torch.nn.attention import SDPBackend

    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    device = describe("cuda")
    print(f"device: {device}")
    print(f"{args.heads} query heads, {args.total_tokens} tokens in all, {args.dtype}; median of {args.runs} runs")
    print(f"{'d':>4} {'kv':>3} {'tokens':>6} {'batch':>5} {'method':<20} {'pass':<8} | {'ms':>9} {'TFLOP/s':>8}  note")
    backends = {"pytorch_sdpa_flash": SDPBackend.FLASH_ATTENTION,
                "pytorch_sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "pytorch_sdpa": None}
    rows, sha = [], commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for d in args.head_dims:
        for kv in args.kv_heads:
            for tokens in args.lengths:
                batch = max(args.total_tokens // tokens, 1)
                for backward in (False, True):
                    def make(a, t, dev):
                        g = torch.Generator(device=dev).manual_seed(SEED)
                        q = torch.randn(batch, args.heads, t, d, generator=g, device=dev, dtype=dtype)
                        k, v = (torch.randn(batch, kv, t, d, generator=g, device=dev, dtype=dtype) for _ in range(2))
                        if not backward:
                            return (q, k, v), None
                        dout = torch.randn(q.shape, generator=g, device=dev, dtype=dtype)
                        return tuple(x.requires_grad_() for x in (q, k, v)), dout

                    pass_name = "fwd+bwd" if backward else "fwd"
                    for name, backend in backends.items():
                        fn = sdpa(backend, enable_gqa=kv != args.heads)
                        what = (f"torch {torch.__version__} SDPA"
                                + (f", {backend.name} backend" if backend is not None else " default (no backend forced)")
                                + (", enable_gqa" if kv != args.heads else ""))
                        ms = error = None
                        try:
                            ms, _ = measure_cuda(args, name, fn, tokens, make)
                            if backend is None:
                                qkv, dout = make(args, tokens, "cuda")
                                ops, kernels = what_ran(fn, qkv, dout, True)
                                what = ran_line(what, ops, kernels, True)
                                del qkv, dout
                        except (MemoryError, RuntimeError) as e:
                            error = f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                        flops = 4 * batch * args.heads * tokens ** 2 * d / 2 * (3.5 if backward else 1.0)
                        tflops = flops / (ms * 1e-3) / 1e12 if ms else None
                        rows.append(dict(method=name, implementation=what, device=device, commit=sha, date=date,
                                         batch=batch, heads=args.heads, kv_heads=kv, tokens=tokens, head_dim=d,
                                         dtype=args.dtype, runs=args.runs, ms=ms, tflops=tflops, error=error,
                                         **{"pass": pass_name}))
                        print(f"{d:>4} {kv:>3} {tokens:>6} {batch:>5} {name:<20} {pass_name:<8} | "
                              f"{'-' if ms is None else f'{ms:.3f}':>9} {'-' if tflops is None else f'{tflops:.1f}':>8}  "
                              f"{error or ''}", flush=True)
                        if args.out:
                            write_rows(args.out, rows)
    if args.out:
        print(f"\nwrote {len(rows)} rows to {args.out}")
# [/step 08]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--methods", type=lambda s: [m for m in s.split(",") if m], default=None)
    p.add_argument("--lengths", type=lambda s: [int(t) for t in s.split(",") if t], default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["f32", "bf16", "f16"], default=None)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--backward", action="store_true", help="time forward and backward (pass fwd+bwd)")
    p.add_argument("--out", help="write the rows as JSON (e.g. charts/data/cpu-pytorch.json)")
    p.add_argument("--peak-child", action="store_true", help=argparse.SUPPRESS)
    # [step 08]
    p.add_argument("--decode", action="store_true",
                   help="decoding, as decode-bench (--device cuda, the default here: bf16, caches of 1k "
                        "to 128k tokens) or decode-cpu (--device cpu: f32, 1k to 16k, batch 1): one query "
                        "row of --heads (default 32) query heads against caches of --lengths tokens")
    p.add_argument("--batches", type=lambda s: [int(t) for t in s.split(",") if t], default=[1, 8, 64],
                   help="--decode: sequences decoded together")
    p.add_argument("--kv-heads", type=lambda s: [int(t) for t in s.split(",") if t], default=[32, 8],
                   help="--decode: kv heads (fewer than --heads: grouped-query attention)")
    p.add_argument("--head-dims", type=lambda s: [int(t) for t in s.split(",") if t], default=[64, 128],
                   help="--decode: head dims")
    p.add_argument("--q-rows", type=int, default=1, help="--decode: query rows of each head")
    p.add_argument("--warmup-ms", type=float, default=50.0, help="--decode: milliseconds of warm-up")
    p.add_argument("--grouped", action="store_true",
                   help="grouped-query attention, as grouped-bench: causal SDPA with --kv-heads heads of k and v "
                        "(default 32,8) for --heads (default 32) query heads, head dims 64 and 128, bf16, "
                        "forward and forward+backward, at 1k to 16k tokens")
    p.add_argument("--total-tokens", type=int, default=16384,
                   help="--grouped: tokens of all the sequences together (the batch is this over the length)")
    if "--grouped" in argv:
        a = p.parse_args(argv)
        a.device, a.dtype = "cuda", a.dtype or "bf16"
        a.heads = a.heads if "--heads" in argv else 32
        a.lengths = a.lengths or [1024, 2048, 4096, 8192, 16384]
        a.runs = a.runs if "--runs" in argv else 10
        if a.dtype not in ("bf16", "f16"):
            p.error("--grouped measures bf16 or f16, as grouped-bench does")
        if any(a.heads % kv for kv in a.kv_heads):
            p.error(f"--kv-heads {a.kv_heads} must each divide --heads {a.heads}")
        return a
    if "--decode" in argv:
        a = p.parse_args(argv)
        cpu = a.device == "cpu" and any(x == "--device" or x.startswith("--device=") for x in argv)
        a.device = "cpu" if cpu else "cuda"
        a.dtype = a.dtype or ("f32" if cpu else "bf16")
        a.heads = a.heads if "--heads" in argv else 32
        a.lengths = a.lengths or ([1024, 4096, 16384] if cpu else [1 << p for p in range(10, 18)])
        if cpu and "--batches" not in argv:
            a.batches = [1]  # decode-cpu's default
        a.runs = a.runs if "--runs" in argv else (10 if cpu else 30)
        if cpu and a.dtype != "f32":
            p.error("--decode --device cpu measures an f32 cache, as decode-cpu does")
        if not cpu and a.dtype not in ("bf16", "f16"):
            p.error("--decode on the GPU measures a bf16 or f16 cache, as decode-bench does")
        if any(a.heads % kv for kv in a.kv_heads):
            p.error(f"--kv-heads {a.kv_heads} must each divide --heads {a.heads}")
        return a
    # [/step 08]
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.lengths = a.lengths or [1 << p for p in range(10, 15 if cuda else 14)]
    a.batch = a.batch or (4 if cuda else 1)
    a.dtype = a.dtype or ("bf16" if cuda else "f32")
    known = METHODS[a.device]
    a.methods = a.methods or list(known)
    for m in a.methods:
        if m not in known:
            other = "cuda" if a.device == "cpu" else "cpu"
            where = f" ({m} is a {other} method: add --device {other})" if m in METHODS[other] else ""
            p.error(f"unknown method '{m}' on {a.device}{where}; the {a.device} methods are: {', '.join(known)}")
    if min(a.lengths + [a.batch, a.heads, a.head_dim, a.runs]) < 1:
        p.error("lengths, --batch, --heads, --head-dim and --runs must be at least 1")
    return a


def main(argv):
    args = parse_args(argv)
    if torch is None:
        print(f"pytorch_peers.py needs PyTorch ({TORCH_MISSING}): pip install torch numpy", file=sys.stderr)
        sys.exit(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pytorch_peers.py: --device cuda, but torch sees no CUDA device "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})", file=sys.stderr)
        sys.exit(2)
    if args.peak_child:
        peak_child(args)
        return
    # [step 08]
    if args.decode:
        decode_sweep(args)
        return
    if args.grouped:
        grouped_sweep(args)
        return
    # [/step 08]
    device = describe(args.device)
    cuda = args.device == "cuda"
    chosen = {n: m for n, m in methods(args.device).items() if n in args.methods}
    pass_name = "fwd+bwd" if args.backward else "fwd"
    print(f"device: {device}")
    print(f"shape: batch {args.batch}, heads {args.heads}, head_dim {args.head_dim}, {args.dtype}, causal; "
          f"pass {pass_name}; median of {args.runs} runs after a warm-up")
    for name, (_, what) in chosen.items():
        print(f"  {name:<20} {what}")
    if PROFILED in chosen:
        print(f"  ({PROFILED}: what it runs is named by torch.profiler after the sweep)")
    print(f"\n{'method':<20} {'pass':<8} {'tokens':>7} {'ms':>11} {'TFLOP/s' if cuda else 'GFLOP/s':>10} {'peak MB':>12}  note")
    rows, sha = [], commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    total = len(args.lengths) * len(chosen)
    for tokens in args.lengths:
        for name, (fn, what) in chosen.items():
            print(f"[{len(rows) + 1}/{total}] {name} at {tokens} tokens ({pass_name}) ...", file=sys.stderr, flush=True)
            ms = peak = error = None
            try:
                ms, peak = (measure_cuda if cuda else measure_cpu)(args, name, fn, tokens)
            except MemoryError as e:
                error = str(e)
            except RuntimeError as e:
                error = f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
            flops = 4 * args.batch * args.heads * tokens ** 2 * args.head_dim / 2 * (3.5 if args.backward else 1.0)
            tflops = flops / (ms * 1e-3) / 1e12 if ms else None
            row = dict(method=name, implementation=what, device=device, device_kind=args.device,
                       tokens=tokens, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                       dtype=args.dtype, runs=args.runs, ms=ms, tflops=tflops, peak_bytes=peak,
                       commit=sha, date=date, error=error, **{"pass": pass_name})
            rows.append(row)
            rate = "-" if tflops is None else f"{tflops:.1f}" if cuda else f"{tflops * 1e3:.1f}"
            print(f"{name:<20} {pass_name:<8} {tokens:>7} {'-' if ms is None else f'{ms:.3f}':>11} {rate:>10} "
                  f"{'-' if peak is None else f'{peak / 1e6:.1f}':>12}  {error or ''}", flush=True)
            if args.out:
                write_rows(args.out, rows)
    if PROFILED in chosen:
        profile_default(args, chosen[PROFILED][0], rows, cuda)
        if args.out:
            write_rows(args.out, rows)
    if args.out:
        print(f"\nwrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
