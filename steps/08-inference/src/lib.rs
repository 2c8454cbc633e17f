//! # Step 08: attention for inference
//!
//! Generating text runs the model once per new token. Every earlier token's keys and values
//! are the same as they were the step before, so a cache keeps them, and each step computes
//! one new query row (or a few) against the cache: decoding. That attention reads the whole
//! cache once and does little arithmetic per byte, so it is bound by memory bandwidth, not
//! by the tensor cores.
//!
//! ## Layout
//!
//! - [`decode`](mod@decode): decoding on the CPU, [`decode()`] (step 02's online softmax
//!   for each query row against its kv head's cache, grouped-query attention, the causal
//!   diagonal aligned to the cache's end) and [`decode_split`] (the keys cut into chunks,
//!   each chunk's partial result merged by step 07's merge through the log-sum-exps), with
//!   [`check_decode`]'s refusals of bad input. [`decode()`] is rung 1 of CPU decoding.
//! - [`decode_grouped`](mod@decode_grouped): rungs 2 to 4, at the memory's speed: each kv
//!   head's rows together over blocks of keys, each key and value read once for all of them
//!   and checked for finiteness through the products' results ([`decode_grouped()`]), the
//!   block's products in SIMD registers ([`decode_simd`]), the keys split over the threads
//!   when the kv heads are few ([`decode_threads`]); [`decode_kernels`] holds the products
//!   in AVX-512, AVX2 and plain Rust, chosen at run time.
//! - [`reference`](mod@reference): the `f64` reference on the expanded heads (each kv head
//!   repeated, the queries at the end of the sequence: step 01's causal attention), the
//!   same row by row for long caches, and attention by hand in 16 bits for the
//!   low-precision rule.
//! - [`cuda`]: decoding on the GPU: [`PagedKvCache`](cuda::PagedKvCache), keys and values
//!   in pages taken as the sequences grow, appended to by `kernels/append.cu`; the split
//!   of the keys over thread blocks ([`plan_splits`](cuda::plan_splits)); the decoding
//!   kernel planned once and run per layer ([`DecodePlan`](cuda::DecodePlan)), or append
//!   and attend in one call ([`attend_with_kvcache`](cuda::attend_with_kvcache)),
//!   [`cuda::decode`] on host arrays, and [`read_bytes`](cuda::read_bytes).
//! - [`pages`]: the page table on the host: the free list, each sequence's pages and
//!   length, and [`check_table`](pages::check_table), run whenever the table changes.
//! - [`kernel`]: the `.cu` sources and their NVRTC builds;
//!   [`DecodeKernel`](kernel::DecodeKernel) alone turns a dtype, a head dim, the query
//!   rows of a kv head and a page size into `kernels/decode.cu`'s `-D` options.
//! - `kernels/decode.cu`: `flash_decode`, one thread block per (split, kv head, sequence),
//!   the query rows of the heads sharing the kv head together on the tensor cores, each
//!   warp its own `cp.async` pipeline over the keys, the warps merged in shared memory, and
//!   the splits merged through their log-sum-exps by the last block of each kv head.
//!   `kernels/read.cu`: a kernel that only reads the same bytes, the physical limit.
//!   `kernels/fill.cu`: the benchmark's caches, filled on the GPU.
//! - `src/bin/decode-bench.rs`: the kernels on a contiguous and a paged cache and the read
//!   kernel, checked then timed, as JSON rows (`charts/data/decode.json`);
//!   `src/bin/decode-kernel-check.rs`: every kernel through NVRTC and ptxas, no spills.
//! - [`generate`](mod@generate): the KV cache in step 05's model, on the CPU:
//!   [`ModelCache`](generate::ModelCache), the prefill, a decoding step with one query row
//!   against the cache (step 02's loop), and [`generate`](generate::generate), which
//!   returns what step 05's `sample` returns; `src/bin/generate.rs`, the text and its
//!   tokens a second with and without the cache.
//! - [`gpu_generate`]: the same on the GPU: [`GpuModel`](gpu_generate::GpuModel), step
//!   05's model with one paged cache for its layers, a token's step its products and
//!   kernels with the decoding kernel as its attention (`kernels/append.cu` adds the
//!   token's keys and values to the cache); [`generate_gpu`](gpu_generate::generate_gpu), and
//!   [`sample_gpu`](gpu_generate::sample_gpu), the GPU forward over the whole window a
//!   token.
//! - [`grouped`]: grouped-query attention in the training kernels, step 03's and step 06's
//!   forwards and step 04's backward (each query head reads kv head `h / g`; dK and dV are
//!   summed over each group by `backward_group_sum`): the calls on host arrays, the `f64`
//!   reference on repeated heads; `src/bin/grouped-bench.rs` checks then times them
//!   (`charts/data/grouped.json`).
//! - [`methods`]: the decoders as the repository's registry lists them (`attend --method
//!   decode`, `decode_split`, `flash_decode`, `flash_decode_paged`).
//! - `src/bin/decode-cpu.rs`: the rungs of CPU decoding against a loop that only reads
//!   the same bytes, checked then timed, as JSON rows (`charts/data/decode-cpu.json`); both
//!   benchmarks write [`rows::DecodeRow`]s.

pub mod cuda;
pub mod decode;
pub mod decode_grouped;
pub mod decode_kernels;
pub mod exercise;
pub mod generate;
pub mod gpu_generate;
pub mod grouped;
pub mod kernel;
pub mod methods;
pub mod pages;
pub mod reference;
pub mod rows;

pub use decode::{DecodeShape, check_decode, decode, decode_split};
pub use decode_grouped::{decode_grouped, decode_simd, decode_threads};

/// The CPU model (from `/proc/cpuinfo`) and rayon's threads, as the benchmark names a CPU.
pub fn cpu_description() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name") || l.starts_with("Model"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .filter(|m| !m.is_empty())
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!("{model} ({} threads)", rayon::current_num_threads())
}
