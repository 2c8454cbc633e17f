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
    /// Keys per step of the products and the softmax within a block of `block_n` (`SUB_N`),
    /// a multiple of 16 that divides `block_n`; 0 for all of them at once. Fewer scores in
    /// registers at a time, with the copies and barriers of `block_n` keys.
    pub sub_n: u32,
    /// Skip rescaling the output when no row of a warp found a new maximum.
    pub lazy_rescale: bool,
    /// Heads whose blocks are scheduled together, longest query blocks first; 0 for all heads
    /// (measured fastest on the H200, forward-tune). Fewer keeps fewer heads' keys and values
    /// in flight at once. A launch parameter, not a compile-time one.
    pub head_group: u32,
    /// Thread blocks per multiprocessor the register budget must allow (`__launch_bounds__`).
    pub min_blocks: u32,
    /// Read each warp's q fragments once and hold them in registers for the whole loop, rather
    /// than reading them from shared memory again for every block of keys.
    pub hold_q: bool,
    /// Hold one ldmatrix offset a lane for each operand and step it 16 columns at a time with
    /// an XOR (`xor_step`), rather than one register for each 16 columns: up to 13 registers
    /// fewer at head dim 128.
    pub xor_offsets: bool,
}

impl ForwardConfig {
    /// The tile shape measured fastest for a head dim (see `forward-tune` and the tuning log):
    /// up to head dim 64, 4 warps of 32 rows and 128 keys a step (FlashAttention-2's tile for
    /// this head dim). At 128 FlashAttention-2's tile, 4 warps of 32 rows and 64 keys a block:
    /// the output alone takes 128 registers a thread, so the scores of 64 keys at once would
    /// spill, and the block's keys go through the products and the softmax 32 at a time (run
    /// 14: 207.0, 291.7, 308.1 and 286.2 TFLOP/s at 1k, 4k, 8k and 16k, against 182.9, 247.8,
    /// 260.5 and 265.6 for the 8 warps of 16 rows before it), with one offset register for
    /// each operand (`xor_offsets`, run 16: 229.5, 338.8, 358.5 and 352.0 against 226.2, 328.8,
    /// 349.0 and 335.3).
    pub fn for_head_dim(head_dim: usize) -> Self {
        if head_dim <= 64 {
            ForwardConfig {
                warps: 4,
                m_tiles: 2,
                block_n: 128,
                sub_n: 0,
                lazy_rescale: false,
                head_group: 0,
                min_blocks: 1,
                hold_q: false,
                xor_offsets: false,
            }
        } else {
            ForwardConfig {
                warps: 4,
                m_tiles: 2,
                block_n: 64,
                sub_n: 32,
                lazy_rescale: false,
                head_group: 0,
                min_blocks: 1,
                hold_q: false,
                xor_offsets: true,
            }
        }
    }

    /// The default for a head dim and the tile shapes `forward-tune` compares it with, the
    /// default first. `kernel-check` compiles every one (a spill fails it only in a default).
    pub fn candidates(head_dim: usize) -> Vec<ForwardConfig> {
        let base = ForwardConfig::for_head_dim(head_dim);
        if head_dim <= 64 {
            vec![
                base,
                ForwardConfig {
                    head_group: 1,
                    ..base
                },
                ForwardConfig {
                    head_group: 16,
                    ..base
                },
                ForwardConfig {
                    block_n: 64,
                    ..base
                },
                ForwardConfig { warps: 8, ..base },
                // one offset register per operand (xor_step)
                ForwardConfig {
                    xor_offsets: true,
                    ..base
                },
            ]
        } else {
            let xor = base;
            // the shapes measured before xor_offsets, without it and with every key of a block
            // at once unless said otherwise
            let base = ForwardConfig {
                xor_offsets: false,
                ..xor
            };
            let w8 = ForwardConfig {
                warps: 8,
                m_tiles: 1,
                sub_n: 0,
                ..base
            };
            let w4 = ForwardConfig {
                warps: 4,
                m_tiles: 2,
                sub_n: 0,
                ..base
            };
            let mut all = vec![xor, base];
            for c in [
                // the default before run 14
                ForwardConfig { block_n: 64, ..w8 },
                ForwardConfig { block_n: 128, ..w8 },
                ForwardConfig {
                    block_n: 64,
                    hold_q: true,
                    ..w8
                },
                ForwardConfig {
                    block_n: 128,
                    hold_q: true,
                    ..w8
                },
                ForwardConfig {
                    block_n: 64,
                    lazy_rescale: true,
                    ..w8
                },
                // FlashAttention-2's 128 x 64 tile: 32 rows a warp, the output alone 128
                // registers a thread, so the scores of 64 keys at once spill; 32 or 16 at a time
                // do not
                ForwardConfig { block_n: 32, ..w4 },
                ForwardConfig {
                    block_n: 64,
                    sub_n: 32,
                    ..w4
                },
                ForwardConfig {
                    block_n: 64,
                    sub_n: 16,
                    ..w4
                },
                ForwardConfig {
                    block_n: 64,
                    sub_n: 16,
                    lazy_rescale: true,
                    ..w4
                },
                // 64 x 64 tiles, two blocks a multiprocessor (FlashAttention-2's causal tile on
                // sm86 and sm89)
                ForwardConfig {
                    warps: 4,
                    m_tiles: 1,
                    block_n: 64,
                    min_blocks: 2,
                    ..w4
                },
                // at head dim 128 a head's keys and values are 8 MB at 16k tokens: fewer heads
                // scheduled together keep fewer of them in flight, for L2's 60 MB
                ForwardConfig {
                    head_group: 4,
                    ..base
                },
                ForwardConfig {
                    head_group: 12,
                    ..base
                },
                ForwardConfig {
                    block_n: 128,
                    hold_q: true,
                    head_group: 4,
                    ..w8
                },
                ForwardConfig {
                    block_n: 128,
                    hold_q: true,
                    head_group: 12,
                    ..w8
                },
                // the default's tile with all 64 keys at once (FlashAttention-2's loop: one
                // rescale of the output a block, whatever ptxas spills), lazily rescaled, and
                // in other head groups
                ForwardConfig { block_n: 64, ..w4 },
                ForwardConfig {
                    lazy_rescale: true,
                    ..base
                },
                ForwardConfig {
                    head_group: 8,
                    ..base
                },
                ForwardConfig {
                    head_group: 2,
                    ..base
                },
                ForwardConfig {
                    block_n: 64,
                    head_group: 2,
                    ..w4
                },
                ForwardConfig {
                    block_n: 64,
                    head_group: 8,
                    ..w4
                },
                ForwardConfig {
                    block_n: 64,
                    head_group: 12,
                    ..w4
                },
                // one offset register per operand (xor_step): 13 registers fewer, so all 64
                // keys at once spill 12 bytes (the loop's bound and the head's offset, outside
                // the products) where they spilled 60
                ForwardConfig {
                    block_n: 64,
                    xor_offsets: true,
                    ..w4
                },
                ForwardConfig {
                    block_n: 64,
                    head_group: 2,
                    xor_offsets: true,
                    ..w4
                },
                ForwardConfig {
                    block_n: 64,
                    head_group: 8,
                    xor_offsets: true,
                    ..w4
                },
                ForwardConfig {
                    head_group: 8,
                    ..xor
                },
            ] {
                if !all.contains(&c) {
                    all.push(c);
                }
            }
            all
        }
    }

    /// A short name for tables: `w<warps>x<m-tiles> n<keys per step>` and what is set.
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
        if self.lazy_rescale {
            s += " lazy";
        }
        if self.hold_q {
            s += " holdq";
        }
        if self.xor_offsets {
            s += " xor";
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
    config.check()?;
    compile_ptx_with_opts(
        FLASH_FORWARD_CU,
        forward_options(dtype, head_dim, config, arch),
    )
    .map_err(|e| compile_error("flash_forward", e))
}
// ANCHOR_END: compile

/// The `-D` options that specialise the forward kernel's source.
fn forward_options(
    dtype: Dtype,
    head_dim: usize,
    config: ForwardConfig,
    arch: &'static str,
) -> CompileOptions {
    CompileOptions {
        arch: Some(arch),
        options: vec![
            format!("-DHEAD_DIM={head_dim}"),
            format!("-DIS_BF16={}", (dtype == Dtype::Bf16) as u8),
            format!("-DWARPS={}", config.warps),
            format!("-DM_TILES={}", config.m_tiles),
            format!("-DBLOCK_N={}", config.block_n),
            format!("-DSUB_N={}", config.keys_per_step()),
            format!("-DLAZY_RESCALE={}", config.lazy_rescale as u8),
            format!("-DMIN_BLOCKS={}", config.min_blocks),
            format!("-DHOLD_Q={}", config.hold_q as u8),
            format!("-DXOR_OFFSETS={}", config.xor_offsets as u8),
            "--std=c++17".into(),
        ],
        name: Some(format!(
            "flash_forward_{}_d{head_dim}_{}.cu",
            dtype.name(),
            config.label().replace(' ', "_")
        )),
        ..Default::default()
    }
}

// [step 07]
/// [`compile_forward`] with the causal mask off (`-DCAUSAL=0`): every query sees every key.
/// Step 07's ring computes blocks of keys that lie wholly before their queries so.
pub fn compile_forward_full(
    dtype: Dtype,
    head_dim: usize,
    config: ForwardConfig,
    arch: &'static str,
) -> Result<Ptx, AttnError> {
    if !HEAD_DIMS.contains(&head_dim) {
        return Err(unsupported_head_dim(head_dim));
    }
    config.check()?;
    let mut options = forward_options(dtype, head_dim, config, arch);
    options.options.push("-DCAUSAL=0".into());
    options.name = options
        .name
        .map(|n| n.replace("flash_forward", "flash_forward_full"));
    compile_ptx_with_opts(FLASH_FORWARD_CU, options)
        .map_err(|e| compile_error("flash_forward (full)", e))
}
// [/step 07]

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

/// The error for a head dim the kernels lack, naming the ones they take.
pub fn unsupported_head_dim(head_dim: usize) -> AttnError {
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

/// An error unless NVRTC can be loaded: a compile without it would panic inside cudarc.
pub fn require_nvrtc() -> Result<(), AttnError> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(missing_nvrtc())
    }
}

/// The error of [`require_nvrtc`] where NVRTC is missing, saying where to get it (a test
/// checks it on machines that have NVRTC too).
pub fn missing_nvrtc() -> AttnError {
    AttnError::Device {
        what: "no NVRTC (libnvrtc.so) found: install the CUDA toolkit (or the nvidia-cuda-nvrtc wheel) and put its lib folder on LD_LIBRARY_PATH".into(),
    }
}
