//! Decoding on the GPU: a cache of keys and values in device memory that grows a page at a
//! time, the split of its keys over thread blocks, and the launches of `kernels/append.cu`,
//! `kernels/decode.cu`, and `kernels/read.cu`, the physical limit decoding is measured
//! against.
//!
//! A user decodes in one call, as with FlashAttention's `flash_attn_with_kvcache` (the new
//! tokens' keys and values appended, then attention, the split chosen for this GPU):
//!
//! ```text
//! let paged = CacheLayout::Paged { page_size: PAGE_SIZE };
//! let spec = CacheSpec::new(batch, kv_heads, max_len, head_dim, Dtype::Bf16, paged);
//! let mut cache = PagedKvCache::new(gpu, spec)?;
//! let new = NewKv::from_heads(&k_new, &v_new)?;
//! let out = attend_with_kvcache(gpu, &mut cache, &q, Some(&new))?;
//! ```
//!
//! or, as with FlashInfer, plans once and runs the plan for each layer of a model:
//!
//! ```text
//! let plan = DecodePlan::new(gpu, &cache, q_heads, q_rows)?;    // once
//! let mut out = plan.alloc_output(gpu)?;
//! cache.reserve(gpu, &[1; batch])?;                              // each step
//! for layer in 0..layers {
//!     cache.write(gpu, layer, &new_kv)?;
//!     plan.run(gpu, &cache, layer, &q, &mut out)?;
//! }
//! ```
//!
//! ## Layout
//!
//! - [`PagedKvCache`]: each layer's keys and values in a pool of pages `[pool, kv_heads,
//!   page_size, head_dim]`, and one [`PageTable`] for all layers, on the host and on the
//!   device, as vLLM's PagedAttention keeps them: a sequence takes a free page when it
//!   grows past its last ([`PagedKvCache::reserve`]), and the table is checked and
//!   copied to the device when it changes. [`CacheLayout::Contiguous`] is the same cache
//!   with one page a sequence, as long as the cache. [`NewKv`]: where the new tokens' keys
//!   and values are read from.
//! - [`SplitPlan`]: how many splits of how many keys, [`plan_splits`] choosing them from
//!   the GPU's multiprocessors.
//! - [`DecodePlan`]: the kernel's build and the GPU's occupancy for a cache and a count of
//!   query rows, made once; [`DecodePlan::run`] launches the kernel, its splits merged by
//!   their last block, on one layer. [`attend_with_kvcache`]: append and attend in one
//!   call; [`decode`] on host arrays.
//! - [`read_bytes`], [`fill_cache`]: the read kernel, and the benchmark's fill of a cache
//!   whose values [`cache_value`] makes again on the host.

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array3, Array4, ArrayView4};
use step03_cuda_forward::gpu::{
    DeviceTensor, Dtype, Gpu, alloc_error, device_error, half_dtype,
};
use step03_cuda_forward::kernel::{HEAD_DIMS, unsupported_head_dim};

use crate::decode::{DecodeShape, check_decode, check_sizes};
use crate::kernel::{APPEND, DECODE, DecodeKernel, FILL, READ, READ_KERNEL, fill_kernel};
use crate::pages::PageTable;

/// How a cache's tokens lie in each layer's pool, `[pages, kv_heads, page_size, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLayout {
    /// One page a sequence, as long as the cache: `[batch, kv_heads, max_len, head_dim]`,
    /// one sequence's heads after another's. The decoding kernel's build reads no table.
    Contiguous,
    /// Pages of `page_size` tokens from a pool the sequences share, found through the
    /// page table.
    Paged { page_size: usize },
}

impl CacheLayout {
    /// The decoding kernel's `PAGE_SIZE`: 0 for a contiguous cache.
    pub fn kernel_page_size(&self) -> usize {
        match self {
            CacheLayout::Contiguous => 0,
            CacheLayout::Paged { page_size } => *page_size,
        }
    }
}

/// What a [`PagedKvCache`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSpec {
    /// Layers, each with keys and values of its own; the sequences' lengths and pages are
    /// the same in every layer.
    pub layers: usize,
    /// Sequences.
    pub batch: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens a sequence may hold: a model's context.
    pub max_len: usize,
    /// bf16 or f16.
    pub dtype: Dtype,
    pub layout: CacheLayout,
    /// Pages in each layer's pool. [`CacheSpec::new`] gives every sequence room for
    /// `max_len` tokens; fewer, and the sequences share the pool as a server's do. A
    /// contiguous cache has one page a sequence: `batch`.
    pub pool: usize,
}

impl CacheSpec {
    /// One layer, and a pool with room for every sequence at `max_len` tokens.
    pub fn new(
        batch: usize,
        kv_heads: usize,
        max_len: usize,
        head_dim: usize,
        dtype: Dtype,
        layout: CacheLayout,
    ) -> CacheSpec {
        let pool = match layout {
            CacheLayout::Contiguous => batch,
            CacheLayout::Paged { page_size } => batch * max_len.div_ceil(page_size.max(1)),
        };
        CacheSpec {
            layers: 1,
            batch,
            kv_heads,
            head_dim,
            max_len,
            dtype,
            layout,
            pool,
        }
    }

    /// An empty page table for this cache.
    pub fn page_table(&self) -> Result<PageTable, AttnError> {
        match self.layout {
            CacheLayout::Contiguous if self.pool != self.batch => {
                Err(AttnError::Unsupported {
                    what: format!(
                        "a contiguous cache of {} sequences with a pool of {} pages: a \
                     contiguous cache has one page a sequence, a pool of {}",
                        self.batch, self.pool, self.batch
                    ),
                })
            }
            CacheLayout::Contiguous => PageTable::contiguous(self.batch, self.max_len),
            CacheLayout::Paged { page_size } => {
                PageTable::new(self.batch, self.max_len, page_size, self.pool)
            }
        }
    }

    /// Values in one layer's pool of keys (or of values), checked before any allocation.
    fn layer_values(&self, page_size: usize) -> Result<usize, AttnError> {
        [self.kv_heads, page_size, self.head_dim]
            .iter()
            .try_fold(self.pool, |n, &d| n.checked_mul(d))
            .filter(|&n| {
                n.checked_mul(self.layers)
                    .is_some_and(|n| n <= isize::MAX as usize / 2)
            })
            .ok_or_else(|| AttnError::Unsupported {
                what: format!("{self:?}: more values than memory can address"),
            })
    }
}

/// New tokens' keys and values on the device, read where they are: value `c` of head `h`
/// of new token `j` of sequence `b` at `b·batch_stride + j·row_stride + h·head_stride + c`
/// in `k` (and in `v`), as PyTorch reads a strided tensor.
pub struct NewKv<'a> {
    k: CudaView<'a, u16>,
    v: CudaView<'a, u16>,
    dtype: Dtype,
    batch: usize,
    /// New tokens a sequence.
    rows: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Values from one sequence's first new token to the next's, from a token to the
    /// next, from a head to the next.
    strides: [usize; 3],
}

impl<'a> NewKv<'a> {
    /// Contiguous `[batch, kv_heads, rows, head_dim]` tensors, SDPA's layout and step 03's.
    pub fn from_heads(
        k: &'a DeviceTensor,
        v: &'a DeviceTensor,
    ) -> Result<NewKv<'a>, AttnError> {
        let s = k.shape;
        if v.shape != s || v.dtype != k.dtype {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "the new keys are {s} {} and the values {} {}: both must be [batch, \
                     kv_heads, rows, head_dim] of one dtype",
                    k.dtype.name(),
                    v.shape,
                    v.dtype.name()
                ),
            });
        }
        NewKv::strided(
            k.data.slice(..),
            v.data.slice(..),
            k.dtype,
            [s.batch, s.tokens, s.heads, s.head_dim],
            [
                s.heads * s.tokens * s.head_dim,
                s.head_dim,
                s.tokens * s.head_dim,
            ],
        )
    }

    /// The keys and values in fused projections `[q's heads | k's heads | v's heads]`, one
    /// row of `(q_heads + 2·kv_heads)·head_dim` values a token, `rows` tokens a sequence
    /// one after another: a model's `qkv`, read in place.
    pub fn from_fused(
        qkv: &'a CudaSlice<u16>,
        dtype: Dtype,
        [batch, rows]: [usize; 2],
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<NewKv<'a>, AttnError> {
        let width = (q_heads + 2 * kv_heads) * head_dim;
        let (k_at, v_at) = (q_heads * head_dim, (q_heads + kv_heads) * head_dim);
        if v_at > qkv.len() {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "a fused projection of {} values for {q_heads} query heads and \
                     {kv_heads} kv heads of {head_dim}: a token's row is {width} values",
                    qkv.len()
                ),
            });
        }
        NewKv::strided(
            qkv.slice(k_at..),
            qkv.slice(v_at..),
            dtype,
            [batch, rows, kv_heads, head_dim],
            [rows * width, width, head_dim],
        )
    }

    /// Checks that every value the strides reach lies in `k` and `v`.
    fn strided(
        k: CudaView<'a, u16>,
        v: CudaView<'a, u16>,
        dtype: Dtype,
        [batch, rows, kv_heads, head_dim]: [usize; 4],
        strides: [usize; 3],
    ) -> Result<NewKv<'a>, AttnError> {
        let dtype = half_dtype(dtype)?;
        let last = [batch, rows, kv_heads]
            .iter()
            .zip(strides)
            .try_fold(head_dim, |end, (&n, stride)| {
                n.saturating_sub(1).checked_mul(stride)?.checked_add(end)
            });
        let empty = batch == 0 || rows == 0 || kv_heads == 0 || head_dim == 0;
        match last {
            Some(end) if empty || (end <= k.len() && end <= v.len()) => Ok(NewKv {
                k,
                v,
                dtype,
                batch,
                rows,
                kv_heads,
                head_dim,
                strides,
            }),
            _ => Err(AttnError::ShapeMismatch {
                what: format!(
                    "new keys and values of {batch} sequences × {rows} tokens × {kv_heads} \
                     heads × {head_dim} at strides {strides:?} reach past their buffers \
                     of {} and {} values",
                    k.len(),
                    v.len()
                ),
            }),
        }
    }

    /// New tokens a sequence.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

// ANCHOR: paged_kv_cache
/// Keys and values on the GPU, 16-bit, for `batch` sequences and `layers` layers, in pages
/// handed out as the sequences grow. Its lengths, its page table and the values they
/// describe change together, through its methods only: [`PagedKvCache::reserve`] makes
/// room for new tokens in every sequence (once a step), [`PagedKvCache::write`] puts one
/// layer's keys and values there, [`PagedKvCache::append`] does both for a one-layer
/// cache, and [`PagedKvCache::release`] empties a sequence.
pub struct PagedKvCache {
    spec: CacheSpec,
    /// `[layers, pool, kv_heads, page_size, head_dim]` each.
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    /// The host's table, lengths and free pages.
    pages: PageTable,
    /// `[batch, max_pages]`: the host's table as of its last change.
    table: CudaSlice<i32>,
    /// `[2·batch]`: each sequence's length, then how many of its tokens the last reserve
    /// added, as the host's were at the last reserve or release. The kernels read both.
    lens: CudaSlice<i32>,
    /// Tokens the last reserve added to each sequence.
    added: Vec<usize>,
    /// Per layer, whether those tokens' keys and values are still to be written: a layer
    /// that has not written them is not attended.
    unwritten: Vec<bool>,
}
// ANCHOR_END: paged_kv_cache

impl PagedKvCache {
    /// An empty cache: every sequence of length 0, every page free. Its sizes are checked
    /// before anything is allocated.
    pub fn new(gpu: &Gpu, spec: CacheSpec) -> Result<PagedKvCache, AttnError> {
        half_dtype(spec.dtype)?;
        if !HEAD_DIMS.contains(&spec.head_dim) {
            return Err(unsupported_head_dim(spec.head_dim));
        }
        if spec.layers == 0 || spec.kv_heads == 0 {
            return Err(AttnError::Unsupported {
                what: format!(
                    "a cache of {} layers and {} kv heads: at least one of each",
                    spec.layers, spec.kv_heads
                ),
            });
        }
        let pages = spec.page_table()?;
        let len = spec.layer_values(pages.page_size())? * spec.layers;
        let stream = gpu.stream();
        let values = || {
            stream
                .alloc_zeros::<u16>(len.max(1))
                .map_err(alloc_error("allocating the cache", len as u128 * 2))
        };
        let (k, v) = (values()?, values()?);
        let table = stream
            .clone_htod(pages.table())
            .map_err(device_error("copying the page table"))?;
        let lens = stream
            .alloc_zeros::<i32>(2 * spec.batch)
            .map_err(device_error("allocating the cache's lengths"))?;
        Ok(PagedKvCache {
            k,
            v,
            table,
            lens,
            added: vec![0; spec.batch],
            unwritten: vec![false; spec.layers],
            pages,
            spec,
        })
    }

    pub fn spec(&self) -> CacheSpec {
        self.spec
    }

    /// Each sequence's length: its tokens, those the last reserve added included.
    pub fn lens(&self) -> &[usize] {
        self.pages.lens()
    }

    /// The longest sequence's length.
    pub fn longest(&self) -> usize {
        self.pages.longest()
    }

    /// The host's page table, lengths and free pages.
    pub fn pages(&self) -> &PageTable {
        &self.pages
    }

    /// Each layer's pool of keys and of values, `[layers, pool, kv_heads, page_size,
    /// head_dim]`, to read.
    pub fn pools(&self) -> (&CudaSlice<u16>, &CudaSlice<u16>) {
        (&self.k, &self.v)
    }

    /// Bytes of keys and values the sequences hold now, in all layers: what decoding every
    /// layer reads.
    pub fn bytes(&self) -> u64 {
        let tokens: usize = self.lens().iter().sum();
        let s = self.spec;
        2 * (s.layers * tokens * s.kv_heads * s.head_dim) as u64 * 2
    }

    /// The free pages in an order shuffled by `seed`, so that the pages a sequence takes
    /// lie out of order in the pool ([`PageTable::shuffle_free`]).
    pub fn shuffle_free(&mut self, seed: u64) {
        self.pages.shuffle_free(seed);
    }

    // ANCHOR: reserve
    /// Room for `added[b]` more tokens at the end of each sequence `b`, in every layer:
    /// the lengths grow, a sequence past its last page takes free ones, and the table (when
    /// it changed, checked first) and the lengths go to the device, where the kernels read
    /// them. Once a step, before each layer's [`PagedKvCache::write`]. All or nothing on
    /// the host: a sequence past `max_len` or a pool out of pages changes nothing.
    pub fn reserve(&mut self, gpu: &Gpu, added: &[usize]) -> Result<(), AttnError> {
        if self.pages.grow(added)? {
            self.pages.check()?;
            gpu.stream()
                .memcpy_htod(self.pages.table(), &mut self.table)
                .map_err(device_error("copying the page table"))?;
        }
        self.added = added.to_vec();
        let any = added.iter().any(|&n| n > 0);
        self.unwritten.iter_mut().for_each(|u| *u = any);
        self.copy_lens(gpu)
    }
    // ANCHOR_END: reserve

    // ANCHOR: write
    /// Layer `layer`'s keys and values of the tokens the last [`PagedKvCache::reserve`]
    /// added: sequence `b`'s first `added[b]` rows of `new`, written by `kernels/append.cu`
    /// into the pages the table names.
    pub fn write(&mut self, gpu: &Gpu, layer: usize, new: &NewKv) -> Result<(), AttnError> {
        self.check_new(layer, new)?;
        let most = self.added.iter().copied().max().unwrap_or(0);
        if new.rows < most {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "the last reserve added up to {most} tokens a sequence and the new \
                     keys and values hold {} a sequence",
                    new.rows
                ),
            });
        }
        let s = self.spec;
        let values = s.batch * most * s.kv_heads * s.head_dim;
        if values > 0 {
            let f = append_kernel(gpu, s.dtype, s.head_dim)?;
            let blocks = u32::try_from(values.div_ceil(256)).map_err(|_| {
                AttnError::Unsupported {
                    what: format!("{values} new values: the append kernel takes < 2^40"),
                }
            })?;
            let layer_len = self.k.len() / s.layers;
            let at = layer * layer_len..(layer + 1) * layer_len;
            let mut k = self.k.slice_mut(at.clone());
            let mut v = self.v.slice_mut(at);
            let [batch_stride, row_stride, head_stride] = new.strides.map(|x| x as i64);
            let (max_pages, page_size) =
                (self.pages.max_pages() as i32, self.pages.page_size() as i32);
            let (kv_heads, rows, batch) = (s.kv_heads as i32, most as i32, s.batch as i32);
            let mut launch = gpu.stream().launch_builder(&f);
            launch
                .arg(&new.k)
                .arg(&new.v)
                .arg(&batch_stride)
                .arg(&row_stride)
                .arg(&head_stride)
                .arg(&mut k)
                .arg(&mut v)
                .arg(&self.table)
                .arg(&max_pages)
                .arg(&kv_heads)
                .arg(&page_size)
                .arg(&self.lens)
                .arg(&rows)
                .arg(&batch);
            let config = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: NewKv::strided proved every source value the strides reach lies in
            // new.k and new.v; k and v are one layer's pool; the device table names, for
            // each sequence, pages of the pool for every token below its length (checked
            // when it changed), and lens holds those lengths and added[b] ≤ rows, the
            // tokens a sequence writes, from lens[b] - added[b] on
            unsafe { launch.launch(config) }
                .map_err(device_error("launching append_kv"))?;
        }
        self.unwritten[layer] = false;
        Ok(())
    }
    // ANCHOR_END: write

    /// `new`'s tokens at the end of every sequence of a one-layer cache: a reserve of
    /// `new.rows()` tokens a sequence and the layer's write. A model's cache of several
    /// layers reserves once a step and writes each layer.
    pub fn append(&mut self, gpu: &Gpu, new: &NewKv) -> Result<(), AttnError> {
        if self.spec.layers != 1 {
            return Err(AttnError::Unsupported {
                what: format!(
                    "append on a cache of {} layers: a model reserves once a step \
                     (PagedKvCache::reserve) and writes each layer (PagedKvCache::write)",
                    self.spec.layers
                ),
            });
        }
        // refused before anything changes
        self.check_new(0, new)?;
        self.reserve(gpu, &vec![new.rows; self.spec.batch])?;
        self.write(gpu, 0, new)
    }

    /// Empties sequence `seq`: length 0, its pages back to the free list.
    pub fn release(&mut self, gpu: &Gpu, seq: usize) -> Result<(), AttnError> {
        if self.pages.release(seq)? {
            gpu.stream()
                .memcpy_htod(self.pages.table(), &mut self.table)
                .map_err(device_error("copying the page table"))?;
        }
        self.added[seq] = 0;
        self.copy_lens(gpu)
    }

    fn copy_lens(&mut self, gpu: &Gpu) -> Result<(), AttnError> {
        let words: Vec<i32> = self
            .pages
            .lens()
            .iter()
            .chain(&self.added)
            .map(|&n| n as i32)
            .collect();
        gpu.stream()
            .memcpy_htod(&words, &mut self.lens)
            .map_err(device_error("copying the cache's lengths"))
    }

    /// The refusals of a layer and of new keys and values that do not fit this cache.
    fn check_new(&self, layer: usize, new: &NewKv) -> Result<(), AttnError> {
        self.check_layer(layer)?;
        let s = self.spec;
        let ours = (s.batch, s.kv_heads, s.head_dim, s.dtype);
        let theirs = (new.batch, new.kv_heads, new.head_dim, new.dtype);
        if ours != theirs {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "new keys and values of {} sequences, {} kv heads of {} values, {}, \
                     for a cache of {} sequences, {} kv heads of {}, {}",
                    new.batch,
                    new.kv_heads,
                    new.head_dim,
                    new.dtype.name(),
                    s.batch,
                    s.kv_heads,
                    s.head_dim,
                    s.dtype.name()
                ),
            });
        }
        Ok(())
    }

    fn check_layer(&self, layer: usize) -> Result<(), AttnError> {
        if layer >= self.spec.layers {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "layer {layer} of a cache of {} layers: layers 0 to {}",
                    self.spec.layers,
                    self.spec.layers - 1
                ),
            });
        }
        Ok(())
    }
}

/// `kernels/append.cu`'s `append_kv` for a dtype and head dim, compiled on first use.
fn append_kernel(
    gpu: &Gpu,
    dtype: Dtype,
    head_dim: usize,
) -> Result<CudaFunction, AttnError> {
    gpu.kernel(&crate::kernel::append_kernel(dtype, head_dim), APPEND, 0)
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

/// What [`DecodePlan::run`] writes: the output `[batch, q_heads, q_rows, head_dim]` in 16
/// bits, each row's natural log-sum-exp, and room for the splits' partial results in f32.
pub struct DecodeOutput {
    pub out: DeviceTensor,
    pub lse: CudaSlice<f32>,
    part_out: CudaSlice<f32>,
    part_lse: CudaSlice<f32>,
    /// Per (sequence, kv head), the blocks that have finished; zero between launches.
    done: CudaSlice<u32>,
    /// The most splits `part_out` and `part_lse` have room for.
    splits: usize,
}

/// The multiprocessors of a GPU.
pub fn sm_count(gpu: &Gpu) -> Result<usize, AttnError> {
    gpu.context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map(|n| n.max(1) as usize)
        .map_err(device_error("reading the multiprocessor count"))
}

/// The decoding kernel's build, compiled on first use.
fn decode_kernel(gpu: &Gpu, kernel: DecodeKernel) -> Result<CudaFunction, AttnError> {
    gpu.kernel(&kernel, DECODE, kernel.smem_bytes())
}

/// What [`plan_splits`] needs to know of this GPU for a build of the decoding kernel: its
/// multiprocessors, and how many blocks of the build each holds.
pub fn occupancy(gpu: &Gpu, kernel: DecodeKernel) -> Result<Occupancy, AttnError> {
    let f = decode_kernel(gpu, kernel)?;
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

// ANCHOR: decode_plan
/// Decoding planned once for a cache and a count of query rows, as FlashInfer's `plan()`:
/// the kernel's build, what the split is chosen from on this GPU, and the output's room;
/// then [`DecodePlan::run`] for each layer and step. The split is chosen at each run for
/// the cache's longest sequence then ([`plan_splits`]), or, for a CUDA graph, whose
/// launches must be the same at every length, once for a full cache
/// ([`DecodePlan::for_graph`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodePlan {
    /// q's and the cache's sizes, `context` the cache's `max_len`.
    shape: DecodeShape,
    /// The cache this plan is for, but its layers and pool.
    spec: CacheSpec,
    kernel: DecodeKernel,
    occupancy: Occupancy,
    fixed: Option<SplitPlan>,
}

impl DecodePlan {
    /// The plan for `q_heads` heads of `q_rows` query rows a sequence against `cache`, on
    /// this GPU.
    pub fn new(
        gpu: &Gpu,
        cache: &PagedKvCache,
        q_heads: usize,
        q_rows: usize,
    ) -> Result<DecodePlan, AttnError> {
        let probe = DecodePlan::with_occupancy(cache.spec(), q_heads, q_rows, NO_GPU)?;
        let occupancy = occupancy(gpu, probe.kernel)?;
        Ok(DecodePlan { occupancy, ..probe })
    }

    /// The plan for a GPU described by `occupancy`: every check of the shapes, no GPU.
    pub fn with_occupancy(
        spec: CacheSpec,
        q_heads: usize,
        q_rows: usize,
        occupancy: Occupancy,
    ) -> Result<DecodePlan, AttnError> {
        let q = [spec.batch, q_heads, q_rows, spec.head_dim];
        let kv = [spec.batch, spec.kv_heads, spec.max_len, spec.head_dim];
        let shape = check_sizes(q, kv, kv)?;
        if shape.is_empty() {
            return Err(AttnError::Unsupported {
                what: format!("{shape}: a plan decodes at least one query row"),
            });
        }
        let kernel = DecodeKernel::new(
            half_dtype(spec.dtype)?,
            spec.head_dim,
            shape.rows_per_kv_head(),
            spec.layout.kernel_page_size(),
        )?;
        let grid_ok = shape.kv_heads <= 65_535
            && shape.batch <= 65_535
            && shape.context <= i32::MAX as usize / 2;
        if !grid_ok {
            return Err(AttnError::Unsupported {
                what: format!(
                    "{shape}: the kernel's grid takes at most 65,535 kv heads and \
                     sequences, and 2^30 tokens a sequence"
                ),
            });
        }
        Ok(DecodePlan {
            shape,
            spec,
            kernel,
            occupancy,
            fixed: None,
        })
    }

    /// The same plan with the split of a full cache at every length, as a CUDA graph's
    /// launches must be: a full cache's splits cover every shorter cache's keys, and
    /// splits past a sequence's end find none.
    pub fn for_graph(self) -> DecodePlan {
        let fixed = self.split(self.shape.context);
        DecodePlan {
            fixed: Some(fixed),
            ..self
        }
    }

    /// Tests' and the lab's: the keys always cut into `splits` splits of a full cache (as
    /// near as a multiple of a block's keys allows), whatever the plan would choose. The
    /// plan gives a short cache one split; the tests take it through the merge this way.
    #[doc(hidden)]
    pub fn with_splits(self, splits: usize) -> DecodePlan {
        let fixed = fixed_splits(self.shape.context, splits, self.kernel.block_keys());
        DecodePlan {
            fixed: Some(fixed),
            ..self
        }
    }

    /// The split a run takes when the longest sequence holds `keys` tokens.
    pub fn split(&self, keys: usize) -> SplitPlan {
        let pairs = self.shape.batch * self.shape.kv_heads;
        self.fixed
            .unwrap_or_else(|| plan_splits(pairs, keys, self.occupancy))
    }

    /// The sizes: q `[batch, q_heads, q_rows, head_dim]`, the cache's `max_len` tokens.
    pub fn shape(&self) -> DecodeShape {
        self.shape
    }

    pub fn kernel(&self) -> DecodeKernel {
        self.kernel
    }

    /// The most splits a run takes at any length: the room an output needs.
    pub fn most_splits(&self) -> usize {
        match self.fixed {
            Some(fixed) => fixed.splits,
            None => most_splits(
                self.shape.batch * self.shape.kv_heads,
                self.shape.context,
                self.occupancy,
            ),
        }
    }

    /// An output for every run of this plan.
    pub fn alloc_output(&self, gpu: &Gpu) -> Result<DecodeOutput, AttnError> {
        let shape = self.shape;
        let splits = self.most_splits();
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
                dtype: self.spec.dtype,
            },
            lse: f32s(rows, "allocating the log-sum-exp")?,
            part_out: f32s(
                parts * rows * shape.head_dim,
                "allocating the splits' outputs",
            )?,
            part_lse: f32s(parts * rows, "allocating the splits' log-sum-exps")?,
            done: stream
                .alloc_zeros::<u32>(shape.batch * shape.kv_heads)
                .map_err(alloc_error(
                    "allocating the splits' counters",
                    (shape.batch * shape.kv_heads) as u128 * 4,
                ))?,
            splits,
        })
    }

    // ANCHOR: run
    /// Decoding attention on layer `layer` of `cache`: `q` `[batch, q_heads, q_rows,
    /// head_dim]`, row `i` of `n` of sequence `b` against its keys `0 ..= len[b] − n + i`.
    /// With one split each block writes its rows' output; with more, each block its
    /// split's partial result in f32, and the last block of a (sequence, kv head) to finish
    /// merges them: one launch either way. Returns the split it took.
    pub fn run(
        &self,
        gpu: &Gpu,
        cache: &PagedKvCache,
        layer: usize,
        q: &DeviceTensor,
        out: &mut DecodeOutput,
    ) -> Result<SplitPlan, AttnError> {
        let split = self.check_run(cache, layer, q, out)?;
        let f = decode_kernel(gpu, self.kernel)?;
        let shape = self.shape;
        let config = LaunchConfig {
            grid_dim: (
                split.splits as u32,
                shape.kv_heads as u32,
                shape.batch as u32,
            ),
            block_dim: (self.kernel.threads(), 1, 1),
            shared_mem_bytes: self.kernel.smem_bytes(),
        };
        let layer_len = cache.k.len() / cache.spec.layers;
        let at = layer * layer_len..(layer + 1) * layer_len;
        let (k, v) = (cache.k.slice(at.clone()), cache.v.slice(at));
        let rows = shape.rows_per_kv_head();
        let (t, n, r) = (shape.context as i32, shape.q_rows as i32, rows as i32);
        let max_pages = cache.pages.max_pages() as i32;
        let split_keys = split.split_keys as i32;
        let scale_log2 = (std::f64::consts::LOG2_E * shape.scale()) as f32;
        let mut launch = gpu.stream().launch_builder(&f);
        launch
            .arg(&q.data)
            .arg(&k)
            .arg(&v)
            .arg(&cache.table)
            .arg(&mut out.out.data)
            .arg(&mut out.lse)
            .arg(&mut out.part_out)
            .arg(&mut out.part_lse)
            .arg(&mut out.done)
            .arg(&cache.lens)
            .arg(&t)
            .arg(&n)
            .arg(&r)
            .arg(&max_pages)
            .arg(&split_keys)
            .arg(&scale_log2);
        // SAFETY: check_run proved q holds batch·q_heads·q_rows·head_dim values and the
        // output the same rows, with room for split.splits partial results when there are
        // several and a counter for each (sequence, kv head), zeroed at allocation and left
        // at zero by each launch's last block; the cache is the plan's (its pools hold
        // pool·kv_heads·page_size·head_dim values a layer, its device table names pages of
        // the pool for every token below each length, checked when it changed, and lens
        // holds batch lengths of at most max_len); the grid covers the splits, kv heads and
        // sequences, the splits cover the longest sequence, and the kernel reads keys
        // below min(lens[b], max_len) only.
        unsafe { launch.launch(config) }.map_err(device_error("launching flash_decode"))?;
        Ok(split)
    }
    // ANCHOR_END: run

    /// An error unless `q` is the plan's `[batch, q_heads, q_rows, head_dim]` in the
    /// cache's dtype; its shape.
    fn check_q(&self, q: &DeviceTensor) -> Result<Shape, AttnError> {
        let qs = Shape::new(
            self.shape.batch,
            self.shape.q_heads,
            self.shape.q_rows,
            self.shape.head_dim,
        );
        if q.shape != qs || q.dtype != self.spec.dtype || q.data.len() < qs.len() {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "q is {} {} in a buffer of {} values; the plan decodes {qs} {}",
                    q.shape,
                    q.dtype.name(),
                    q.data.len(),
                    self.spec.dtype.name()
                ),
            });
        }
        Ok(qs)
    }

    /// The refusals of [`DecodePlan::run`], before a launch; the split it takes.
    fn check_run(
        &self,
        cache: &PagedKvCache,
        layer: usize,
        q: &DeviceTensor,
        out: &DecodeOutput,
    ) -> Result<SplitPlan, AttnError> {
        let ours = CacheSpec {
            layers: cache.spec.layers,
            pool: cache.spec.pool,
            ..self.spec
        };
        if cache.spec != ours {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "a plan for a cache {:?} run on a cache {:?}: make the plan for the \
                     cache",
                    self.spec, cache.spec
                ),
            });
        }
        cache.check_layer(layer)?;
        if cache.unwritten[layer] {
            return Err(AttnError::Unsupported {
                what: format!(
                    "layer {layer} has not written the keys and values of the tokens the \
                     last reserve added ({:?} a sequence): write them before attending",
                    cache.added
                ),
            });
        }
        let n = self.shape.q_rows;
        if let Some((b, &len)) = cache.lens().iter().enumerate().find(|(_, l)| **l < n) {
            return Err(AttnError::Unsupported {
                what: format!(
                    "sequence {b} holds {len} tokens and q has {n} rows a sequence: the \
                     query rows are each sequence's last tokens, so each must hold at \
                     least {n}"
                ),
            });
        }
        let qs = self.check_q(q)?;
        let split = self.split(cache.longest());
        if out.out.shape != qs
            || out.out.dtype != q.dtype
            || split.splits > out.splits.max(1)
        {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "the output is for {} {} with room for {} splits; this run writes {qs} \
                     {} in {} splits (DecodePlan::alloc_output makes a plan's output)",
                    out.out.shape,
                    out.out.dtype.name(),
                    out.splits,
                    q.dtype.name(),
                    split.splits
                ),
            });
        }
        Ok(split)
    }
}
// ANCHOR_END: decode_plan

/// What a plan made without a GPU assumes until [`occupancy`] reads the GPU's.
const NO_GPU: Occupancy = Occupancy {
    sms: 1,
    blocks_per_sm: 1,
    streaming: 1,
    block_keys: 1,
};

// ANCHOR: attend_with_kvcache
/// Appends `new`'s tokens to every sequence of a one-layer `cache` (none when `new` is
/// `None`), then decodes `q`'s rows against each sequence's cache with the split chosen for
/// this GPU and the cache's longest sequence: FlashAttention's `flash_attn_with_kvcache`
/// in one call. q is checked before the cache changes.
pub fn attend_with_kvcache(
    gpu: &Gpu,
    cache: &mut PagedKvCache,
    q: &DeviceTensor,
    new: Option<&NewKv>,
) -> Result<DecodeOutput, AttnError> {
    let plan = DecodePlan::new(gpu, cache, q.shape.heads, q.shape.tokens)?;
    plan.check_q(q)?;
    let mut out = plan.alloc_output(gpu)?;
    if let Some(new) = new {
        cache.append(gpu, new)?;
    }
    plan.run(gpu, cache, 0, q, &mut out)?;
    Ok(out)
}
// ANCHOR_END: attend_with_kvcache

/// Decoding on the GPU from host arrays: q, k and v rounded to `dtype` and copied over, k
/// and v appended to an empty cache laid out as `layout` (its free pages shuffled, so
/// that a sequence's pages lie out of order in the pool), the keys split as the plan
/// chooses; the output widened back to `f32`.
pub fn decode(
    gpu: &Gpu,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
    layout: CacheLayout,
) -> Result<Attention, AttnError> {
    decode_from_host(gpu, q, k, v, dtype, layout, None)
}

/// Tests': [`decode`] with the keys cut into `splits` splits whatever the plan would
/// choose ([`DecodePlan::with_splits`]), to take a short cache through the merge.
#[doc(hidden)]
pub fn decode_with_splits(
    gpu: &Gpu,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
    layout: CacheLayout,
    splits: usize,
) -> Result<Attention, AttnError> {
    decode_from_host(gpu, q, k, v, dtype, layout, Some(splits))
}

/// [`decode`], the split the plan's or `splits` where given.
fn decode_from_host(
    gpu: &Gpu,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
    layout: CacheLayout,
    splits: Option<usize>,
) -> Result<Attention, AttnError> {
    let shape = check_decode(&q, &k, &v)?;
    let dtype = half_dtype(dtype)?;
    DecodeKernel::new(
        dtype,
        shape.head_dim,
        shape.rows_per_kv_head().max(1),
        layout.kernel_page_size(),
    )?;
    if shape.is_empty() {
        return Ok(Attention {
            out: Array4::zeros(shape.q_dims()),
            lse: Array3::zeros((shape.batch, shape.q_heads, shape.q_rows)),
        });
    }
    let spec = CacheSpec::new(
        shape.batch,
        shape.kv_heads,
        shape.context,
        shape.head_dim,
        dtype,
        layout,
    );
    let mut cache = PagedKvCache::new(gpu, spec)?;
    cache.shuffle_free(7);
    let mut plan = DecodePlan::new(gpu, &cache, shape.q_heads, shape.q_rows)?;
    if let Some(n) = splits {
        plan = plan.with_splits(n);
    }
    let (k, v) = (gpu.upload(k, dtype)?, gpu.upload(v, dtype)?);
    cache.append(gpu, &NewKv::from_heads(&k, &v)?)?;
    let q = gpu.upload(q, dtype)?;
    let mut result = plan.alloc_output(gpu)?;
    plan.run(gpu, &cache, 0, &q, &mut result)?;
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
    let f = gpu.kernel(&READ_KERNEL, READ, 0)?;
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

/// Fills every layer's k (`seed`) and v (`seed + 1`) of a cache on the GPU with
/// [`cache_value`]'s values at each token's logical index in `[batch, kv_heads, max_len,
/// head_dim]`, through the page table. Every sequence must hold `max_len` tokens (a
/// reserve of them): the fill writes them all, and then they are written.
pub fn fill_cache(gpu: &Gpu, cache: &mut PagedKvCache, seed: u32) -> Result<(), AttnError> {
    let s = cache.spec;
    if cache.lens().iter().any(|&n| n != s.max_len) {
        return Err(AttnError::Unsupported {
            what: format!(
                "fill_cache on sequences of {:?} tokens: it fills whole caches, so every \
                 sequence must hold the cache's {} (PagedKvCache::reserve)",
                cache.lens(),
                s.max_len
            ),
        });
    }
    let f = gpu.kernel(&fill_kernel(s.dtype, s.head_dim), FILL, 0)?;
    let n = (s.batch * s.kv_heads * s.max_len * s.head_dim) as i64;
    let (kvh, t) = (s.kv_heads as i32, s.max_len as i32);
    let page_size = s.layout.kernel_page_size() as i32;
    let max_pages = cache.pages.max_pages() as i32;
    let blocks = (sm_count(gpu)? * 8) as u32;
    let layer_len = cache.k.len() / s.layers;
    let PagedKvCache { k, v, table, .. } = cache;
    for layer in 0..s.layers {
        let at = layer * layer_len..(layer + 1) * layer_len;
        for (x, seed) in [(&mut *k, seed), (&mut *v, seed.wrapping_add(1))] {
            let mut x = x.slice_mut(at.clone());
            let config = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = gpu.stream().launch_builder(&f);
            launch
                .arg(&mut x)
                .arg(&*table)
                .arg(&n)
                .arg(&kvh)
                .arg(&t)
                .arg(&page_size)
                .arg(&max_pages)
                .arg(&seed);
            // SAFETY: the layer's pool holds every sequence's max_len tokens (contiguous,
            // or in the pages its table names: every sequence is full, and the table was
            // checked when it changed); the kernel writes each logical value once
            unsafe { launch.launch(config) }
                .map_err(device_error("launching fill_cache"))?;
        }
    }
    cache.unwritten.iter_mut().for_each(|u| *u = false);
    Ok(())
}
