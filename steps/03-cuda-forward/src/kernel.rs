//! The kernel sources and how NVRTC compiles them: the one place that turns a `.cu` file and a
//! (dtype, head dim) pair into PTX, used by the launcher and by the register and spill check.

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use flash_core::AttnError;

use crate::Dtype;

/// What every attention kernel starts with: the types, the shared-memory swizzle and the
/// tensor-core instructions (`kernels/tensor_cores.cuh`), prepended to each kernel's source.
pub const TENSOR_CORES_CUH: &str = include_str!("../kernels/tensor_cores.cuh");
/// The forward kernel with [`TENSOR_CORES_CUH`] in front, embedded so that binaries carry it
/// wherever they run.
pub const FLASH_FORWARD_CU: &str = concat!(
    include_str!("../kernels/tensor_cores.cuh"),
    include_str!("../kernels/flash_forward.cu")
);
/// The entry point in [`FLASH_FORWARD_CU`].
pub const FLASH_FORWARD: &str = "flash_forward";
/// A kernel that keeps the GPU busy for a given number of clock cycles. Queued before a timed
/// call, it lets the host finish launching the call while the GPU is still busy, so the
/// measured time is the call's kernels alone, not the host's work to start them.
pub const SPIN_CU: &str = r#"
extern "C" __global__ void spin(long long cycles) {  // cycles: how long to stay busy
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"#;
/// The softmax of attention by hand on the GPU.
pub const CAUSAL_SOFTMAX_CU: &str = include_str!("../kernels/causal_softmax.cu");
/// The entry point in [`CAUSAL_SOFTMAX_CU`].
pub const CAUSAL_SOFTMAX: &str = "causal_softmax";
/// The head dims the forward kernel is compiled for.
pub const HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// The forward kernel's tile shape and register budget, set at compile time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardConfig {
    /// Warps per thread block.
    pub warps: u32,
    /// 16-row tiles of queries per warp: each fragment of k and v read from shared memory
    /// serves this many tiles.
    pub m_tiles: u32,
    /// Keys per step (`BLOCK_N` in the source).
    pub block_n: u32,
    /// Skip rescaling the output when no row of a warp found a new maximum.
    pub lazy_rescale: bool,
    /// Heads whose blocks are scheduled together, longest query blocks first; 0 for all heads
    /// (measured fastest on the H200, forward-tune). Fewer keeps fewer heads' keys and values
    /// in flight at once. A launch parameter, not a compile-time one.
    pub head_group: u32,
    /// Thread blocks per multiprocessor the register budget must allow (`__launch_bounds__`).
    pub min_blocks: u32,
}

impl ForwardConfig {
    /// The tile shape measured fastest for a head dim (see `forward-tune`): up to head dim 64,
    /// 4 warps of 32 rows and 128 keys a step (FlashAttention-2's tile for this head dim); at
    /// 128 the output alone takes 128 registers a thread for 32 rows, so 8 warps of 16 rows
    /// and 64 keys (more would spill).
    pub fn for_head_dim(head_dim: usize) -> Self {
        if head_dim <= 64 {
            ForwardConfig {
                warps: 4,
                m_tiles: 2,
                block_n: 128,
                lazy_rescale: false,
                head_group: 0,
                min_blocks: 1,
            }
        } else {
            ForwardConfig {
                warps: 8,
                m_tiles: 1,
                block_n: 64,
                lazy_rescale: false,
                head_group: 0,
                min_blocks: 1,
            }
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
        format!(
            "{}x{} tiles, {} warps of {} rows",
            self.block_m(),
            self.block_n,
            self.warps,
            self.m_tiles * 16
        )
    }
}

// ANCHOR: compile
/// Compiles the forward kernel for one dtype and head dim. The architecture is the device's
/// (`sm_90` on an H100 or H200); `-D` options specialise the source.
pub fn compile_forward(
    dtype: Dtype,
    head_dim: usize,
    config: ForwardConfig,
    arch: &'static str,
) -> Result<Ptx, AttnError> {
    if !HEAD_DIMS.contains(&head_dim) {
        return Err(unsupported_head_dim(head_dim));
    }
    let options = CompileOptions {
        arch: Some(arch),
        options: vec![
            format!("-DHEAD_DIM={head_dim}"),
            format!("-DIS_BF16={}", (dtype == Dtype::Bf16) as u8),
            format!("-DWARPS={}", config.warps),
            format!("-DM_TILES={}", config.m_tiles),
            format!("-DBLOCK_N={}", config.block_n),
            format!("-DLAZY_RESCALE={}", config.lazy_rescale as u8),
            format!("-DMIN_BLOCKS={}", config.min_blocks),
            "--std=c++17".into(),
        ],
        name: Some(format!(
            "flash_forward_{}_d{head_dim}_w{}x{}_n{}.cu",
            dtype.name(),
            config.warps,
            config.m_tiles,
            config.block_n
        )),
        ..Default::default()
    };
    compile_ptx_with_opts(FLASH_FORWARD_CU, options).map_err(|e| compile_error("flash_forward", e))
}
// ANCHOR_END: compile

/// Compiles the softmax kernel of attention by hand for one dtype.
pub fn compile_softmax(dtype: Dtype, arch: &'static str) -> Result<Ptx, AttnError> {
    let options = CompileOptions {
        arch: Some(arch),
        options: vec![
            format!("-DIS_BF16={}", (dtype == Dtype::Bf16) as u8),
            "--std=c++17".into(),
        ],
        name: Some(format!("causal_softmax_{}.cu", dtype.name())),
        ..Default::default()
    };
    compile_ptx_with_opts(CAUSAL_SOFTMAX_CU, options)
        .map_err(|e| compile_error("causal_softmax", e))
}

/// Compiles [`SPIN_CU`].
pub fn compile_spin(arch: &'static str) -> Result<Ptx, AttnError> {
    let options = CompileOptions {
        arch: Some(arch),
        name: Some("spin.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(SPIN_CU, options).map_err(|e| compile_error("spin", e))
}

pub(crate) fn unsupported_head_dim(head_dim: usize) -> AttnError {
    AttnError::UnsupportedHeadDim {
        head_dim,
        supported: HEAD_DIMS.map(|d| d.to_string()).join(", "),
    }
}

/// An NVRTC failure as an [`AttnError`], with the compile log.
pub fn compile_error(kernel: &str, e: CompileError) -> AttnError {
    let what = match e {
        CompileError::CompileError { log, options, .. } => {
            format!(
                "NVRTC could not compile {kernel} with {options:?}:\n{}",
                log.to_string_lossy()
            )
        }
        other => format!("NVRTC failed on {kernel}: {other:?}"),
    };
    AttnError::Device { what }
}

/// Whether NVRTC's library can be opened on this machine.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library; nothing is called through it
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}
