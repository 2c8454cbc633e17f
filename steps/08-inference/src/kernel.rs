//! The decoding kernels' sources and how NVRTC compiles them: [`DecodeKernel`] alone turns
//! a dtype, a head dim, the query rows of a kv head and a page size into the `-D` options
//! of `kernels/decode.cu`, which holds no defaults of its own.

use std::borrow::Cow;

use flash_core::AttnError;
use step03_cuda_forward::gpu::{Dtype, FixedKernel, KernelSpec};
use step03_cuda_forward::kernel::{
    HEAD_DIMS, SimpleKernel, TENSOR_CORES_CUH, unsupported_head_dim,
};

/// The decoding kernel, with step 03's `tensor_cores.cuh` in front.
pub const DECODE_CU: &str = include_str!("../kernels/decode.cu");
/// The entry point of [`DECODE_CU`]: each block one split, the last one merging them.
pub const DECODE: &str = "flash_decode";
/// The kernel that only reads: the physical limit decoding is compared with.
pub const READ_CU: &str = include_str!("../kernels/read.cu");
pub const READ: &str = "read_bytes";
/// The benchmark's fill of a cache on the GPU.
pub const FILL_CU: &str = include_str!("../kernels/fill.cu");
pub const FILL: &str = "fill_cache";
/// A new token's keys and values into a paged cache, as the model generates, and a step's
/// embedding of its token.
pub const APPEND_CU: &str = include_str!("../kernels/append.cu");
pub const APPEND: &str = "append_kv";
pub const EMBED: &str = "embed_token";

/// Bytes of keys a warp copies per step, and as many of values: 16 keys at head dim 128, 32
/// at 64, 64 at 32 ([`DecodeKernel::keys`]).
pub const STEP_BYTES: usize = 4 << 10;

/// Bytes of keys and values a multiprocessor's warps take per step to stream at the
/// memory's speed ([`DecodeKernel::streaming_blocks`]).
pub const STREAM_BYTES: usize = 32 << 10;

/// Keys that lie one after another in memory, whatever the layout: a page of a paged cache
/// holds whole groups of them, so a warp looks a page up once per group.
pub const KEY_GROUP: usize = 16;

/// Query rows of one kv head a block computes at most: two tiles of 16 (`g · q_rows ≤ 32`,
/// Llama 3 70B's 8 query heads a kv head with 4 rows each, for one).
pub const MAX_ROWS: usize = 32;

// ANCHOR: decode_kernel
/// One build of `kernels/decode.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeKernel {
    pub dtype: Dtype,
    pub head_dim: usize,
    /// Tiles of 16 query rows (`ROW_TILES`): 1 for up to 16 rows of a kv head, 2 for 32.
    pub row_tiles: usize,
    /// 0 for a contiguous cache, else tokens per page (`PAGE_SIZE`).
    pub page_size: usize,
}

impl DecodeKernel {
    /// Warps per block (`WARPS`): they take turns over the split's keys.
    pub const WARPS: usize = 4;

    /// The build for `rows` query rows of a kv head (`g · q_rows`).
    pub fn new(
        dtype: Dtype,
        head_dim: usize,
        rows: usize,
        page_size: usize,
    ) -> Result<DecodeKernel, AttnError> {
        if rows == 0 || rows > MAX_ROWS {
            return Err(AttnError::Unsupported {
                what: format!(
                    "{rows} query rows share a kv head (query heads per kv head × q rows); \
                     the decoding kernel computes 1 to {MAX_ROWS} of them together"
                ),
            });
        }
        let kernel = DecodeKernel {
            dtype,
            head_dim,
            row_tiles: rows.div_ceil(16),
            page_size,
        };
        kernel.check()?;
        Ok(kernel)
    }

    /// Keys a warp computes per step (`KEYS`): [`STEP_BYTES`] of keys, so that every head
    /// dim moves the same bytes a step (a multiple of 16 keys, the `m16n8k16` product's).
    pub fn keys(&self) -> usize {
        STEP_BYTES / (self.head_dim * self.dtype.size())
    }

    /// Steps a warp keeps in flight (`STAGES`): its copies run two steps (8 KB of keys
    /// and 8 KB of values) ahead of its products, and the block's shared memory, 96 KB of
    /// stages, leaves room for two blocks a multiprocessor.
    pub fn stages(&self) -> usize {
        3
    }

    /// Blocks a multiprocessor needs to keep the memory streaming: a multiprocessor reads
    /// at the memory's speed once its warps take [`STREAM_BYTES`] of keys and values a
    /// step (chapter 8's sweep of split counts on the H200, at head dim 128; the sweep of
    /// the build on an H100 at head dim 64): one block (4 warps × 4 KB, for k and for v)
    /// at every head dim.
    pub fn streaming_blocks(&self) -> usize {
        let step_bytes = Self::WARPS * STEP_BYTES * 2;
        STREAM_BYTES.div_ceil(step_bytes)
    }

    /// Keys a block covers per step, all warps together: a split is a multiple of it.
    pub fn block_keys(&self) -> usize {
        Self::WARPS * self.keys()
    }

    pub fn threads(&self) -> u32 {
        (Self::WARPS * 32) as u32
    }

    /// Shared memory: q's tile, and each warp's stages of keys and values; the merge of the
    /// warps at the end reuses the stages.
    pub fn smem_bytes(&self) -> u32 {
        let rows = 16 * self.row_tiles;
        let stages = 2 * Self::WARPS * self.stages() * self.keys();
        ((rows + stages) * self.head_dim * 2) as u32
    }
}

impl KernelSpec for DecodeKernel {
    /// The module's name: the kernel and everything its options say.
    fn name(&self) -> String {
        let layout = match self.page_size {
            0 => "contiguous".to_string(),
            p => format!("paged{p}"),
        };
        format!(
            "{DECODE}_{}_d{}_r{}_{layout}.cu",
            self.dtype.name(),
            self.head_dim,
            16 * self.row_tiles
        )
    }

    /// Step 03's `tensor_cores.cuh`, then `kernels/decode.cu`.
    fn source(&self) -> Cow<'_, str> {
        [TENSOR_CORES_CUH, DECODE_CU].concat().into()
    }

    /// The `-D` options that specialise `kernels/decode.cu`, one for each parameter.
    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8),
            format!("-DROW_TILES={}", self.row_tiles),
            format!("-DWARPS={}", Self::WARPS),
            format!("-DKEYS={}", self.keys()),
            format!("-DSTAGES={}", self.stages()),
            format!("-DKEY_GROUP={KEY_GROUP}"),
            format!("-DPAGE_SIZE={}", self.page_size),
        ]
    }

    /// Whether this build can be compiled, or what is wrong with it.
    fn check(&self) -> Result<(), AttnError> {
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(unsupported_head_dim(self.head_dim));
        }
        step03_cuda_forward::gpu::half_dtype(self.dtype)?;
        check_page_size(self.page_size)
    }
}
// ANCHOR_END: decode_kernel

/// Page sizes the paged kernel takes: 0 (contiguous), or a multiple of [`KEY_GROUP`], so
/// that each group of 16 keys a warp copies lies in one page.
pub fn check_page_size(page_size: usize) -> Result<(), AttnError> {
    if page_size.is_multiple_of(KEY_GROUP) && page_size <= 1 << 20 {
        return Ok(());
    }
    Err(AttnError::Unsupported {
        what: format!(
            "pages of {page_size} tokens: the paged kernel takes pages of a multiple of \
             {KEY_GROUP} tokens up to 2^20 ({KEY_GROUP}, {}, {}, ...), so that each group of \
             {KEY_GROUP} keys a warp copies lies in one page",
            2 * KEY_GROUP,
            4 * KEY_GROUP
        ),
    })
}

/// `kernels/read.cu`, which has no parameters.
pub const READ_KERNEL: FixedKernel = FixedKernel {
    name: "read.cu",
    source: READ_CU,
};

/// `kernels/fill.cu` for one dtype and head dim.
pub fn fill_kernel(dtype: Dtype, head_dim: usize) -> SimpleKernel {
    SimpleKernel {
        stem: "fill",
        source: FILL_CU,
        dtype,
        head_dim,
    }
}

/// `kernels/append.cu` for one dtype and head dim.
pub fn append_kernel(dtype: Dtype, head_dim: usize) -> SimpleKernel {
    SimpleKernel {
        stem: "append",
        source: APPEND_CU,
        dtype,
        head_dim,
    }
}
