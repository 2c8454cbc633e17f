//! Decoding on the GPU: a cache of keys and values in device memory, contiguous or in
//! pages, the split of its keys over thread blocks, and the launches of
//! `kernels/decode.cu` and of `kernels/read.cu`, the physical limit it is measured against.
//!
//! ## Layout
//!
//! - [`KvCache`]: k and v of `[batch, kv_heads, context, head_dim]` tokens, either one
//!   contiguous tensor each or a pool of pages `[pages, kv_heads, page_size, head_dim]`
//!   read through a page table `[batch, max_pages]` ([`Layout`]), as vLLM's PagedAttention
//!   keeps them; [`check_table`] refuses a table that points past the pool before anything
//!   is launched.
//! - [`SplitPlan`]: how many splits of how many keys, [`plan_splits`] choosing them from
//!   the GPU's multiprocessors.
//! - [`decode_into`]: the kernel, its splits merged by their last block, on device tensors;
//!   [`decode`] on host arrays.
//! - [`read_bytes`], [`fill_cache`]: the read kernel, and the benchmark's fill of a cache
//!   whose values [`cache_value`] makes again on the host.

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use flash_core::inputs::SplitMix64;
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array3, Array4, ArrayView4, s};
use step03_cuda_forward::{
    DeviceTensor, Dtype, Gpu, alloc_error, device_error, half_dtype, host,
};

use crate::decode::{DecodeShape, check_decode, check_sizes};
use crate::kernel::{
    DECODE, DecodeKernel, FILL, READ, check_page_size, compile_fill, compile_read,
};

/// How a cache's tokens lie in memory.
pub enum Layout {
    /// `[batch, kv_heads, context, head_dim]`, one sequence's head after another.
    Contiguous,
    /// A pool of `pages` pages of `[kv_heads, page_size, head_dim]`, and for each sequence
    /// a row of `max_pages` page indices: its tokens `p·page_size ..` are in page
    /// `table[b][p]`. The host keeps the table it checked.
    Paged {
        page_size: usize,
        pages: usize,
        max_pages: usize,
        table: CudaSlice<i32>,
        table_host: Vec<i32>,
    },
}

/// A cache of keys and values on the GPU, 16-bit values.
pub struct KvCache {
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
    /// `[batch]` tokens in each sequence's cache now, on the device, where the decoding
    /// kernel reads them: `context` when made, [`KvCache::set_lens`] to change.
    pub lens: CudaSlice<i32>,
    pub batch: usize,
    pub kv_heads: usize,
    /// Tokens a sequence's cache has room for.
    pub context: usize,
    /// The most tokens any sequence holds now, as the host knows it (`lens` at most this):
    /// the keys a split must cover. `context` when made; [`KvCache::set_lens`] sets the
    /// longest length.
    pub keys: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
    pub layout: Layout,
}

// ANCHOR: check_table
/// Checks a page table before any launch: `table` holds `batch` rows of `max_pages`
/// entries, and each sequence's first `⌈context / page_size⌉` entries, the pages the
/// kernel reads, name pages of the pool, `0 .. pages`. Entries after those are never
/// read (padding, `-1` say).
pub fn check_table(
    table: &[i32],
    batch: usize,
    max_pages: usize,
    pages: usize,
    page_size: usize,
    context: usize,
) -> Result<(), AttnError> {
    check_page_size(page_size)?;
    if page_size == 0 {
        return Err(AttnError::Unsupported {
            what: "a paged cache with pages of 0 tokens".into(),
        });
    }
    let used = context.div_ceil(page_size);
    if table.len() != batch * max_pages || max_pages < used {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the page table holds {} entries for {batch} sequences of {max_pages} \
                 pages; it must be [batch, max_pages] with max_pages at least {used} \
                 ({context} tokens in pages of {page_size})",
                table.len()
            ),
        });
    }
    for b in 0..batch {
        for p in 0..used {
            let entry = table[b * max_pages + p];
            if entry < 0 || entry as usize >= pages {
                return Err(AttnError::Unsupported {
                    what: format!(
                        "page table entry {p} of sequence {b} (tokens {} to {}) is page \
                         {entry}, but the pool holds {pages} pages: every page a sequence \
                         uses must be one of 0 to {}",
                        p * page_size,
                        ((p + 1) * page_size).min(context) - 1,
                        pages as i64 - 1
                    ),
                });
            }
        }
    }
    Ok(())
}
// ANCHOR_END: check_table

impl KvCache {
    /// The cache's logical shape, `[batch, kv_heads, context, head_dim]`.
    pub fn dims(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.context, self.head_dim]
    }

    /// Bytes of k and v the kernel reads.
    pub fn bytes(&self) -> u64 {
        2 * (self.batch * self.kv_heads * self.context * self.head_dim) as u64 * 2
    }

    /// Tokens per page, 0 when contiguous.
    pub fn page_size(&self) -> usize {
        match self.layout {
            Layout::Contiguous => 0,
            Layout::Paged { page_size, .. } => page_size,
        }
    }

    /// A contiguous cache of uninitialised values (the benchmark fills it on the GPU).
    pub fn alloc(gpu: &Gpu, dims: [usize; 4], dtype: Dtype) -> Result<KvCache, AttnError> {
        let [batch, kv_heads, context, head_dim] = dims;
        let len = checked_len(&dims)?;
        let (k, v) = (alloc_values(gpu, len)?, alloc_values(gpu, len)?);
        Ok(KvCache {
            k,
            v,
            lens: full_lens(gpu, batch, context)?,
            keys: context,
            batch,
            kv_heads,
            context,
            head_dim,
            dtype: half_dtype(dtype)?,
            layout: Layout::Contiguous,
        })
    }

    /// A paged cache of uninitialised values: a pool of `pages` pages and a checked table.
    pub fn alloc_paged(
        gpu: &Gpu,
        dims: [usize; 4],
        dtype: Dtype,
        page_size: usize,
        pages: usize,
        table: Vec<i32>,
    ) -> Result<KvCache, AttnError> {
        let [batch, kv_heads, context, head_dim] = dims;
        let max_pages = table.len().checked_div(batch).unwrap_or(0);
        check_table(&table, batch, max_pages, pages, page_size, context)?;
        let len = checked_len(&[pages, kv_heads, page_size, head_dim])?;
        let (k, v) = (alloc_values(gpu, len)?, alloc_values(gpu, len)?);
        let table_dev = gpu
            .stream()
            .clone_htod(&table)
            .map_err(device_error("copying the page table"))?;
        Ok(KvCache {
            k,
            v,
            lens: full_lens(gpu, batch, context)?,
            keys: context,
            batch,
            kv_heads,
            context,
            head_dim,
            dtype: half_dtype(dtype)?,
            layout: Layout::Paged {
                page_size,
                pages,
                max_pages,
                table: table_dev,
                table_host: table,
            },
        })
    }

    /// Host arrays `[batch, kv_heads, context, head_dim]` rounded to `dtype` and copied to
    /// the GPU, contiguous.
    pub fn upload(
        gpu: &Gpu,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<KvCache, AttnError> {
        let dims: [usize; 4] = k.dim().into();
        let dtype = half_dtype(dtype)?;
        let copy = |x: ArrayView4<f32>| {
            let bits = host::to_bits(x, dtype);
            gpu.stream()
                .clone_htod(&bits)
                .map_err(alloc_error("copying the cache", bits.len() as u128 * 2))
        };
        let [batch, kv_heads, context, head_dim] = dims;
        Ok(KvCache {
            k: copy(k)?,
            v: copy(v)?,
            lens: full_lens(gpu, batch, context)?,
            keys: context,
            batch,
            kv_heads,
            context,
            head_dim,
            dtype,
            layout: Layout::Contiguous,
        })
    }

    /// The same values in pages of `page_size` tokens: each sequence's pages take places of
    /// the pool in a shuffled order (from `seed`), so that reading through the table is
    /// what the test checks; a last page's tokens past the context are zeros.
    pub fn upload_paged(
        gpu: &Gpu,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
        page_size: usize,
        seed: u64,
    ) -> Result<KvCache, AttnError> {
        check_page_size(page_size)?;
        let [batch, kv_heads, context, head_dim] = <[usize; 4]>::from(k.dim());
        let dtype = half_dtype(dtype)?;
        let max_pages = context.div_ceil(page_size.max(1));
        let table = shuffled_table(batch, max_pages, seed);
        let pages = batch * max_pages;
        let pool = |x: ArrayView4<f32>| {
            let mut p = Array4::<f32>::zeros((pages, kv_heads, page_size, head_dim));
            for b in 0..batch {
                for j in 0..max_pages {
                    let (t0, t1) = (j * page_size, ((j + 1) * page_size).min(context));
                    let place = table[b * max_pages + j] as usize;
                    p.slice_mut(s![place, .., ..t1 - t0, ..])
                        .assign(&x.slice(s![b, .., t0..t1, ..]));
                }
            }
            let bits = host::to_bits(p.view(), dtype);
            gpu.stream().clone_htod(&bits).map_err(alloc_error(
                "copying the pool of pages",
                bits.len() as u128 * 2,
            ))
        };
        let (k_pool, v_pool) = (pool(k)?, pool(v)?);
        check_table(&table, batch, max_pages, pages, page_size, context)?;
        let table_dev = gpu
            .stream()
            .clone_htod(&table)
            .map_err(device_error("copying the page table"))?;
        Ok(KvCache {
            k: k_pool,
            v: v_pool,
            lens: full_lens(gpu, batch, context)?,
            keys: context,
            batch,
            kv_heads,
            context,
            head_dim,
            dtype,
            layout: Layout::Paged {
                page_size,
                pages,
                max_pages,
                table: table_dev,
                table_host: table,
            },
        })
    }

    /// Each sequence's length, one a sequence, at most the cache's `context`: a batch of
    /// sequences of different lengths, each query row's diagonal aligned to its own
    /// sequence's end. Nothing is written when a length is refused.
    pub fn set_lens(&mut self, gpu: &Gpu, lens: &[usize]) -> Result<(), AttnError> {
        if lens.len() != self.batch || lens.iter().any(|&n| n > self.context) {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "lengths {lens:?} for a cache of {} sequences of at most {} tokens: one \
                     length a sequence, each 0 to {}",
                    self.batch, self.context, self.context
                ),
            });
        }
        let longest = lens.iter().copied().max().unwrap_or(0);
        let lens: Vec<i32> = lens.iter().map(|&n| n as i32).collect();
        gpu.stream()
            .memcpy_htod(&lens, &mut self.lens)
            .map_err(device_error("copying the cache's lengths"))?;
        self.keys = longest;
        Ok(())
    }
}

/// A page table for `batch` sequences of `max_pages` pages, the `batch · max_pages` pages
/// of a pool handed out in an order shuffled by `seed` (Fisher–Yates).
pub fn shuffled_table(batch: usize, max_pages: usize, seed: u64) -> Vec<i32> {
    let mut table: Vec<i32> = (0..(batch * max_pages) as i32).collect();
    let mut rng = SplitMix64::new(seed);
    for i in (1..table.len()).rev() {
        table.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    table
}

/// Every sequence's length at `context`, on the device.
fn full_lens(gpu: &Gpu, batch: usize, context: usize) -> Result<CudaSlice<i32>, AttnError> {
    let len = i32::try_from(context).map_err(|_| AttnError::Unsupported {
        what: format!("a cache of {context} tokens: the kernel takes at most 2^31 - 1"),
    })?;
    gpu.stream()
        .clone_htod(&vec![len; batch.max(1)])
        .map_err(device_error("copying the cache's lengths"))
}

fn checked_len(dims: &[usize; 4]) -> Result<usize, AttnError> {
    Shape::new(dims[0], dims[1], dims[2], dims[3]).checked_len()
}

fn alloc_values(gpu: &Gpu, len: usize) -> Result<CudaSlice<u16>, AttnError> {
    // SAFETY: the values are written (by a copy or fill_cache) before any kernel reads them
    unsafe { gpu.stream().alloc::<u16>(len.max(1)) }
        .map_err(alloc_error("allocating the cache", len as u128 * 2))
}

// ANCHOR: plan_splits
/// How the keys are cut over thread blocks: `splits` splits of `split_keys` keys each (the
/// last one shorter), one block per (split, kv head, sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    pub splits: usize,
    pub split_keys: usize,
}

/// Splits of one (kv head, sequence) at most.
pub const MAX_SPLITS: usize = 256;

/// What the split's choice knows of the GPU and the kernel's build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Occupancy {
    /// The GPU's multiprocessors.
    pub sms: usize,
    /// Blocks of the build a multiprocessor holds at once (its registers and shared
    /// memory): the GPU's *slots* are `sms · blocks_per_sm`.
    pub blocks_per_sm: usize,
    /// Blocks a multiprocessor needs to stream keys at the memory's speed
    /// ([`DecodeKernel::streaming_blocks`]).
    pub streaming: usize,
    /// Keys a block takes per step, all its warps together ([`DecodeKernel::block_keys`]):
    /// a split is a multiple of them, and at least two steps long.
    pub block_keys: usize,
}

/// Chooses the split. Without one, a block per (sequence, kv head) would leave most of the
/// GPU idle at batch 1 (8 kv heads on 132 multiprocessors), each block reading a long cache
/// alone. Decoding is bound by the memory, so what counts is that every multiprocessor
/// streams, each as long as the others:
///
/// - With few (sequence, kv head) pairs, the keys are cut so that every
///   multiprocessor gets the same whole number of blocks, as many as keep its memory
///   streaming (one block, [`DecodeKernel::streaming_blocks`]): 8 pairs on 132
///   multiprocessors take 16 splits, 128 blocks. More blocks would each cost a start
///   (q's rows, the pipeline's first steps) and a share of the merge, for nothing; an
///   uneven count leaves some multiprocessors reading after the others are done.
/// - With more pairs than that, the blocks come in waves over the slots, and a last
///   wave of a few blocks leaves the others' slots idle while it reads: the fewest
///   splits that keep the slots at least 90% busy over the waves (`blocks / (waves ·
///   slots) ≥ 0.9`; from four waves on the last one's tail is short, and counts as
///   full), one split when that is enough, and no merge.
///
/// No split is shorter than two steps of the block (`2 · block_keys`).
pub fn plan_splits(batch_kv_heads: usize, context: usize, gpu: Occupancy) -> SplitPlan {
    let step = gpu.block_keys.max(1);
    let most = context.div_ceil(2 * step).clamp(1, MAX_SPLITS);
    let pairs = batch_kv_heads.max(1);
    let per_sm = gpu.blocks_per_sm.max(1);
    let streaming = gpu.sms.max(1) * gpu.streaming.clamp(1, per_sm);
    if pairs <= streaming {
        return fixed_splits(context, (streaming / pairs).clamp(1, most), step);
    }
    let slots = gpu.sms.max(1) * per_sm;
    let busy = |splits: usize| {
        let blocks = pairs * splits;
        let waves = blocks.div_ceil(slots);
        if waves >= 4 {
            1.0
        } else {
            blocks as f64 / (waves * slots) as f64
        }
    };
    let splits = (1..=most).find(|&s| busy(s) >= 0.9).unwrap_or_else(|| {
        (1..=most)
            .max_by(|&a, &b| busy(a).total_cmp(&busy(b)).then(b.cmp(&a)))
            .unwrap_or(1)
    });
    fixed_splits(context, splits, step)
}
// ANCHOR_END: plan_splits

/// The most splits [`plan_splits`] gives a cache of any length up to `context`: the room a
/// [`DecodeOutput`] needs to decode such a cache at every length. A shorter cache can take
/// more splits than a full one (each of fewer keys), so a full cache's count is not it.
pub fn most_splits(batch_kv_heads: usize, context: usize, gpu: Occupancy) -> usize {
    (1..=context.max(1))
        .map(|keys| plan_splits(batch_kv_heads, keys, gpu).splits)
        .max()
        .unwrap_or(1)
}

/// `splits` splits of the keys, or as near as a multiple of a block's step allows: each
/// split a multiple of `step` keys ([`DecodeKernel::block_keys`]).
pub fn fixed_splits(context: usize, splits: usize, step: usize) -> SplitPlan {
    let step = step.max(1);
    let split_keys = context.div_ceil(splits.max(1)).div_ceil(step).max(1) * step;
    SplitPlan {
        splits: context.div_ceil(split_keys).max(1),
        split_keys,
    }
}

/// What [`decode_into`] writes: the output `[batch, q_heads, q_rows, head_dim]` in 16
/// bits, each row's natural log-sum-exp, and room for the splits' partial results in f32.
pub struct DecodeOutput {
    pub out: DeviceTensor,
    pub lse: CudaSlice<f32>,
    part_out: CudaSlice<f32>,
    part_lse: CudaSlice<f32>,
    /// Per (sequence, kv head), the blocks that have finished; zero between launches.
    done: CudaSlice<u32>,
    splits: usize,
}

/// The multiprocessors of a GPU.
pub fn sm_count(gpu: &Gpu) -> Result<usize, AttnError> {
    gpu.context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map(|n| n.max(1) as usize)
        .map_err(device_error("reading the multiprocessor count"))
}

/// The kernel for a shape and layout, compiled on first use.
fn decode_kernel(
    gpu: &Gpu,
    kernel: DecodeKernel,
    entry: &str,
) -> Result<cudarc::driver::CudaFunction, AttnError> {
    let arch = gpu.arch();
    gpu.kernel(kernel.name(), entry, kernel.smem_bytes(), || {
        kernel.compile(arch)
    })
}

/// What [`plan_splits`] needs to know for `shape` and a cache of `page_size` on this GPU:
/// its multiprocessors, and how many blocks of the kernel's build each holds.
pub fn occupancy(
    gpu: &Gpu,
    shape: DecodeShape,
    dtype: Dtype,
    page_size: usize,
) -> Result<Occupancy, AttnError> {
    let kernel =
        DecodeKernel::new(dtype, shape.head_dim, shape.rows_per_kv_head(), page_size)?;
    let f = decode_kernel(gpu, kernel, DECODE)?;
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(
            kernel.threads(),
            kernel.smem_bytes() as usize,
            None,
        )
        .map_err(device_error("reading the kernel's occupancy"))?;
    Ok(Occupancy {
        sms: sm_count(gpu)?,
        blocks_per_sm: per_sm as usize,
        streaming: kernel.streaming_blocks(),
        block_keys: kernel.block_keys(),
    })
}

/// The split [`plan_splits`] chooses on this GPU for `shape` and a cache of `page_size`.
pub fn plan(
    gpu: &Gpu,
    shape: DecodeShape,
    dtype: Dtype,
    page_size: usize,
) -> Result<SplitPlan, AttnError> {
    let gpu_now = occupancy(gpu, shape, dtype, page_size)?;
    Ok(plan_splits(
        shape.batch * shape.kv_heads,
        shape.context,
        gpu_now,
    ))
}

/// Allocates what [`decode_into`] writes for `shape` with up to `splits` splits.
pub fn alloc_output(
    gpu: &Gpu,
    shape: DecodeShape,
    dtype: Dtype,
    splits: usize,
) -> Result<DecodeOutput, AttnError> {
    let rows = shape.batch * shape.q_heads * shape.q_rows;
    let stream = gpu.stream();
    let f32s = |n: usize, what: &str| {
        stream
            .alloc_zeros::<f32>(n.max(1))
            .map_err(alloc_error(what, n as u128 * 4))
    };
    let out = stream
        .alloc_zeros::<u16>((rows * shape.head_dim).max(1))
        .map_err(alloc_error(
            "allocating the output",
            (rows * shape.head_dim) as u128 * 2,
        ))?;
    let parts = if splits > 1 { splits } else { 0 };
    Ok(DecodeOutput {
        out: DeviceTensor {
            data: out,
            shape: Shape::new(shape.batch, shape.q_heads, shape.q_rows, shape.head_dim),
            dtype: half_dtype(dtype)?,
        },
        lse: f32s(rows, "allocating the log-sum-exp")?,
        part_out: f32s(
            parts * rows * shape.head_dim,
            "allocating the splits' outputs",
        )?,
        part_lse: f32s(parts * rows, "allocating the splits' log-sum-exps")?,
        done: stream
            .alloc_zeros::<u32>((shape.batch * shape.kv_heads).max(1))
            .map_err(alloc_error(
                "allocating the splits' counters",
                (shape.batch * shape.kv_heads) as u128 * 4,
            ))?,
        splits,
    })
}

// ANCHOR: decode_into
/// Decoding attention on the GPU: `q` `[batch, q_heads, q_rows, head_dim]` against `cache`,
/// the keys cut as `plan` says. With one split each block writes its rows' output; with
/// more, each block its split's partial result in f32, and the last block of a (sequence,
/// kv head) to finish merges them: one launch either way.
pub fn decode_into(
    gpu: &Gpu,
    q: &DeviceTensor,
    cache: &KvCache,
    plan: SplitPlan,
    result: &mut DecodeOutput,
) -> Result<(), AttnError> {
    let (shape, kernel) = check_device(q, cache, plan, result)?;
    if shape.is_empty() {
        return Ok(());
    }
    let f = decode_kernel(gpu, kernel, DECODE)?;
    let (table, max_pages) = match &cache.layout {
        Layout::Contiguous => (None, 0),
        Layout::Paged {
            table, max_pages, ..
        } => (Some(table), *max_pages as i32),
    };
    let config = LaunchConfig {
        grid_dim: (
            plan.splits as u32,
            shape.kv_heads as u32,
            shape.batch as u32,
        ),
        block_dim: (kernel.threads(), 1, 1),
        shared_mem_bytes: kernel.smem_bytes(),
    };
    let rows = shape.rows_per_kv_head();
    let (t, n, r) = (shape.context as i32, shape.q_rows as i32, rows as i32);
    let split_keys = plan.split_keys as i32;
    let scale_log2 = (std::f64::consts::LOG2_E * shape.scale()) as f32;
    let stream = gpu.stream();
    let mut launch = stream.launch_builder(&f);
    launch.arg(&q.data).arg(&cache.k).arg(&cache.v);
    match table {
        Some(table) => launch.arg(table),
        // a contiguous cache reads no table: any device pointer will do
        None => launch.arg(&cache.k),
    };
    launch
        .arg(&mut result.out.data)
        .arg(&mut result.lse)
        .arg(&mut result.part_out)
        .arg(&mut result.part_lse)
        .arg(&mut result.done)
        .arg(&cache.lens)
        .arg(&t)
        .arg(&n)
        .arg(&r)
        .arg(&max_pages)
        .arg(&split_keys)
        .arg(&scale_log2);
    // SAFETY: check_device proved q holds batch·q_heads·q_rows·head_dim values, the cache
    // batch·kv_heads·context·head_dim (or its pool pages·kv_heads·page_size·head_dim,
    // with a table checked on the host to name only pages of the pool), the output buffers
    // the shape's rows, and room for plan.splits partial results when there are several
    // with a counter for each (sequence, kv head), zeroed at allocation and left at zero by
    // each launch's last block; lens holds batch lengths; the grid covers the splits, kv
    // heads and sequences, and the kernel reads keys below min(lens[b], context) only.
    unsafe { launch.launch(config) }.map_err(device_error("launching flash_decode"))?;
    Ok(())
}
// ANCHOR_END: decode_into

/// The checks [`decode_into`] makes before a launch; the shape, and the kernel's build
/// for it.
fn check_device(
    q: &DeviceTensor,
    cache: &KvCache,
    plan: SplitPlan,
    result: &DecodeOutput,
) -> Result<(DecodeShape, DecodeKernel), AttnError> {
    let qs = q.shape;
    let shape = check_sizes(qs.dims(), cache.dims(), cache.dims())?;
    if q.dtype != cache.dtype {
        return Err(AttnError::Unsupported {
            what: format!(
                "q is {} and the cache {}: both must have one dtype",
                q.dtype.name(),
                cache.dtype.name()
            ),
        });
    }
    if q.data.len() < qs.len().max(1) {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "q's buffer holds {} values, its shape {qs} needs more",
                q.data.len()
            ),
        });
    }
    let cache_len = match &cache.layout {
        Layout::Contiguous => cache.batch * cache.kv_heads * cache.context,
        Layout::Paged {
            page_size,
            pages,
            max_pages,
            table_host,
            ..
        } => {
            check_table(
                table_host,
                cache.batch,
                *max_pages,
                *pages,
                *page_size,
                cache.context,
            )?;
            pages * cache.kv_heads * page_size
        }
    } * cache.head_dim;
    if cache.k.len() < cache_len || cache.v.len() < cache_len {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the cache's buffers hold {} and {} values; its shape needs {cache_len}",
                cache.k.len(),
                cache.v.len()
            ),
        });
    }
    if result.out.shape != qs || result.out.dtype != q.dtype {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the output buffers are for {} {}, q is {qs} {}",
                result.out.shape,
                result.out.dtype.name(),
                q.dtype.name()
            ),
        });
    }
    if cache.lens.len() < shape.batch {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the cache's lengths hold {} values, one for each of its {} sequences is \
                 needed",
                cache.lens.len(),
                shape.batch
            ),
        });
    }
    if result.done.len() < shape.batch * shape.kv_heads {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the output buffers count the splits of {} (sequence, kv head) pairs; the \
                 cache has {}",
                result.done.len(),
                shape.batch * shape.kv_heads
            ),
        });
    }
    let kernel = DecodeKernel::new(
        cache.dtype,
        shape.head_dim,
        shape.rows_per_kv_head().max(1),
        cache.page_size(),
    )?;
    let fits = plan.split_keys.is_multiple_of(kernel.block_keys())
        && plan.splits * plan.split_keys >= cache.keys.min(shape.context)
        && (plan.splits == 1 || plan.splits <= result.splits);
    if !fits {
        return Err(AttnError::Unsupported {
            what: format!(
                "{plan:?} does not cover {} keys in splits of a multiple of {} keys, or \
                 the output has room for {} splits only",
                cache.keys.min(shape.context),
                kernel.block_keys(),
                result.splits
            ),
        });
    }
    let grid_ok = shape.kv_heads <= 65_535
        && shape.batch <= 65_535
        && plan.splits <= i32::MAX as usize
        && shape.context <= i32::MAX as usize - plan.split_keys;
    if !grid_ok {
        return Err(AttnError::Unsupported {
            what: format!(
                "{shape}: the kernel's grid takes at most 65,535 kv heads and sequences, \
                 and 32-bit token indices"
            ),
        });
    }
    Ok((shape, kernel))
}

/// Where a host call's cache goes: contiguous, or in pages of `page_size` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostLayout {
    Contiguous,
    Paged { page_size: usize },
}

/// Decoding on the GPU from host arrays: q, k and v rounded to `dtype` and copied over, the
/// cache contiguous or paged (its pages shuffled in the pool), `splits` splits or the
/// plan's own; the output widened back to `f32`.
pub fn decode(
    gpu: &Gpu,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
    layout: HostLayout,
    splits: Option<usize>,
) -> Result<Attention, AttnError> {
    let shape = check_decode(&q, &k, &v)?;
    let dtype = half_dtype(dtype)?;
    let page_size = match layout {
        HostLayout::Contiguous => 0,
        HostLayout::Paged { page_size } => page_size,
    };
    let kernel = DecodeKernel::new(
        dtype,
        shape.head_dim,
        shape.rows_per_kv_head().max(1),
        page_size,
    )?;
    if shape.is_empty() {
        return Ok(Attention {
            out: Array4::zeros(shape.q_dims()),
            lse: Array3::zeros((shape.batch, shape.q_heads, shape.q_rows)),
        });
    }
    let cache = match layout {
        HostLayout::Contiguous => KvCache::upload(gpu, k, v, dtype)?,
        HostLayout::Paged { page_size } => {
            KvCache::upload_paged(gpu, k, v, dtype, page_size, 7)?
        }
    };
    let plan = match splits {
        Some(n) => fixed_splits(shape.context, n, kernel.block_keys()),
        None => plan(gpu, shape, dtype, page_size)?,
    };
    let q = gpu.upload(q, dtype)?;
    let mut result = alloc_output(gpu, shape, dtype, plan.splits)?;
    decode_into(gpu, &q, &cache, plan, &mut result)?;
    let out = gpu.download(&result.out)?;
    let lse = gpu
        .stream()
        .clone_dtoh(&result.lse)
        .map_err(device_error("copying from the GPU"))?;
    let lse = Array3::from_shape_vec((shape.batch, shape.q_heads, shape.q_rows), lse)
        .expect("one log-sum-exp a row");
    Ok(Attention { out, lse })
}

// ANCHOR: read_bytes
/// Launches `kernels/read.cu` over a cache's k and v: every byte read once, 16 at a time,
/// by enough blocks of 256 threads to fill each multiprocessor (occupancy), `sums` one
/// word per block. The time of this launch is the bound decoding is measured against.
pub fn read_bytes(
    gpu: &Gpu,
    k: &CudaSlice<u16>,
    v: &CudaSlice<u16>,
    sums: &mut CudaSlice<u32>,
) -> Result<(), AttnError> {
    let arch = gpu.arch();
    let f = gpu.kernel("read".into(), READ, 0, || compile_read(arch))?;
    if k.len() != v.len() || !k.len().is_multiple_of(8) {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "read_bytes reads k and v of one length, a multiple of 8 values (16 \
                 bytes); they hold {} and {}",
                k.len(),
                v.len()
            ),
        });
    }
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(256, 0, None)
        .map_err(device_error("reading the read kernel's occupancy"))?;
    let blocks = (sm_count(gpu)? * per_sm.max(1) as usize).min(sums.len());
    let n = (k.len() / 8) as i64;
    let config = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.stream().launch_builder(&f);
    launch.arg(k).arg(v).arg(&n).arg(sums);
    // SAFETY: k and v hold n 16-byte vectors each (checked above; cudarc's allocations are
    // aligned to at least 256 bytes), sums one word for each of the `blocks` blocks
    unsafe { launch.launch(config) }.map_err(device_error("launching read_bytes"))?;
    Ok(())
}
// ANCHOR_END: read_bytes

/// The value `kernels/fill.cu` writes at logical index `e` of a cache filled with `seed`:
/// a multiple of 1/64 in [-2, 2), exact in bf16 and f16.
pub fn cache_value(seed: u32, e: u64) -> f32 {
    fn mix(mut x: u32) -> u32 {
        x ^= x >> 16;
        x = x.wrapping_mul(0x7feb_352d);
        x ^= x >> 15;
        x = x.wrapping_mul(0x846c_a68b);
        x ^= x >> 16;
        x
    }
    let h = mix(mix((e >> 32) as u32 ^ seed) ^ e as u32);
    ((h >> 24) as i32 - 128) as f32 / 64.0
}

/// Fills k (`seed`) and v (`seed + 1`) of a cache on the GPU with [`cache_value`]'s values,
/// through the page table when it has one.
pub fn fill_cache(gpu: &Gpu, cache: &mut KvCache, seed: u32) -> Result<(), AttnError> {
    let (dtype, head_dim, arch) = (cache.dtype, cache.head_dim, gpu.arch());
    let f = gpu.kernel(format!("fill {dtype:?} {head_dim}"), FILL, 0, || {
        compile_fill(dtype, head_dim, arch)
    })?;
    let n = (cache.batch * cache.kv_heads * cache.context * cache.head_dim) as i64;
    let (kvh, t) = (cache.kv_heads as i32, cache.context as i32);
    let (page_size, max_pages) = match &cache.layout {
        Layout::Contiguous => (0, 0),
        Layout::Paged {
            page_size,
            max_pages,
            ..
        } => (*page_size as i32, *max_pages as i32),
    };
    let blocks = (sm_count(gpu)? * 8) as u32;
    // a contiguous cache reads no table: a word to point at
    let no_table = gpu
        .stream()
        .alloc_zeros::<i32>(1)
        .map_err(device_error("allocating a word"))?;
    let table = match &cache.layout {
        Layout::Paged { table, .. } => table,
        Layout::Contiguous => &no_table,
    };
    for (x, seed) in [(&mut cache.k, seed), (&mut cache.v, seed.wrapping_add(1))] {
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = gpu.stream().launch_builder(&f);
        launch
            .arg(x)
            .arg(table)
            .arg(&n)
            .arg(&kvh)
            .arg(&t)
            .arg(&page_size)
            .arg(&max_pages)
            .arg(&seed);
        // SAFETY: the cache holds its logical values (or its pool their pages, through a
        // table checked on the host); the kernel writes each logical value once
        unsafe { launch.launch(config) }.map_err(device_error("launching fill_cache"))?;
    }
    Ok(())
}
