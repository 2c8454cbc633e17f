//! The kernel sources and their typed descriptions: each kernel this step launches is one
//! value of a type that implements [`KernelSpec`] (for the forward kernel a
//! [`ForwardKernel`]: dtype, head dim and tile shape), which says which source it is, the
//! `-D` set it is compiled with, its name and its limits; [`compile`](crate::gpu::compile)
//! turns it into PTX for the launcher and for the register and spill check.

use std::borrow::Cow;

use flash_core::AttnError;

use crate::gpu::{Dtype, KernelSpec};

/// What every attention kernel starts with: the types, the shared-memory swizzle and the
/// tensor-core instructions (`kernels/tensor_cores.cuh`), prepended to each kernel's
/// source.
pub const TENSOR_CORES_CUH: &str = include_str!("../kernels/tensor_cores.cuh");
/// The forward kernel with [`TENSOR_CORES_CUH`] in front, embedded so that binaries carry
/// it wherever they run.
pub const FLASH_FORWARD_CU: &str = concat!(
    include_str!("../kernels/tensor_cores.cuh"),
    include_str!("../kernels/flash_forward.cu")
);
/// The entry point in [`FLASH_FORWARD_CU`].
pub const FLASH_FORWARD: &str = "flash_forward";
/// The softmax of attention by hand on the GPU.
pub const CAUSAL_SOFTMAX_CU: &str = include_str!("../kernels/causal_softmax.cu");
/// The entry point in [`CAUSAL_SOFTMAX_CU`].
pub const CAUSAL_SOFTMAX: &str = "causal_softmax";
/// The head dims the forward kernel is compiled for.
pub const HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// The forward kernel's tile shape and register budget, set at compile time: the sizes that
/// may change without changing what the kernel computes (other sizes sum in another order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardConfig {
    /// Warps per thread block (`WARPS` in the source).
    pub warps: u32,
    /// 16-row tiles of queries per warp (`M_TILES`): each fragment of k and v read from
    /// shared memory serves this many tiles.
    pub m_tiles: u32,
    /// Keys per block, copied into shared memory together (`BLOCK_N`).
    pub block_n: u32,
    /// Keys per step of the products and the softmax within a block of `block_n` (`SUB_N`),
    /// a multiple of 16 that divides `block_n`; 0 for all of them at once. Fewer scores in
    /// registers at a time, with the copies and barriers of `block_n` keys.
    pub sub_n: u32,
    /// Heads whose blocks are scheduled together, longest query blocks first; 0 for all
    /// heads (measured fastest on the H200). Fewer keeps fewer heads' keys and values in
    /// flight at once. A launch parameter, not a compile-time one.
    pub head_group: u32,
    /// Thread blocks per multiprocessor the register budget must allow (`MIN_BLOCKS`, in
    /// `__launch_bounds__`).
    pub min_blocks: u32,
}

impl ForwardConfig {
    /// The tile shape measured fastest for a head dim (the tuning log,
    /// `lab/logs/03-cuda-forward/README.md`): up to head dim 64, 4 warps of 32 rows and 128
    /// keys a step (FlashAttention-2's tile for this head dim). At 128 FlashAttention-2's
    /// tile, 4 warps of 32 rows and 64 keys a block: the output alone takes 128 registers a
    /// thread, so the scores of 64 keys at once would spill, and the block's keys go
    /// through the products and the softmax 32 at a time (run 14: 207.0, 291.7, 308.1 and
    /// 286.2 TFLOP/s at 1k, 4k, 8k and 16k, against 182.9, 247.8, 260.5 and 265.6 for the 8
    /// warps of 16 rows before it). At that head dim the kernel holds one ldmatrix offset
    /// register for each operand (`Offsets<HEAD_DIM == 128>` in `flash_forward.cu`; run 16:
    /// 229.5,
    /// 338.8, 358.5 and 352.0 against 226.2, 328.8, 349.0 and 335.3).
    pub fn for_head_dim(head_dim: usize) -> Self {
        if head_dim <= 64 {
            ForwardConfig {
                warps: 4,
                m_tiles: 2,
                block_n: 128,
                sub_n: 0,
                head_group: 0,
                min_blocks: 1,
            }
        } else {
            ForwardConfig {
                warps: 4,
                m_tiles: 2,
                block_n: 64,
                sub_n: 32,
                head_group: 0,
                min_blocks: 1,
            }
        }
    }

    /// A short name for tables: `w<warps>x<m-tiles> n<keys per block>` and what else is
    /// set.
    pub fn label(&self) -> String {
        let mut s = format!("w{}x{} n{}", self.warps, self.m_tiles, self.block_n);
        if self.sub_n != 0 && self.sub_n != self.block_n {
            s += &format!(" sub{}", self.sub_n);
        }
        if self.head_group != 0 {
            s += &format!(" g{}", self.head_group);
        }
        if self.min_blocks != 1 {
            s += &format!(" b{}", self.min_blocks);
        }
        s
    }

    /// Keys per step of the products and the softmax (`SUB_N` in the source).
    pub fn keys_per_step(&self) -> u32 {
        match self.sub_n {
            0 => self.block_n,
            n => n,
        }
    }

    /// Whether the kernel can be compiled with this shape, or what is wrong with it.
    pub fn check(&self) -> Result<(), AttnError> {
        let n = self.keys_per_step();
        let ok = matches!(self.warps, 1..=16)
            && matches!(self.m_tiles, 1..=4)
            && self.block_n.is_multiple_of(16)
            && n.is_multiple_of(16)
            && (16..=self.block_n).contains(&n)
            && self.block_n.is_multiple_of(n)
            && matches!(self.min_blocks, 1..=8);
        if ok {
            Ok(())
        } else {
            Err(AttnError::Unsupported {
                what: format!(
                    "{self:?}: the forward kernel takes 1-16 warps of 1-4 tiles of 16 rows, a multiple of 16 keys a block, steps of a multiple of 16 keys that divide it, 1-8 blocks a multiprocessor"
                ),
            })
        }
    }

    /// Rows of queries one thread block owns (`BLOCK_M` in the source).
    pub fn block_m(&self) -> usize {
        (self.warps * self.m_tiles) as usize * 16
    }

    pub fn threads(&self) -> u32 {
        self.warps * 32
    }

    /// Shared memory the kernel needs: a tile of q and two stages each of k and v.
    pub fn smem_bytes(&self, head_dim: usize) -> u32 {
        ((self.block_m() + 4 * self.block_n as usize) * head_dim * 2) as u32
    }

    /// How many heads to schedule together: `head_group`, or all of them when it is 0.
    pub fn head_group(&self, heads: usize) -> u32 {
        match self.head_group {
            0 => heads.max(1) as u32,
            g => g.min(heads.max(1) as u32),
        }
    }

    pub fn describe(&self) -> String {
        let mut s = format!(
            "{}x{} tiles, {} warps of {} rows",
            self.block_m(),
            self.block_n,
            self.warps,
            self.m_tiles * 16
        );
        if self.keys_per_step() != self.block_n {
            s += &format!(", {} keys a step", self.keys_per_step());
        }
        s
    }
}

/// One build of the forward kernel: everything its `-D` options say. It alone turns a
/// dtype, a head dim and a tile shape into those options ([`KernelSpec::defines`]), a
/// module name and the checks they must pass; `kernels/flash_forward.cu` holds no defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardKernel {
    pub dtype: Dtype,
    pub head_dim: usize,
    pub config: ForwardConfig,
    // [step 07]
    /// Each query sees the keys up to its own position (`CAUSAL`); without the mask, every
    /// key.
    pub causal: bool,
    // [/step 07]
}

impl ForwardKernel {
    /// The causal kernel for a dtype, head dim and tile shape.
    pub fn new(dtype: Dtype, head_dim: usize, config: ForwardConfig) -> Self {
        ForwardKernel {
            dtype,
            head_dim,
            config,
            causal: true, // [step 07]
        }
    }
}

// ANCHOR: compile
impl KernelSpec for ForwardKernel {
    /// The module's name: the kernel, the dtype, the head dim and the tile shape.
    fn name(&self) -> String {
        let (dtype, head_dim) = (self.dtype.name(), self.head_dim);
        let tile = self.config.label().replace(' ', "_");
        // [step 07]
        if !self.causal {
            return format!("{FLASH_FORWARD}_full_{dtype}_d{head_dim}_{tile}.cu");
        }
        // [/step 07]
        format!("{FLASH_FORWARD}_{dtype}_d{head_dim}_{tile}.cu")
    }

    fn source(&self) -> Cow<'_, str> {
        FLASH_FORWARD_CU.into()
    }

    /// The `-D` options that specialise `kernels/flash_forward.cu`, one for each of its
    /// parameters.
    fn defines(&self) -> Vec<String> {
        let c = self.config;
        vec![
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8),
            format!("-DWARPS={}", c.warps),
            format!("-DM_TILES={}", c.m_tiles),
            format!("-DBLOCK_N={}", c.block_n),
            format!("-DSUB_N={}", c.keys_per_step()),
            format!("-DMIN_BLOCKS={}", c.min_blocks),
            format!("-DCAUSAL={}", self.causal as u8), // [step 07]
        ]
    }

    /// A head dim the kernel is compiled for, and a tile shape it can be compiled with.
    fn check(&self) -> Result<(), AttnError> {
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(unsupported_head_dim(self.head_dim));
        }
        self.config.check()
    }
}
// ANCHOR_END: compile

/// The softmax of attention by hand on the GPU, for one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SoftmaxKernel {
    pub dtype: Dtype,
}

impl KernelSpec for SoftmaxKernel {
    fn name(&self) -> String {
        format!("causal_softmax_{}.cu", self.dtype.name())
    }

    fn source(&self) -> Cow<'_, str> {
        CAUSAL_SOFTMAX_CU.into()
    }

    fn defines(&self) -> Vec<String> {
        vec![format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8)]
    }
}

/// A kernel file compiled after [`TENSOR_CORES_CUH`] whose only parameters are the dtype and
/// the head dim (`IS_BF16`, `HEAD_DIM`): the ring's merge (step 07), the decoder's fill and
/// append (step 08).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimpleKernel {
    /// The file's stem, which the module's name starts with.
    pub stem: &'static str,
    /// The file, without the header.
    pub source: &'static str,
    pub dtype: Dtype,
    pub head_dim: usize,
}

impl KernelSpec for SimpleKernel {
    fn name(&self) -> String {
        format!("{}_{}_d{}.cu", self.stem, self.dtype.name(), self.head_dim)
    }

    fn source(&self) -> Cow<'_, str> {
        [TENSOR_CORES_CUH, self.source].concat().into()
    }

    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8),
        ]
    }

    fn check(&self) -> Result<(), AttnError> {
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(unsupported_head_dim(self.head_dim));
        }
        Ok(())
    }
}

/// The error for a head dim the kernels lack, naming the ones they take.
pub fn unsupported_head_dim(head_dim: usize) -> AttnError {
    AttnError::UnsupportedHeadDim {
        head_dim,
        supported: HEAD_DIMS.map(|d| d.to_string()).join(", "),
    }
}
