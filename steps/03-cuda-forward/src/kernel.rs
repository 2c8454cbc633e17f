//! The kernel sources and their typed descriptions: each kernel this step launches is one
//! value of a type that implements [`KernelSpec`] (for the forward kernel a
//! [`ForwardKernel`]: dtype and head dim), which says which source it is, the
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

// The tile `kernels/flash_forward.cu` fixes (its `WARPS`, `M_TILES`, `BLOCK_N` and `SUB_N`),
// as its launch and rungs 3 and 4 of the ladder need it; a test below reads them in the
// source.

/// Warps per thread block of the forward kernel (`WARPS`).
pub const WARPS: u32 = 4;
/// 16-row tiles of queries per warp (`M_TILES`): each fragment of k and v read from shared
/// memory serves this many tiles.
pub const M_TILES: u32 = 2;
/// Queries per thread block (`BLOCK_M`): [`WARPS`] warps of [`M_TILES`] tiles of 16 rows.
pub const BLOCK_M: usize = (WARPS * M_TILES * 16) as usize;
/// Threads per thread block.
pub const THREADS: u32 = WARPS * 32;

/// Keys per block at a head dim, copied into shared memory together (`BLOCK_N`). The tile
/// measured fastest (the tuning log, `lab/logs/03-cuda-forward/README.md`): up to head dim
/// 64, 128 keys a block (FlashAttention-2's tile for this head dim). At 128
/// FlashAttention-2's tile, 64 keys a block: the output alone takes 128 registers a thread,
/// so the scores of 64 keys at once would spill, and the block's keys go through the
/// products and the softmax 32 at a time ([`sub_n`]; run 14: 207.0, 291.7, 308.1 and 286.2
/// TFLOP/s at 1k, 4k, 8k and 16k, against 182.9, 247.8, 260.5 and 265.6 for the 8 warps of
/// 16 rows before it). At that head dim the kernel holds one ldmatrix offset register for
/// each operand (`Offsets<HEAD_DIM == 128>` in `flash_forward.cu`; run 16: 229.5, 338.8,
/// 358.5 and 352.0 against 226.2, 328.8, 349.0 and 335.3).
pub fn block_n(head_dim: usize) -> usize {
    if head_dim <= 64 { 128 } else { 64 }
}

/// Keys per step of the products and the softmax within a block of [`block_n`] keys
/// (`SUB_N`): all of them up to head dim 64, 32 at 128.
pub fn sub_n(head_dim: usize) -> usize {
    if head_dim <= 64 {
        block_n(head_dim)
    } else {
        32
    }
}

/// Shared memory the kernel needs at a head dim: a tile of q and two stages each of k and
/// v.
pub fn smem_bytes(head_dim: usize) -> u32 {
    ((BLOCK_M + 4 * block_n(head_dim)) * head_dim * 2) as u32
}

/// The tile in words, for the method's description.
pub fn describe(head_dim: usize) -> String {
    let (block_n, sub_n) = (block_n(head_dim), sub_n(head_dim));
    let mut s = format!(
        "{BLOCK_M}x{block_n} tiles, {WARPS} warps of {} rows",
        M_TILES * 16
    );
    if sub_n != block_n {
        s += &format!(", {sub_n} keys a step");
    }
    s
}

/// How a build of the forward kernel is launched: the threads and queries of a thread block
/// and the dynamic shared memory it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardLaunch {
    pub threads: u32,
    /// Queries per thread block: the grid has one block per this many of each head.
    pub block_m: usize,
    pub smem_bytes: u32,
}

impl ForwardLaunch {
    /// The launch of `kernels/flash_forward.cu` at a head dim.
    pub fn for_head_dim(head_dim: usize) -> Self {
        ForwardLaunch {
            threads: THREADS,
            block_m: BLOCK_M,
            smem_bytes: smem_bytes(head_dim),
        }
    }
}

/// One build of the forward kernel: everything its `-D` options say. It alone turns a
/// dtype and a head dim into those options ([`KernelSpec::defines`]), a module name and the
/// checks they must pass; `kernels/flash_forward.cu` holds no defaults (its tile is
/// constants of the head dim).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardKernel {
    pub dtype: Dtype,
    pub head_dim: usize,
    // [step 07]
    /// Each query sees the keys up to its own position (`CAUSAL`); without the mask, every
    /// key.
    pub causal: bool,
    // [/step 07]
}

impl ForwardKernel {
    /// The causal kernel for a dtype and head dim.
    pub fn new(dtype: Dtype, head_dim: usize) -> Self {
        ForwardKernel {
            dtype,
            head_dim,
            causal: true, // [step 07]
        }
    }
}

// ANCHOR: compile
impl KernelSpec for ForwardKernel {
    /// The module's name: the kernel, the dtype and the head dim.
    fn name(&self) -> String {
        let (dtype, head_dim) = (self.dtype.name(), self.head_dim);
        // [step 07]
        if !self.causal {
            return format!("{FLASH_FORWARD}_full_{dtype}_d{head_dim}.cu");
        }
        // [/step 07]
        format!("{FLASH_FORWARD}_{dtype}_d{head_dim}.cu")
    }

    fn source(&self) -> Cow<'_, str> {
        FLASH_FORWARD_CU.into()
    }

    /// The `-D` options that specialise `kernels/flash_forward.cu`, one for each of its
    /// parameters.
    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8),
            format!("-DCAUSAL={}", self.causal as u8), // [step 07]
        ]
    }

    /// A head dim the kernel is compiled for.
    fn check(&self) -> Result<(), AttnError> {
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(unsupported_head_dim(self.head_dim));
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What `#define NAME ...` gives NAME in `source`, without its comment.
    fn defined<'a>(source: &'a str, name: &str) -> Vec<&'a str> {
        let start = format!("#define {name} ");
        source
            .lines()
            .filter_map(|l| l.strip_prefix(&start))
            .map(|v| v.split("//").next().unwrap_or(v).trim())
            .collect()
    }

    /// The sizes the launch uses are the ones `flash_forward.cu` fixes: its lines for the
    /// tile, as the constants and functions above write them.
    #[test]
    fn the_launch_uses_the_tile_the_kernel_fixes() {
        let (small, large) = (HEAD_DIMS[0], HEAD_DIMS[HEAD_DIMS.len() - 1]);
        assert_eq!(block_n(small), block_n(64));
        assert_eq!(sub_n(small), block_n(small));
        let tile = [
            ("WARPS", WARPS.to_string()),
            ("M_TILES", M_TILES.to_string()),
            (
                "BLOCK_N",
                format!("(HEAD_DIM <= 64 ? {} : {})", block_n(64), block_n(large)),
            ),
            (
                "SUB_N",
                format!("(HEAD_DIM <= 64 ? BLOCK_N : {})", sub_n(large)),
            ),
            ("BLOCK_M", "(WARPS * WARP_ROWS)".into()),
            ("WARP_ROWS", "(M_TILES * 16)".into()),
            ("THREADS", "(WARPS * 32)".into()),
        ];
        for (name, value) in tile {
            assert_eq!(
                defined(FLASH_FORWARD_CU, name),
                [value.as_str()],
                "kernels/flash_forward.cu's {name}"
            );
        }
    }
}
