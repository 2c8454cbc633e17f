//! Masks on the GPU: the mask's source compiled by NVRTC into step 06's Hopper kernels, the
//! block mask computed on the GPU once per mask and shape, and the forward and backward
//! that walk it.
//!
//! A [`DeviceMask`] is what FlexAttention's `create_block_mask` returns: for one mask, one
//! shape and one kernel shape, the lists of blocks each block of queries visits (the
//! forward) and each block of keys meets (the backward), with every entry marked full or
//! partial, and the mask's data (document ids) on the device. [`forward`] and [`backward`]
//! take it with q, k and v, and run the kernels it was made for: these, or on a GPU other
//! than a Hopper steps 03's and 04's ([`cuda_ampere`](crate::cuda_ampere)).

use cudarc::driver::PushKernelArg;
use cudarc::driver::{
    CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
};
use std::borrow::Cow;
use std::hash::{Hash, Hasher};

use flash_core::check::grouped_kv;
use flash_core::{AttnError, Shape};
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{
    DeviceTensor, Dtype, Gpu, KernelSpec, alloc_error, device_error,
};
use step04_backward::cuda::DeviceGrads;
use step06_hopper::backward::{launch_delta, launch_dq_convert};
use step06_hopper::forward::{check_hopper, tensor_map};
use step06_hopper::kernel::{
    BACKWARD_CUH, BLOCK_N, BackwardKernels, BackwardPass, FORWARD_CUH, ForwardKernel,
    ForwardRung, HEAD_DIMS, HOPPER_CUH,
};
use step06_hopper::layout::{Layout, Strided, TmaRank};

use crate::cuda_ampere::{self, Kernels};
use crate::mask::{Mask, ScoreMod, kernel_source};

/// The lists' block mask, the forward, and the backward, in CUDA.
pub const MASKED_CUH: &str = include_str!("../kernels/masked.cuh");
pub const BLOCK_MASK_CU: &str = include_str!("../kernels/block_mask.cu");
/// The masked forward on step 06's rung 1 and on its rung 4.
pub const MASKED_1_CU: &str = include_str!("../kernels/masked_1_wgmma.cu");
pub const MASKED_4_CU: &str = include_str!("../kernels/masked_4_overlap.cu");
pub const MASKED_BACKWARD_CU: &str = include_str!("../kernels/masked_backward.cu");

/// The block mask's tiles: 64 queries (the backward's stream of queries) by 128 keys (the
/// forward's blocks of keys and the backward's blocks of keys alike).
pub const TILE_Q: usize = 64;
pub const TILE_K: usize = BLOCK_N;

/// Which (sequence, head) pairs share a row of the block mask: one row for all when the
/// mask reads neither (causal, a window), a row a sequence when it reads the sequence
/// (documents), a row a head otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MaskRows {
    One,
    PerSequence,
    PerHead,
}

impl MaskRows {
    /// The rows of a block mask for `batch` sequences of `heads` heads, and the strides
    /// that take a sequence and a head to their row (`b · row_b + h · row_h`).
    fn strides(self, batch: usize, heads: usize) -> (usize, i32, i32) {
        match self {
            MaskRows::One => (1, 0, 0),
            MaskRows::PerSequence => (batch, 1, 0),
            MaskRows::PerHead => (batch * heads, heads as i32, 1),
        }
    }
}

/// A mask and a score function as the GPU takes them: CUDA source defining `mask_mod`,
/// `score_mod` and `score_mod_grad` (src/mask.rs writes it for the built-ins; a user
/// writes their own), a key that names it among compiled modules, whether the score
/// function is the identity, which pairs share a block-mask row, and the mask's data
/// (`[batch][tk]` document ids) where it has some.
#[derive(Clone, Debug)]
pub struct GpuMask {
    pub source: String,
    pub key: String,
    pub score_identity: bool,
    /// What it costs the forward in registers: which kernel runs it ([`forward_kernel`]).
    pub weight: Weight,
    pub rows: MaskRows,
    pub data: Option<Vec<i32>>,
}

impl GpuMask {
    /// `mask` and `score` as the GPU takes them: their CUDA text (a user's `.cu` file, or
    /// what src/mask.rs writes for a built-in), named by their names and a hash of that
    /// text, so that two masks of one name but different code are compiled apart.
    pub fn new(mask: &Mask, score: &ScoreMod) -> Result<GpuMask, AttnError> {
        let source = kernel_source(mask, score)?;
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        source.hash(&mut hasher);
        let varies = mask.varies_with();
        Ok(GpuMask {
            key: format!("{},{} {:016x}", mask.name(), score.name(), hasher.finish()),
            score_identity: score.is_identity(),
            weight: match mask {
                _ if !score.is_identity() => Weight::Heavy,
                Mask::Causal | Mask::PrefixLm { .. } => Weight::FromZero,
                Mask::Custom(_) => Weight::Heavy,
                _ => Weight::Interval,
            },
            rows: match (varies.batch, varies.head) {
                (_, true) => MaskRows::PerHead,
                (true, false) => MaskRows::PerSequence,
                (false, false) => MaskRows::One,
            },
            data: mask.gpu_data(),
            source,
        })
    }
}

/// `mask` and `score` checked for `batch` sequences of `heads` query heads and `tk` keys,
/// as the CPU checks them, except that a mask or score function given as CUDA alone is
/// accepted: it runs here.
pub fn check_mask(
    mask: &Mask,
    score: &ScoreMod,
    batch: usize,
    heads: usize,
    tk: usize,
) -> Result<(), AttnError> {
    if !matches!(mask, Mask::Custom(_)) {
        mask.check(batch, tk)?;
    }
    if !matches!(score, ScoreMod::Custom(_)) {
        score.check(heads)?;
    }
    Ok(())
}

/// The lists a kernel walks, as masked.cuh's `BlockList`: two device addresses and four
/// integers (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockList {
    count: u64,
    index: u64,
    blocks: i32,
    others: i32,
    row_b: i32,
    row_h: i32,
}
// SAFETY: plain integers laid out as the kernels' struct (two 8-byte fields, four 4-byte
// ones: 32 bytes, as asserted)
unsafe impl DeviceRepr for BlockList {}
const _: () = assert!(std::mem::size_of::<BlockList>() == 32);

/// A mask compiled for one shape: the block lists of the forward (blocks of `64 · wgs`
/// queries) and of the backward (blocks of 128 keys), and the mask's data, on the device.
pub struct DeviceMask {
    mask: GpuMask,
    /// the kernels the lists were made for (their blocks of queries)
    kernels: Kernels,
    batch: usize,
    heads: usize,
    tq: usize,
    tk: usize,
    wgs: usize,
    rows: usize,
    row_b: i32,
    row_h: i32,
    q_tiles: usize,
    k_blocks: usize,
    fwd_count: CudaSlice<i32>,
    fwd_index: CudaSlice<i32>,
    bwd_count: CudaSlice<i32>,
    bwd_index: CudaSlice<i32>,
    data: Option<CudaSlice<i32>>,
    /// the scores the mask lets through, summed over the mask's rows
    visible: u64,
    /// the tiles of each class, summed over the mask's rows: empty, partial, full
    tiles: [u64; 3],
}

/// The forward kernel the masked forward is built on for queries of shape `q`, by what the
/// mask costs a thread in registers ([`Weight`]). The causal mask and a prefix take the one
/// `cuda_hopper` runs ([`ForwardKernel::for_shape`]: rung 1 at head dim 64 up to 4,096
/// queries, rung 4 beyond and at 128), so that causal attention through the masks costs
/// what it costs in step 06; the other intervals take rung 4 at every length (rung 1's
/// three blocks a multiprocessor leave a thread 136 registers, a few too few for a lower
/// bound); a mask that is not an interval or a score function takes rung 4 with two
/// consumer warpgroups (three leave a thread 160 registers, too few for either).
pub fn forward_kernel(q: Shape, kv_heads: usize, weight: Weight) -> ForwardKernel {
    match weight {
        Weight::FromZero => ForwardKernel::for_shape(q, kv_heads),
        Weight::Interval => ForwardRung::Overlap.shape(q, kv_heads),
        Weight::Heavy => ForwardKernel {
            warpgroups: 2,
            ..ForwardRung::Overlap.shape(q, kv_heads)
        },
    }
}

/// What a mask and a score function cost the forward's threads in registers: rows of keys
/// from the first to a bound (causal, a prefix: two comparisons a score against bounds
/// found once), other intervals (a window, documents, every key: a lower bound to hold
/// too), or anything else (a mask asked score by score, a score function).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Weight {
    FromZero,
    Interval,
    Heavy,
}

/// The warpgroups of the forward's blocks of queries (64 queries each), which the forward's
/// lists are made for: [`forward_kernel`]'s on Hopper, two on Ampere (step 03's blocks of
/// 128 queries).
fn warpgroups(kernels: Kernels, q: Shape, kv_heads: usize, weight: Weight) -> usize {
    match kernels {
        Kernels::Hopper => forward_kernel(q, kv_heads, weight).warpgroups,
        Kernels::Ampere => cuda_ampere::BLOCK_ROWS / TILE_Q,
    }
}

/// The backward kernel the masked backward is built on: step 06's one pass.
pub fn backward_kernels(q: Shape) -> BackwardKernels {
    BackwardKernels::for_shape(q)
}

/// The block mask's kernels for a mask, for blocks of `wgs` warpgroups of queries.
#[derive(Clone, Copy, Debug)]
pub struct BlockMaskKernel<'a> {
    pub mask: &'a GpuMask,
    pub wgs: usize,
}

impl KernelSpec for BlockMaskKernel<'_> {
    fn name(&self) -> String {
        "block_mask.cu".into()
    }

    fn source(&self) -> Cow<'_, str> {
        block_mask_source(self.mask).into()
    }

    fn defines(&self) -> Vec<String> {
        vec![format!("-DWGS={}", self.wgs)]
    }

    /// The mask's key (its names and a hash of its text) and the block shape.
    fn key(&self) -> String {
        format!("block mask {} wgs{}", self.mask.key, self.wgs)
    }
}

/// The masked forward: `kernel` (rung 1 or rung 4 of step 06) with the mask's functions,
/// for a dtype, a head dim and a rank of the tensor maps.
#[derive(Clone, Copy, Debug)]
pub struct MaskedForwardKernel<'a> {
    pub mask: &'a GpuMask,
    pub kernel: ForwardKernel,
    pub dtype: Dtype,
    pub head_dim: usize,
    pub rank: TmaRank,
}

impl KernelSpec for MaskedForwardKernel<'_> {
    fn name(&self) -> String {
        "masked_forward.cu".into()
    }

    fn source(&self) -> Cow<'_, str> {
        let (k, d) = (self.kernel, self.head_dim);
        forward_source(self.mask, k, self.dtype, d, self.rank)
            .0
            .into()
    }

    fn defines(&self) -> Vec<String> {
        self.kernel.defines(self.dtype, self.head_dim, self.rank)
    }

    /// Step 06's limits for the kernel it is built on.
    fn check(&self) -> Result<(), AttnError> {
        self.kernel.check(self.head_dim)
    }

    fn arch(&self, _device: &'static str) -> &'static str {
        "sm_90a"
    }

    /// The mask's key and everything the build changes.
    fn key(&self) -> String {
        let (dtype, d, rank) = (self.dtype, self.head_dim, self.rank);
        let (mask, kernel) = (&self.mask.key, self.kernel.name());
        format!("masked forward {mask} {dtype:?} d{d} {kernel} {rank:?}")
    }
}

/// The masked backward: step 06's one pass, `kernels`, with the mask's functions, for a
/// dtype, a head dim and a rank of the tensor maps.
#[derive(Clone, Copy, Debug)]
pub struct MaskedBackwardKernel<'a> {
    pub mask: &'a GpuMask,
    pub kernels: BackwardKernels,
    pub dtype: Dtype,
    pub head_dim: usize,
    pub rank: TmaRank,
}

impl KernelSpec for MaskedBackwardKernel<'_> {
    fn name(&self) -> String {
        "masked_backward.cu".into()
    }

    fn source(&self) -> Cow<'_, str> {
        let (k, d) = (self.kernels, self.head_dim);
        backward_source(self.mask, k, self.dtype, d, self.rank)
            .0
            .into()
    }

    fn defines(&self) -> Vec<String> {
        self.kernels
            .dkdv
            .defines(self.dtype, self.head_dim, self.rank)
    }

    /// Step 06's limits for the dK and dV kernel it is built on.
    fn check(&self) -> Result<(), AttnError> {
        self.kernels.dkdv.check(self.head_dim)
    }

    fn arch(&self, _device: &'static str) -> &'static str {
        "sm_90a"
    }

    /// The mask's key and everything the build changes.
    fn key(&self) -> String {
        let (dtype, d, rank) = (self.dtype, self.head_dim, self.rank);
        let (mask, kernel) = (&self.mask.key, self.kernels.dkdv.name());
        format!("masked backward {mask} {dtype:?} d{d} {kernel} {rank:?}")
    }
}

/// The source of the block mask's kernels with `mask`'s functions: what
/// [`DeviceMask::new`] compiles, and the kernel checks.
pub fn block_mask_source(mask: &GpuMask) -> String {
    format!("{}\n{BLOCK_MASK_CU}", mask.source)
}

/// The masked forward's source and `-D` set for `kernel` (rung 1 or rung 4 of step 06).
pub fn forward_source(
    mask: &GpuMask,
    kernel: ForwardKernel,
    dtype: Dtype,
    d: usize,
    rank: TmaRank,
) -> (String, Vec<String>) {
    let defines = kernel.defines(dtype, d, rank);
    let body = match kernel.rung {
        ForwardRung::Wgmma => MASKED_1_CU,
        _ => MASKED_4_CU,
    };
    (
        format!(
            "{HOPPER_CUH}\n{FORWARD_CUH}\n{}\n{MASKED_CUH}\n{body}",
            mask.source
        ),
        defines,
    )
}

/// The masked backward's source (step 06's one pass before it) and `-D` set.
pub fn backward_source(
    mask: &GpuMask,
    kernels: BackwardKernels,
    dtype: Dtype,
    d: usize,
    rank: TmaRank,
) -> (String, Vec<String>) {
    let defines = kernels.dkdv.defines(dtype, d, rank);
    (
        format!(
            "{HOPPER_CUH}\n{BACKWARD_CUH}\n{}\n{}\n{MASKED_CUH}\n{MASKED_BACKWARD_CU}",
            BackwardPass::OnePass.source(),
            mask.source
        ),
        defines,
    )
}

impl DeviceMask {
    /// The block mask of `mask` for `batch` sequences of `heads` query heads, `tq` queries
    /// against `tk` keys at head dim `d`, for the kernels this GPU runs
    /// ([`Kernels::for_gpu`]): every tile classified on the GPU, then the lists made there
    /// too. Computed once and reused by every call of that shape.
    pub fn new(
        gpu: &Gpu,
        mask: &GpuMask,
        batch: usize,
        heads: usize,
        tq: usize,
        tk: usize,
        d: usize,
    ) -> Result<DeviceMask, AttnError> {
        let q = Shape::new(batch, heads, tq, d);
        DeviceMask::with_kernels(gpu, mask, Kernels::for_gpu(gpu)?, q, tk)
    }

    /// [`DeviceMask::new`] for queries of shape `q` against `tk` keys, for the kernels
    /// asked: the Ampere kernels run on a Hopper GPU too, so that they can be tested there.
    pub fn with_kernels(
        gpu: &Gpu,
        mask: &GpuMask,
        kernels: Kernels,
        q: Shape,
        tk: usize,
    ) -> Result<DeviceMask, AttnError> {
        kernels.check(gpu)?;
        let (batch, heads, tq) = (q.batch, q.heads, q.tokens);
        check_lengths(tq, tk)?;
        check_data(mask, batch, tk)?;
        let wgs = warpgroups(kernels, q, heads, mask.weight);
        let (rows, row_b, row_h) = mask.rows.strides(batch, heads);
        let (q_tiles, k_blocks) = (tq.div_ceil(TILE_Q), tk.div_ceil(TILE_K));
        let fwd_blocks = q_tiles.div_ceil(wgs);
        if rows * q_tiles > 65_535 {
            return Err(AttnError::Unsupported {
                what: format!(
                    "the block mask of {} for {rows} rows of {tq} queries: more than 65,535 \
                     rows × tiles of 64 queries",
                    mask.key
                ),
            });
        }
        let stream = gpu.stream();
        let data = upload_data(gpu, mask)?;
        let ints = |n: usize, what: &str| {
            stream
                .alloc_zeros::<i32>(n)
                .map_err(alloc_error(what, n as u128 * 4))
        };
        let mut classes = stream
            .alloc_zeros::<u8>(rows * q_tiles * k_blocks)
            .map_err(alloc_error(
                "the block mask",
                (rows * q_tiles * k_blocks) as u128,
            ))?;
        let mut visible = stream
            .alloc_zeros::<u64>(1)
            .map_err(alloc_error("the block mask's count", 8))?;
        let mut fwd_count = ints(rows * fwd_blocks, "the forward's block lists")?;
        let mut fwd_index =
            ints(rows * fwd_blocks * k_blocks, "the forward's block lists")?;
        let mut bwd_count = ints(rows * k_blocks, "the backward's block lists")?;
        let mut bwd_index = ints(rows * k_blocks * q_tiles, "the backward's block lists")?;
        let spec = BlockMaskKernel { mask, wgs };
        let module = |entry: &str| gpu.kernel(&spec, entry, 0);
        let (tq32, tk32) = (tq as i32, tk as i32);
        let data_ptr = data.as_ref().map_or(0u64, |d| d.device_ptr(stream).0);
        let grid = (rows, q_tiles, k_blocks);
        // SAFETY: classes holds rows × q_tiles × k_blocks bytes and visible one count; the
        // data, where there is some, batch × tk ids (check_data)
        unsafe {
            launch_classify(
                gpu,
                &module("classify")?,
                (&mut classes, &mut visible),
                data_ptr,
                (tq32, tk32),
                (row_b, row_h),
                grid,
            )?;
        }
        let f = module("block_lists")?;
        for (forward, count, index, blocks) in [
            (true, &mut fwd_count, &mut fwd_index, fwd_blocks),
            (false, &mut bwd_count, &mut bwd_index, k_blocks),
        ] {
            // SAFETY: count holds rows × blocks counts and index rows × blocks × others
            // entries (others: k_blocks for the forward's lists, q_tiles for the
            // backward's), as allocated above
            unsafe {
                launch_block_lists(
                    gpu,
                    &f,
                    &classes,
                    (count, index),
                    (forward, blocks),
                    grid,
                )?
            };
        }
        let visible = stream
            .clone_dtoh(&visible)
            .map_err(device_error("reading the block mask's count"))?[0];
        let tiles = count_tiles(gpu, &classes)?;
        Ok(DeviceMask {
            mask: mask.clone(),
            kernels,
            batch,
            heads,
            tq,
            tk,
            wgs,
            rows,
            row_b,
            row_h,
            q_tiles,
            k_blocks,
            fwd_count,
            fwd_index,
            bwd_count,
            bwd_index,
            data,
            visible,
            tiles,
        })
    }

    /// The scores the kernels compute for the whole call: the visible ones of every
    /// (sequence, head).
    pub fn computed_scores(&self) -> u64 {
        let per_row = (self.batch * self.heads / self.rows) as u64;
        self.visible * per_row
    }

    /// The fraction of all tq × tk scores that are visible: the mask's density.
    pub fn density(&self) -> f64 {
        self.computed_scores() as f64 / (self.batch * self.heads * self.tq * self.tk) as f64
    }

    /// The tiles of 64 × 128 scores that are empty, partial and full, over the mask's rows.
    pub fn tiles(&self) -> [u64; 3] {
        self.tiles
    }

    pub fn mask(&self) -> &GpuMask {
        &self.mask
    }

    /// The kernels the lists were made for, which [`forward`] and [`backward`] run.
    pub fn kernels(&self) -> Kernels {
        self.kernels
    }

    pub(crate) fn list(&self, forward: bool, gpu: &Gpu) -> BlockList {
        let stream = gpu.stream();
        let (count, index, blocks, others) = if forward {
            (
                &self.fwd_count,
                &self.fwd_index,
                self.q_tiles.div_ceil(self.wgs),
                self.k_blocks,
            )
        } else {
            (
                &self.bwd_count,
                &self.bwd_index,
                self.k_blocks,
                self.q_tiles,
            )
        };
        BlockList {
            count: count.device_ptr(stream).0,
            index: index.device_ptr(stream).0,
            blocks: blocks as i32,
            others: others as i32,
            row_b: self.row_b,
            row_h: self.row_h,
        }
    }

    pub(crate) fn data_ptr(&self, gpu: &Gpu) -> u64 {
        self.data
            .as_ref()
            .map_or(0, |d| d.device_ptr(gpu.stream()).0)
    }

    /// That q, k and v are the shape this block mask was made for.
    pub(crate) fn check_shape(&self, q: Shape, kv: Shape) -> Result<(), AttnError> {
        let wgs = warpgroups(self.kernels, q, kv.heads, self.mask.weight);
        if (q.batch, q.heads, q.tokens, kv.tokens, wgs)
            != (self.batch, self.heads, self.tq, self.tk, self.wgs)
        {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "the block mask of {} was made for {} sequences of {} heads, {} queries \
                     against {} keys, at {} warpgroups; q is {q} and k {kv}: make one for \
                     this shape",
                    self.mask.key, self.batch, self.heads, self.tq, self.tk, self.wgs
                ),
            });
        }
        Ok(())
    }
}

/// Launches `classify`: one block of 256 threads a tile of each block-mask row, `grid`
/// being (rows, query tiles, key blocks), each writing its tile's class (empty, partial,
/// full) and adding its visible scores to the count in `visible`.
///
/// # Safety
///
/// `classes` holds rows × query tiles × key blocks bytes and `visible` one count; `data`
/// is 0 or the mask's data, its ids for every position below tk of each sequence its rows
/// read (`row_b`, `row_h`).
unsafe fn launch_classify(
    gpu: &Gpu,
    f: &CudaFunction,
    (classes, visible): (&mut CudaSlice<u8>, &mut CudaSlice<u64>),
    data: u64,
    (tq, tk): (i32, i32),
    (row_b, row_h): (i32, i32),
    (rows, q_tiles, k_blocks): (usize, usize, usize),
) -> Result<(), AttnError> {
    let mut launch = gpu.stream().launch_builder(f);
    launch
        .arg(classes)
        .arg(visible)
        .arg(&data)
        .arg(&tq)
        .arg(&tk)
        .arg(&row_b)
        .arg(&row_h);
    let config = LaunchConfig {
        grid_dim: (k_blocks as u32, q_tiles as u32, rows as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: classes holds rows × q_tiles × k_blocks bytes, one a block of the grid; the
    // data, where there is some, batch × tk ids (the caller's promise), read by mask_mod at
    // positions below tk only
    unsafe { launch.launch(config) }.map_err(device_error("launching classify"))?;
    Ok(())
}

/// Launches `block_lists` on the classes `classify` wrote: one thread a (row, block) of
/// `blocks` a row writes the count and the list of the blocks that block visits, the
/// forward's (a block of queries' key blocks) or the backward's (a block of keys' query
/// tiles).
///
/// # Safety
///
/// `classes` holds rows × query tiles × key blocks bytes (`grid`); `count` holds rows ×
/// blocks values and `index` rows × blocks × others, where others are the key blocks for
/// the forward's lists and the query tiles for the backward's.
unsafe fn launch_block_lists(
    gpu: &Gpu,
    f: &CudaFunction,
    classes: &CudaSlice<u8>,
    (count, index): (&mut CudaSlice<i32>, &mut CudaSlice<i32>),
    (forward, blocks): (bool, usize),
    (rows, q_tiles, k_blocks): (usize, usize, usize),
) -> Result<(), AttnError> {
    let (rows32, qt32, kb32) = (rows as i32, q_tiles as i32, k_blocks as i32);
    let forward = forward as i32;
    let mut launch = gpu.stream().launch_builder(f);
    launch
        .arg(classes)
        .arg(count)
        .arg(index)
        .arg(&rows32)
        .arg(&qt32)
        .arg(&kb32)
        .arg(&forward);
    let threads = rows * blocks;
    let config = LaunchConfig {
        grid_dim: (threads.div_ceil(128) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: one thread a (row, block), below rows × blocks; each writes its count and at
    // most `others` entries of its own row of the index, as allocated (the caller's
    // promise)
    unsafe { launch.launch(config) }.map_err(device_error("launching block_lists"))?;
    Ok(())
}

/// That a mask's data fits `batch` sequences of `tk` keys: document ids and starts, a row
/// of each for every sequence, or one row all share.
fn check_data(mask: &GpuMask, batch: usize, tk: usize) -> Result<(), AttnError> {
    match &mask.data {
        Some(data) if data.len() != 2 * batch * tk && data.len() != 2 * tk => {
            Err(AttnError::ShapeMismatch {
                what: format!(
                    "the mask {} holds {} document ids and starts; {batch} sequences of {tk} \
                     keys need {} (one row for all) or {}",
                    mask.key,
                    data.len(),
                    2 * tk,
                    2 * batch * tk
                ),
            })
        }
        _ => Ok(()),
    }
}

/// The mask's data (document ids and starts) on the device, where it has some.
fn upload_data(gpu: &Gpu, mask: &GpuMask) -> Result<Option<CudaSlice<i32>>, AttnError> {
    match &mask.data {
        Some(ids) => Ok(Some(
            gpu.stream()
                .clone_htod(ids)
                .map_err(alloc_error("the mask's data", ids.len() as u128 * 4))?,
        )),
        None => Ok(None),
    }
}

/// The tiles of each class in a block mask's classes on the GPU: empty, partial, full.
fn count_tiles(gpu: &Gpu, classes: &CudaSlice<u8>) -> Result<[u64; 3], AttnError> {
    let classes = gpu
        .stream()
        .clone_dtoh(classes)
        .map_err(device_error("reading the block mask"))?;
    let mut tiles = [0u64; 3];
    for c in classes {
        tiles[c as usize] += 1;
    }
    Ok(tiles)
}

/// That tq and tk make a shape the masks take: tq queries at the end of tk positions.
pub fn check_lengths(tq: usize, tk: usize) -> Result<(), AttnError> {
    if tq > tk {
        return Err(AttnError::Unsupported {
            what: format!(
                "{tq} queries against {tk} keys: the queries are the last tq of the keys' \
                 positions, so tq must be at most tk"
            ),
        });
    }
    if tk >= 1 << 30 {
        return Err(AttnError::Unsupported {
            what: format!("{tk} keys: at most 2^30 - 1"),
        });
    }
    Ok(())
}

/// q, k and v on the device: one dtype, one head dim and batch, kv heads dividing q's, at
/// most as many queries as keys, a head dim the kernels take; k's shape.
pub fn check_qkv(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
) -> Result<Shape, AttnError> {
    for (x, name) in [(q, "q"), (k, "k"), (v, "v")] {
        if x.data.len() != x.shape.len() {
            return Err(AttnError::ShapeMismatch {
                what: format!(
                    "{name} holds {} values, its shape {} needs {}",
                    x.data.len(),
                    x.shape,
                    x.shape.len()
                ),
            });
        }
    }
    if k.shape != v.shape || k.dtype != q.dtype || v.dtype != q.dtype {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "k is {} {}, v {} {}, q {} {}: k and v must match, all in one dtype",
                k.shape,
                k.dtype.name(),
                v.shape,
                v.dtype.name(),
                q.shape,
                q.dtype.name()
            ),
        });
    }
    let kv = grouped_kv(
        Shape {
            tokens: k.shape.tokens,
            ..q.shape
        },
        k.shape.heads,
    )?;
    if kv != k.shape {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "q is {} and k {}: they must share the batch and the head dim",
                q.shape, k.shape
            ),
        });
    }
    check_lengths(q.shape.tokens, k.shape.tokens)?;
    if !HEAD_DIMS.contains(&q.shape.head_dim) {
        return Err(AttnError::UnsupportedHeadDim {
            head_dim: q.shape.head_dim,
            supported: HEAD_DIMS.map(|d| d.to_string()).join(", "),
        });
    }
    if q.shape.batch * q.shape.heads > 65_535 {
        return Err(AttnError::Unsupported {
            what: format!("{}: at most 65,535 sequences × heads", q.shape),
        });
    }
    Ok(kv)
}

fn contiguous(x: &DeviceTensor, gpu: &Gpu) -> Strided {
    Strided {
        ptr: x.data.device_ptr(gpu.stream()).0,
        layout: Layout::heads(x.shape),
    }
}

// ANCHOR: forward
/// Attention with `mask`'s mask and score function: the output and each row's log-sum-exp
/// (a row that sees no key: zeros and −∞).
pub fn forward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    mask: &DeviceMask,
) -> Result<DeviceAttention, AttnError> {
    if mask.kernels == Kernels::Ampere {
        return cuda_ampere::forward(gpu, q, k, v, mask);
    }
    check_hopper(gpu)?;
    let kv = check_qkv(q, k, v)?;
    mask.check_shape(q.shape, kv)?;
    let mut result = gpu.alloc_output(q.shape, q.dtype)?;
    if q.shape.is_empty() {
        return Ok(result);
    }
    let (shape, dtype, d) = (q.shape, q.dtype, q.shape.head_dim);
    let kernel = forward_kernel(shape, kv.heads, mask.mask.weight);
    let grid = kernel.grid(shape)?;
    let [qs, ks, vs] = [q, k, v].map(|x| contiguous(x, gpu));
    let rank = TmaRank::of(&[qs.layout, ks.layout, vs.layout], shape);
    let smem = kernel.smem_bytes(d);
    let spec = MaskedForwardKernel {
        mask: &mask.mask,
        kernel,
        dtype,
        head_dim: d,
        rank,
    };
    // step 06's limits for the kernel are checked as its module is compiled
    let f = gpu.kernel(&spec, "masked_forward", smem)?;
    kernel.check_registers(&f)?;
    // SAFETY: q, k and v were checked to hold their shapes' values, contiguous, 16-bit,
    // in allocations of this GPU's context (256-byte aligned)
    let maps = unsafe {
        [
            tensor_map(qs, dtype, shape, kernel.block_m(), rank)?,
            tensor_map(ks, dtype, kv, BLOCK_N, rank)?,
            tensor_map(vs, dtype, kv, BLOCK_N, rank)?,
        ]
    };
    let list = mask.list(true, gpu);
    let data = mask.data_ptr(gpu);
    let (tq, tk) = (shape.tokens as i32, kv.tokens as i32);
    let q_per_kv = (shape.heads / kv.heads) as i32;
    let scale = 1.0 / (d as f32).sqrt();
    let scale_log2 = shape.scale_log2();
    let out_layout = Layout::heads(shape);
    let stream = gpu.stream();
    let (out, _out) = result.out.data.device_ptr_mut(stream);
    let (lse, _lse) = result.lse.device_ptr_mut(stream);
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&maps[0])
        .arg(&maps[1])
        .arg(&maps[2])
        .arg(&out)
        .arg(&out_layout)
        .arg(&lse)
        .arg(&tq)
        .arg(&tk)
        .arg(&q_per_kv)
        .arg(&list)
        .arg(&data)
        .arg(&scale)
        .arg(&scale_log2);
    let config = LaunchConfig {
        grid_dim: grid,
        block_dim: (kernel.threads(), 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: the maps read within q, k and v (rows past the ends read as zeros); the lists
    // were made for this shape (check_shape) and name blocks below tk's; each block writes
    // the output and lse of its own query rows below tq
    unsafe { launch.launch(config) }.map_err(device_error("launching masked_forward"))?;
    drop((_out, _lse));
    Ok(result)
}
// ANCHOR_END: forward

// ANCHOR: backward
/// The gradients of q, k and v through `mask`, given the forward's output and log-sum-exp
/// and the output's gradient `dout`: step 06's one pass over the block mask's lists.
pub fn backward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
    mask: &DeviceMask,
) -> Result<DeviceGrads, AttnError> {
    if mask.kernels == Kernels::Ampere {
        return cuda_ampere::backward(gpu, q, k, v, fwd, dout, mask);
    }
    check_hopper(gpu)?;
    let kv = check_qkv(q, k, v)?;
    mask.check_shape(q.shape, kv)?;
    check_backward_inputs(q, fwd, dout)?;
    let shape = q.shape;
    let (dtype, d) = (q.dtype, shape.head_dim);
    // dK and dV for every query head (k's length), summed over each group at the end
    let per_q = Shape {
        tokens: kv.tokens,
        ..shape
    };
    let stream = gpu.stream();
    let mut grads = zero_grads(gpu, shape, per_q, dtype)?;
    if shape.is_empty() || kv.is_empty() {
        return Ok(grads);
    }
    let kernels = backward_kernels(shape);
    let k1 = kernels.dkdv;
    // the grid runs over blocks of keys: tk's
    let grid = k1.grid(per_q)?;
    let [qs, ks, vs, os, dos] = [q, k, v, &fwd.out, dout].map(|x| contiguous(x, gpu));
    let rank = TmaRank::of(&[qs.layout, ks.layout, vs.layout, dos.layout], shape);
    let spec = MaskedBackwardKernel {
        mask: &mask.mask,
        kernels,
        dtype,
        head_dim: d,
        rank,
    };
    // step 06's limits for the kernel are checked as its module is compiled, before the
    // first launch
    let function = |entry: &str| gpu.kernel(&spec, entry, k1.smem_bytes(d));
    let tq = shape.tokens as i32;
    let tk = kv.tokens as i32;

    // δ = rowsum(dO ∘ O), step 06's kernel
    // SAFETY: the output and dO were checked to hold q's shape, contiguous
    let delta = unsafe { launch_delta(gpu, &function("hopper_delta")?, os, dos, shape)? };

    let f = function("masked_dkdv")?;
    k1.check_registers(&f)?;
    // SAFETY: the tensors were checked to hold their shapes' values, contiguous, 16-bit
    let maps = unsafe {
        [
            tensor_map(qs, dtype, shape, k1.stream, rank)?,
            tensor_map(ks, dtype, kv, k1.block_rows(), rank)?,
            tensor_map(vs, dtype, kv, k1.block_rows(), rank)?,
            tensor_map(dos, dtype, shape, k1.stream, rank)?,
        ]
    };
    let n_acc = k1.dq_accum_len(shape);
    let dq_accum = stream
        .alloc_zeros::<f32>(n_acc)
        .map_err(alloc_error("the backward's f32 dq sums", n_acc as u128 * 4))?;
    let list = mask.list(false, gpu);
    let data = mask.data_ptr(gpu);
    let q_per_kv = (shape.heads / kv.heads) as i32;
    let scale = 1.0 / (d as f32).sqrt();
    let scale_log2 = shape.scale_log2();
    let layout = Layout::heads(per_q);
    let lse = fwd.lse.device_ptr(stream).0;
    {
        let (dk, _dk) = grads.dk.data.device_ptr_mut(stream);
        let (dv, _dv) = grads.dv.data.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&f);
        for map in &maps {
            launch.arg(map);
        }
        launch
            .arg(&lse)
            .arg(&delta)
            .arg(&dk)
            .arg(&dv)
            .arg(&layout)
            .arg(&dq_accum)
            .arg(&q_per_kv)
            .arg(&tq)
            .arg(&tk)
            .arg(&list)
            .arg(&data)
            .arg(&scale)
            .arg(&scale_log2);
        let config = LaunchConfig {
            grid_dim: grid,
            block_dim: (k1.threads(), 1, 1),
            shared_mem_bytes: k1.smem_bytes(d),
        };
        // SAFETY: the maps read within q, k, v and dO; each block writes dk and dv of its
        // own keys below tk (per query head, as `layout` says) and adds into the dQ sums
        // of the listed query blocks (dq_accum_len values for q's shape)
        unsafe { launch.launch(config) }.map_err(device_error("launching masked_dkdv"))?;
    }
    let convert = function("hopper_dq_convert")?;
    // SAFETY: dq_accum holds the one pass's sums for q's shape (dq_accum_len); zero_grads
    // allocated grads.dq for q's shape
    unsafe { finish_grads(gpu, &convert, &dq_accum, grads, kv, scale) }
}
// ANCHOR_END: backward

/// That the forward's output and log-sum-exp and dout are q's shape and dtype: what the
/// backward reads besides q, k and v (checked by [`check_qkv`]), before any allocation.
pub(crate) fn check_backward_inputs(
    q: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<(), AttnError> {
    let shape = q.shape;
    for (x, name) in [(&fwd.out, "the forward's output"), (dout, "dout")] {
        if x.shape != shape || x.dtype != q.dtype || x.data.len() != shape.len() {
            return Err(AttnError::ShapeMismatch {
                what: format!("{name} is {} {}, q {shape}", x.shape, x.dtype.name()),
            });
        }
    }
    let rows = shape.batch * shape.heads * shape.tokens;
    if fwd.lse.len() != rows {
        return Err(AttnError::ShapeMismatch {
            what: format!("the forward's lse holds {}; q needs {rows}", fwd.lse.len()),
        });
    }
    Ok(())
}

/// Zeroed gradients: dq of q's `shape`, dk and dv of `per_q` (k's length for every query
/// head), since the one pass writes a query head's dK and dV before groups are summed.
pub(crate) fn zero_grads(
    gpu: &Gpu,
    shape: Shape,
    per_q: Shape,
    dtype: Dtype,
) -> Result<DeviceGrads, AttnError> {
    let stream = gpu.stream();
    let zeros = |s: Shape, what: &str| {
        stream
            .alloc_zeros::<u16>(s.len())
            .map(|data| DeviceTensor {
                data,
                shape: s,
                dtype,
            })
            .map_err(alloc_error(what, s.len() as u128 * 2))
    };
    Ok(DeviceGrads {
        dq: zeros(shape, "dq")?,
        dk: zeros(per_q, "dk")?,
        dv: zeros(per_q, "dv")?,
    })
}

/// The backward's last stage: dq from the one pass's f32 sums in q's dtype (step 06's
/// conversion, which also scales), and with grouped heads each group's dk and dv summed
/// into its head of k and v (`kv` is k's shape).
///
/// # Safety
///
/// `dq_accum` holds the one pass's sums for `grads.dq`'s shape (`dq_accum_len` values),
/// and `grads.dq` holds that shape's values.
unsafe fn finish_grads(
    gpu: &Gpu,
    convert: &CudaFunction,
    dq_accum: &CudaSlice<f32>,
    mut grads: DeviceGrads,
    kv: Shape,
    scale: f32,
) -> Result<DeviceGrads, AttnError> {
    let shape = grads.dq.shape;
    {
        let (dq, _dq) = grads.dq.data.device_ptr_mut(gpu.stream());
        // SAFETY: dq_accum holds the one pass's sums for q's shape; dq was allocated for it
        // (the caller's promise)
        unsafe {
            launch_dq_convert(
                gpu,
                convert,
                dq_accum,
                dq,
                Layout::heads(shape),
                shape,
                scale,
            )?;
        }
    }
    // grouped-query attention: each group's dk and dv into its head of k and v
    if kv.heads != shape.heads {
        grads.dk = step04_backward::cuda::sum_groups(gpu, &grads.dk, kv)?;
        grads.dv = step04_backward::cuda::sum_groups(gpu, &grads.dv, kv)?;
    }
    Ok(grads)
}
