//! The forward kernel's host side: checks, the tensor maps TMA reads through, the launch.

use cudarc::driver::sys::{
    CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle, cuTensorMapEncodeTiled,
};
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, Ptx, compile_ptx_with_opts};
use flash_core::{AttnError, Shape};
use step03_cuda_forward::kernel::{compile_error, require_nvrtc};
use step03_cuda_forward::{
    DeviceAttention, DeviceTensor, Dtype, Gpu, check_device, device_error, grid_blocks,
};

use crate::layout::{Layout, Strided, TmaRank};

/// What step 06's kernels share: types, descriptors, mbarriers, TMA copies, the products.
pub const HOPPER_CUH: &str = include_str!("../kernels/hopper.cuh");
/// The forward kernel's source (after [`HOPPER_CUH`]).
pub const HOPPER_FORWARD_CU: &str = include_str!("../kernels/hopper_forward.cu");
/// Its entry point.
pub const HOPPER_FORWARD: &str = "hopper_forward";
/// The head dims it is compiled for: a row of 64 is one 128-byte swizzle row, a row of 128 two
/// halves of one each.
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// Keys per step (`BLOCK_N`).
pub const BLOCK_N: usize = 128;

/// The thread block's shape, set at compile time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HopperConfig {
    /// Consumer warpgroups per thread block (`WGS`), 64 query rows each.
    pub warpgroups: usize,
    /// Buffers of keys and values in flight (`STAGES`).
    pub stages: usize,
    /// Thread blocks each multiprocessor must fit (`MIN_BLOCKS`, the register budget): with
    /// one warpgroup, several blocks share a multiprocessor and take turns at its tensor cores.
    pub min_blocks: usize,
    /// The next block's scores and this block's P·v issued together, the softmax running
    /// while P·v is on the tensor cores (`OVERLAP`).
    pub overlap: bool,
    /// With `overlap`, the output multiplied by the last softmax's correction while the next
    /// block's scores are on the tensor cores, just before P·v is issued (FlashAttention-3's
    /// order, `EARLY_RESCALE`), rather than after P·v, when the tensor cores wait for it.
    pub early_rescale: bool,
    /// The keys and the values of a buffer each with their own mbarriers, the keys brought
    /// one block ahead of the values (`KV_BARRIERS`): a block's keys are free once its scores
    /// are computed, so the next keys come in while P·v still reads the values.
    pub kv_barriers: bool,
    /// The producer a whole warpgroup that hands most of its registers to the consumers
    /// (`setmaxnreg`, `PRODUCER_WG`), rather than one warp; one block a multiprocessor only.
    pub producer_warpgroup: bool,
    /// The consumer warpgroups take turns issuing their products, one's softmax beside the
    /// next one's products (`PINGPONG`, FlashAttention-3's ping-pong); two or more warpgroups.
    pub pingpong: bool,
    /// Of the 16 groups of 8 keys a thread's row holds in a block, how many take their
    /// exponentials from a cubic on the FMA units rather than from the multifunction unit
    /// (`POLY_EXP`, `exp2_poly`): 0 to 16.
    pub poly_exp: u32,
    /// Every head's longest query block before any head's next longest, as chapter 3 orders
    /// its blocks (`LONGEST_FIRST`: a grid of heads × query blocks, the heads of every
    /// sequence), rather than one head after another (query blocks × heads). At most 65,535
    /// query blocks.
    pub longest_first: bool,
    /// Exponentials from `exp2f` (`EXACT_EXP`), four instructions each, rather than
    /// `fast_exp2`'s one: kept to measure the difference.
    pub exact_exp: bool,
}

impl Default for HopperConfig {
    fn default() -> Self {
        HopperConfig {
            warpgroups: 2,
            stages: 2,
            min_blocks: 1,
            overlap: false,
            early_rescale: false,
            kv_barriers: false,
            producer_warpgroup: false,
            pingpong: false,
            poly_exp: 0,
            longest_first: false,
            exact_exp: false,
        }
    }
}

/// A multiprocessor's shared memory on sm_90, and the most one thread block may take.
pub(crate) const SMEM_PER_SM: usize = 228 * 1024;
pub(crate) const SMEM_PER_BLOCK: usize = 227 * 1024;

impl HopperConfig {
    /// The shape measured fastest for a length (`hopper-check`, H200,
    /// `measurements/fast-exp2-63efe98.txt` and `measurements/kv-barriers.txt`): at head dim
    /// 64 up to 4,096 tokens one warpgroup of 64 rows a block, three blocks to a multiprocessor
    /// taking turns at its tensor cores, every head's longest query blocks first
    /// (`longest_first`); from 8,192 three warpgroups a block, sharing each block of keys and
    /// values among 192 rows, with a producer warpgroup that gives its registers to them
    /// (`setmaxnreg`). Head dim 128 takes two warpgroups and a producer warpgroup at every
    /// length, longest first up to 2,048 tokens. Wherever there is a producer warpgroup, the
    /// softmax runs beside P·v (`overlap`), the warpgroups take turns at their products
    /// (`pingpong`) and the keys and values have barriers of their own (`kv_barriers`); with
    /// the output rescaled early (`early_rescale`) except at head dim 128 from 4,096 tokens.
    pub fn for_shape(tokens: usize, head_dim: usize) -> Self {
        let c = |warpgroups, min_blocks| HopperConfig {
            warpgroups,
            stages: 2,
            min_blocks,
            ..Default::default()
        };
        let p = |warpgroups| HopperConfig {
            producer_warpgroup: true,
            ..c(warpgroups, 1)
        };
        let lf = |c: HopperConfig| HopperConfig {
            longest_first: true,
            ..c
        };
        // the softmax beside P·v, the warpgroups taking turns at their products, the keys'
        // and the values' own barriers
        let turns = |c: HopperConfig| HopperConfig {
            overlap: true,
            pingpong: true,
            kv_barriers: true,
            ..c
        };
        let er = |c: HopperConfig| HopperConfig {
            early_rescale: true,
            ..c
        };
        match (head_dim, tokens) {
            (128, ..=2048) => lf(er(turns(p(2)))),
            (128, _) => turns(p(2)),
            (_, ..=4096) => lf(c(1, 3)),
            _ => er(turns(p(3))),
        }
    }

    /// Queries per thread block (`BLOCK_M`).
    pub fn block_m(&self) -> usize {
        64 * self.warpgroups
    }

    /// Threads per block: the consumer warpgroups and a producer warp (or warpgroup).
    pub fn threads(&self) -> u32 {
        let producer = if self.producer_warpgroup { 128 } else { 32 };
        (128 * self.warpgroups + producer) as u32
    }

    /// Dynamic shared memory for head dim `d`: q's tile and `stages` tiles of k and v, and
    /// room to align them on the swizzle's 1024 bytes.
    pub fn smem_bytes(&self, d: usize) -> u32 {
        ((self.block_m() + 2 * self.stages * BLOCK_N) * d * 2 + 1024) as u32
    }

    /// Whether `min_blocks` blocks of this shape fit one multiprocessor's shared memory at
    /// head dim `d` (each block also takes 1 KB the system reserves).
    pub fn fits(&self, d: usize) -> bool {
        let smem = self.smem_bytes(d) as usize;
        smem <= SMEM_PER_BLOCK
            && self.min_blocks * (smem + 1024) <= SMEM_PER_SM
            && (!self.producer_warpgroup || self.min_blocks == 1)
            && (!self.pingpong || self.warpgroups >= 2)
            && (!self.early_rescale || self.overlap)
            && self.poly_exp <= 16
    }

    /// The shapes `hopper-check` compares at head dim `d`, [`HopperConfig::for_shape`]'s
    /// among them; every one fits (`fits`) and compiles without spills (`hopper-kernel-check`).
    pub fn candidates(d: usize) -> Vec<HopperConfig> {
        let c = |warpgroups, stages, min_blocks, overlap| HopperConfig {
            warpgroups,
            stages,
            min_blocks,
            overlap,
            ..Default::default()
        };
        let pp = |c: HopperConfig| HopperConfig {
            pingpong: true,
            ..c
        };
        let p = |warpgroups, stages, overlap| HopperConfig {
            producer_warpgroup: true,
            ..c(warpgroups, stages, 1, overlap)
        };
        // exponentials from the cubic; every head's longest blocks first
        let e = |poly_exp, c: HopperConfig| HopperConfig { poly_exp, ..c };
        let lf = |c: HopperConfig| HopperConfig {
            longest_first: true,
            ..c
        };
        let x = |c: HopperConfig| HopperConfig {
            exact_exp: true,
            ..c
        };
        let er = |c: HopperConfig| HopperConfig {
            early_rescale: true,
            ..c
        };
        let kv = |c: HopperConfig| HopperConfig {
            kv_barriers: true,
            ..c
        };
        let all = if d == 128 {
            vec![
                c(2, 2, 1, false),
                c(1, 2, 1, false),
                c(2, 3, 1, false),
                c(1, 2, 1, true),
                p(2, 2, false),
                p(2, 2, true),
                p(2, 3, true),
                // a third stage of keys and values, without the overlap
                p(2, 3, false),
                lf(p(2, 3, false)),
                pp(p(2, 2, false)),
                pp(c(2, 2, 1, false)),
                e(2, p(2, 2, false)),
                e(4, p(2, 2, false)),
                lf(p(2, 2, false)),
                lf(e(2, p(2, 2, false))),
                x(p(2, 2, false)),
                // the overlap in FlashAttention-3's order, with and without the turns
                er(p(2, 2, true)),
                er(p(2, 3, true)),
                pp(p(2, 2, true)),
                pp(er(p(2, 2, true))),
                lf(er(p(2, 2, true))),
                lf(pp(er(p(2, 2, true)))),
                // the keys' and the values' own barriers
                kv(p(2, 2, false)),
                kv(pp(p(2, 2, false))),
                kv(p(2, 2, true)),
                kv(er(p(2, 2, true))),
                kv(pp(p(2, 2, true))),
                kv(pp(er(p(2, 2, true)))),
                lf(kv(p(2, 2, false))),
                lf(kv(er(p(2, 2, true)))),
                lf(kv(pp(er(p(2, 2, true))))),
            ]
        } else {
            vec![
                c(2, 2, 1, false),
                c(3, 2, 1, false),
                c(2, 3, 1, false),
                c(1, 2, 2, false),
                c(1, 2, 3, false),
                c(1, 3, 2, false),
                c(2, 2, 1, true),
                c(2, 3, 1, true),
                c(1, 2, 2, true),
                p(2, 2, true),
                p(2, 3, true),
                p(3, 2, true),
                pp(c(2, 2, 1, false)),
                pp(c(3, 2, 1, false)),
                // with a producer warpgroup, without and with the turns
                p(2, 2, false),
                pp(p(2, 2, false)),
                p(3, 2, false),
                pp(p(3, 2, false)),
                // the exponentials shared between the multifunction unit and the FMAs (in
                // 128 registers a thread the cubic's spill: shapes with more)
                e(4, c(1, 2, 2, false)),
                e(4, c(1, 2, 2, true)),
                e(8, c(1, 2, 2, true)),
                e(4, p(3, 2, false)),
                e(8, p(3, 2, false)),
                e(4, pp(p(3, 2, false))),
                e(4, p(3, 2, true)),
                e(8, p(3, 2, true)),
                e(4, p(2, 2, false)),
                e(8, p(2, 2, false)),
                // and every head's longest query blocks first
                lf(c(1, 2, 3, false)),
                lf(c(3, 2, 1, false)),
                lf(e(4, c(1, 2, 2, true))),
                lf(p(3, 2, false)),
                lf(e(4, p(3, 2, false))),
                lf(e(4, p(3, 2, true))),
                // the exponentials as exp2f computes them
                x(c(1, 2, 3, false)),
                x(c(3, 2, 1, false)),
                // the overlap in FlashAttention-3's order, with and without the turns
                er(c(1, 2, 2, true)),
                lf(er(c(1, 2, 2, true))),
                er(p(3, 2, true)),
                pp(er(p(3, 2, true))),
                lf(er(p(3, 2, true))),
                // the keys' and the values' own barriers
                kv(c(1, 2, 2, true)),
                lf(kv(er(c(1, 2, 2, true)))),
                kv(p(3, 2, false)),
                kv(p(3, 2, true)),
                kv(er(p(3, 2, true))),
                kv(pp(er(p(3, 2, true)))),
                lf(kv(p(3, 2, false))),
            ]
        };
        all.into_iter().filter(|c| c.fits(d)).collect()
    }

    /// A short name for tables and PTX files: warpgroups × stages × blocks, "+overlap",
    /// "+er" (`early_rescale`), "+kv" (`kv_barriers`),
    /// "+pwg" (a producer warpgroup), "+pp" (ping-pong), "+eN" (N groups of exponentials from
    /// the cubic), "+lf" (every head's longest blocks first), "+exp2f" (`exact_exp`).
    pub fn name(&self) -> String {
        format!(
            "{}x{}x{}{}{}{}{}{}{}{}{}",
            self.warpgroups,
            self.stages,
            self.min_blocks,
            if self.overlap { "+overlap" } else { "" },
            if self.early_rescale { "+er" } else { "" },
            if self.kv_barriers { "+kv" } else { "" },
            if self.producer_warpgroup { "+pwg" } else { "" },
            if self.pingpong { "+pp" } else { "" },
            match self.poly_exp {
                0 => String::new(),
                n => format!("+e{n}"),
            },
            if self.longest_first { "+lf" } else { "" },
            if self.exact_exp { "+exp2f" } else { "" }
        )
    }

    /// The grid of a launch for `shape`: one block per `block_m` queries of each head of each
    /// sequence, as (query blocks, heads) or, longest first, (heads, query blocks); an error where
    /// the y dimension would pass its 65,535.
    pub fn grid(&self, shape: Shape) -> Result<(u32, u32, u32), AttnError> {
        ordered_grid(
            shape,
            self.block_m(),
            self.longest_first,
            &format!("block shape {}", self.name()),
            "blocks of queries",
        )
    }
}

/// A grid of one block per `rows` tokens of each head of each sequence: (blocks, heads) or,
/// longest first, (heads, blocks); an error naming `kernel` (what takes the grid) and `blocks`
/// (what the y dimension counts when longest first) where y would pass its 65,535.
pub(crate) fn ordered_grid(
    shape: Shape,
    rows: usize,
    longest_first: bool,
    kernel: &str,
    blocks: &str,
) -> Result<(u32, u32, u32), AttnError> {
    let (n, heads) = (shape.tokens.div_ceil(rows), shape.batch * shape.heads);
    let (x, y) = if longest_first {
        (heads, n)
    } else {
        (n, heads)
    };
    if y > 65_535 {
        return Err(AttnError::Unsupported {
            what: format!(
                "{shape}: the Hopper {kernel} takes at most 65,535 {} (a grid's y dimension), this shape needs {y}",
                if longest_first {
                    blocks
                } else {
                    "sequences × heads"
                }
            ),
        });
    }
    Ok((x as u32, y as u32, 1))
}

/// The byte offsets of the shared-memory matrix descriptors (see `wgmma-probe`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Descriptors {
    pub qk_leading: u32,
    pub qk_stride: u32,
    pub v_leading: u32,
    pub v_stride: u32,
}

impl Default for Descriptors {
    fn default() -> Self {
        Descriptors {
            qk_leading: 16,
            qk_stride: 1024,
            v_leading: 16,
            v_stride: 1024,
        }
    }
}

/// Compiles the kernel for `sm_90a` (the target with `wgmma`).
pub fn compile(
    dtype: Dtype,
    head_dim: usize,
    config: HopperConfig,
    desc: Descriptors,
    rank: TmaRank,
) -> Result<Ptx, AttnError> {
    require_nvrtc()?;
    let options = CompileOptions {
        arch: Some("sm_90a"),
        options: vec![
            format!("-DIS_BF16={}", (dtype == Dtype::Bf16) as u8),
            format!("-DWGS={}", config.warpgroups),
            format!("-DSTAGES={}", config.stages),
            format!("-DMIN_BLOCKS={}", config.min_blocks),
            format!("-DHEAD_DIM={head_dim}"),
            format!("-DOVERLAP={}", config.overlap as u8),
            format!("-DEARLY_RESCALE={}", config.early_rescale as u8),
            format!("-DKV_BARRIERS={}", config.kv_barriers as u8),
            format!("-DPINGPONG={}", config.pingpong as u8),
            format!("-DPRODUCER_WG={}", config.producer_warpgroup as u8),
            format!("-DPOLY_EXP={}", config.poly_exp),
            format!("-DLONGEST_FIRST={}", config.longest_first as u8),
            format!("-DEXACT_EXP={}", config.exact_exp as u8),
            format!("-DQK_LBO={}", desc.qk_leading),
            format!("-DQK_SBO={}", desc.qk_stride),
            format!("-DV_LBO={}", desc.v_leading),
            format!("-DV_SBO={}", desc.v_stride),
            rank.define(),
            "--std=c++17".into(),
        ],
        name: Some(format!(
            "hopper_forward_{}_d{head_dim}_{}_rank{}.cu",
            dtype.name(),
            config.name(),
            rank.rank()
        )),
        ..Default::default()
    };
    compile_ptx_with_opts(format!("{HOPPER_CUH}\n{HOPPER_FORWARD_CU}"), options)
        .map_err(|e| compile_error(HOPPER_FORWARD, e))
}

/// A tensor map as a kernel parameter: 128 bytes, aligned on 64.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub(crate) struct TensorMap(CUtensorMap);
// SAFETY: plain bytes, passed by value as the kernel's `TensorMap` parameter
unsafe impl DeviceRepr for TensorMap {}

// ANCHOR: tensor_map
/// The map of a `[batch, heads, tokens, head_dim]` tensor of 16-bit values where `x`'s
/// layout puts them, read in boxes of `rows` tokens of one head and (at most) 64 columns, 128
/// bytes, in the 128-byte swizzle; rows past the end read as zeros. Of rank 3 (batches and
/// heads merged, the sequence `b · heads + h` at `h`'s offset) or 4, as `rank` says.
///
/// # Safety
/// `x` must describe values of a live allocation on this GPU's context (its layout checked
/// against the shape, 16-byte aligned: [`Layout::check`]); with [`TmaRank::Three`] its layout
/// must merge batches and heads ([`TmaRank::of`]).
pub(crate) unsafe fn tensor_map(
    x: Strided,
    dtype: Dtype,
    s: Shape,
    rows: usize,
    rank: TmaRank,
) -> Result<TensorMap, AttnError> {
    let dtype = match dtype {
        Dtype::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        _ => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    };
    let l = x.layout;
    let (d, t, h, b) = (
        s.head_dim as u64,
        s.tokens as u64,
        s.heads as u64,
        s.batch as u64,
    );
    let (token, head, batch) = (l.token as u64 * 2, l.head as u64 * 2, l.batch as u64 * 2);
    let box_ = [s.head_dim.min(64) as u32, rows as u32, 1, 1];
    // SAFETY: the caller's promise
    unsafe {
        match rank {
            TmaRank::Three => {
                encode_tiled(x.ptr, dtype, &[d, t, b * h], &[token, head], &box_[..3])
            }
            TmaRank::Four => {
                encode_tiled(x.ptr, dtype, &[d, t, h, b], &[token, head, batch], &box_)
            }
        }
    }
    .map_err(|r| AttnError::Device {
        what: format!("cuTensorMapEncodeTiled for {s} at strides {l:?}: {r:?}"),
    })
}

/// A tiled tensor map in the 128-byte swizzle: `dims` innermost first, `strides` in bytes for
/// every dimension but the innermost, one box of `boxes` per copy.
///
/// # Safety
/// `ptr` must be a live device allocation of the values `dims` and `strides` describe, 16-byte
/// aligned.
pub(crate) unsafe fn encode_tiled(
    ptr: u64,
    dtype: CUtensorMapDataType,
    dims: &[u64],
    strides: &[u64],
    boxes: &[u32],
) -> Result<TensorMap, CUresult> {
    let rank = dims.len();
    assert!(boxes.len() == rank && strides.len() + 1 == rank);
    let steps = vec![1u32; rank];
    let mut map = std::mem::MaybeUninit::<CUtensorMap>::zeroed();
    // SAFETY: the arrays hold rank entries, strides rank − 1 (asserted); the caller vouches
    // for ptr
    let r = unsafe {
        cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            rank as u32,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    match r {
        // SAFETY: the driver wrote the map
        CUresult::CUDA_SUCCESS => Ok(TensorMap(unsafe { map.assume_init() })),
        e => Err(e),
    }
}
// ANCHOR_END: tensor_map

/// That the GPU is a Hopper (compute capability 9.0): `wgmma` and `setmaxnreg` exist there
/// only (sm_90a code runs on no other GPU).
pub fn check_hopper(gpu: &Gpu) -> Result<(), AttnError> {
    let (major, minor) = gpu
        .context()
        .compute_capability()
        .map_err(device_error("reading the compute capability"))?;
    check_capability(major, minor)
}

/// [`check_hopper`] for compute capability `major.minor`: what a GPU of another generation is
/// told (a test asks it on machines without one too).
pub fn check_capability(major: i32, minor: i32) -> Result<(), AttnError> {
    if (major, minor) != (9, 0) {
        return Err(AttnError::Unsupported {
            what: format!(
                "the Hopper kernels need a GPU of compute capability 9.0 (H100, H200; wgmma and TMA), this one is {major}.{minor}: use cuda_flash"
            ),
        });
    }
    Ok(())
}

/// The registers a producer warpgroup keeps beside `warpgroups` consumer warpgroups, unless a
/// kernel sets its own (`PRODUCER_REGS` in `hopper.cuh`).
pub(crate) fn default_producer_registers(warpgroups: usize) -> u32 {
    match warpgroups {
        1 => 56,
        2 => 24,
        _ => 32,
    }
}

/// The registers a block of `warpgroups` consumer warpgroups and a producer warpgroup keeping
/// `producer` starts with, a thread: what `ptxas` gives at one block a multiprocessor, the
/// register file shared evenly in steps of 8 (168 for 384 threads, 128 for 512, as it reports).
pub(crate) fn start_registers(warpgroups: usize) -> u32 {
    let threads = 128 * (warpgroups as u32 + 1);
    (65_536 / threads / 8 * 8).min(255)
}

/// The registers a producer warpgroup keeps and each consumer thread may take, as
/// `hopper.cuh` sets them (`PRODUCER_REGS`, `CONSUMER_REGS`): what the block starts with,
/// less the producer's, shared by the consumers in steps of 8, at most 240.
pub(crate) fn producer_consumer_registers(warpgroups: usize, producer: u32) -> (u32, u32) {
    let threads = 128 * (warpgroups as u32 + 1);
    let free =
        (start_registers(warpgroups) * threads - 128 * producer) / (128 * warpgroups as u32) / 8
            * 8;
    (producer, free.min(240))
}

/// A producer warpgroup hands its registers to the consumers with `setmaxnreg`, and a
/// consumer's `setmaxnreg.inc` waits until the block's pool holds what it asks for: the block
/// must start with at least what both roles end with, or it would wait forever. The kernel's
/// register count, which `ptxas` sets from the launch bounds, is checked here before a launch.
pub(crate) fn check_register_pool(
    f: &cudarc::driver::CudaFunction,
    warpgroups: usize,
    producer: u32,
    threads: u32,
    what: &str,
) -> Result<(), AttnError> {
    let regs = f
        .num_regs()
        .map_err(device_error("reading a kernel's register count"))? as u32;
    let (producer, consumer) = producer_consumer_registers(warpgroups, producer);
    let needed = 128 * producer + 128 * warpgroups as u32 * consumer;
    if regs * threads < needed {
        return Err(AttnError::Device {
            what: format!(
                "{what} was compiled with {regs} registers a thread for {threads} threads, fewer than the {needed} its producer ({producer} each) and consumers ({consumer} each) hold after setmaxnreg: launched, it would wait forever"
            ),
        });
    }
    Ok(())
}

/// The checks before a launch: step 03's, a head dim this kernel takes, and a grid of at most
/// 65,535 heads (its y dimension).
pub fn check(q: &DeviceTensor, k: &DeviceTensor, v: &DeviceTensor) -> Result<Shape, AttnError> {
    let shape = check_device(q, k, v)?;
    check_shape(shape)?;
    Ok(shape)
}

/// What the kernels need of a shape, wherever its values are: a head dim they take, at most
/// 65,535 sequences × heads (the grid's y dimension), and step 03's limits on the grid's x.
pub fn check_shape(shape: Shape) -> Result<(), AttnError> {
    if !HEAD_DIMS.contains(&shape.head_dim) {
        return Err(AttnError::UnsupportedHeadDim {
            head_dim: shape.head_dim,
            supported: HEAD_DIMS.map(|d| d.to_string()).join(", "),
        });
    }
    if shape.batch * shape.heads > 65_535 {
        return Err(AttnError::Unsupported {
            what: format!(
                "{shape}: the Hopper kernel takes at most 65,535 sequences × heads (a grid's y dimension)"
            ),
        });
    }
    grid_blocks(shape, 64)?;
    Ok(())
}

/// Causal attention with the Hopper kernel: the output and each row's log-sum-exp.
pub fn forward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
) -> Result<DeviceAttention, AttnError> {
    let mut result = gpu.alloc_output(q.shape, q.dtype)?;
    forward_with(
        gpu,
        HopperConfig::for_shape(q.shape.tokens, q.shape.head_dim),
        q,
        k,
        v,
        &mut result,
    )?;
    Ok(result)
}

/// [`forward`] into buffers allocated before, with a thread block of another shape.
pub fn forward_with(
    gpu: &Gpu,
    config: HopperConfig,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    result: &mut DeviceAttention,
) -> Result<(), AttnError> {
    check_hopper(gpu)?;
    let shape = check(q, k, v)?;
    let rows = shape.batch * shape.heads * shape.tokens;
    if result.out.shape != shape || result.out.dtype != q.dtype || result.lse.len() != rows {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the output buffers are for {} {}, the inputs are {shape} {}",
                result.out.shape,
                result.out.dtype.name(),
                q.dtype.name()
            ),
        });
    }
    if shape.is_empty() {
        return Ok(());
    }
    let tensor = |x: &DeviceTensor| Strided {
        ptr: x.data.device_ptr(gpu.stream()).0,
        layout: Layout::heads(shape),
    };
    let (out, _out) = result.out.data.device_ptr_mut(gpu.stream());
    let (lse, _lse) = result.lse.device_ptr_mut(gpu.stream());
    let out = Strided {
        ptr: out,
        layout: Layout::heads(shape),
    };
    // SAFETY: check() proved q, k, v hold the shape's values in one dtype, contiguous; the
    // output buffers were checked to match them; all are allocations of this stream's context
    // (256-byte aligned, as every allocation), alive until the launch is queued
    unsafe {
        launch(
            gpu,
            config,
            shape,
            q.dtype,
            [tensor(q), tensor(k), tensor(v)],
            out,
            lse,
        )
    }
}

/// [`forward_with`] reading q, k and v and writing the output where their layouts say (for
/// example from the trainer's fused projection, into the rows its output projection reads),
/// and each row's log-sum-exp to `lse`, `[batch · heads, tokens]` f32.
///
/// TMA reads q, k and v: their addresses and strides must be multiples of 16 bytes; the
/// kernel writes the output in pairs of values: 4 bytes. Both are checked, with each layout's
/// heads and token stride.
///
/// # Safety
/// Each address must point into a live allocation on this GPU's context, in `dtype`, with
/// [`Layout::span`] values for `shape` from it inside that allocation (`lse`: `batch · heads ·
/// tokens` f32), alive until the stream has run the kernel; what the output and `lse` reach
/// must not overlap each other or any input.
pub unsafe fn forward_into(
    gpu: &Gpu,
    config: HopperConfig,
    shape: Shape,
    dtype: Dtype,
    [q, k, v]: [Strided; 3],
    out: Strided,
    lse: u64,
) -> Result<(), AttnError> {
    check_hopper(gpu)?;
    check_shape(shape)?;
    for (x, name) in [(q, "q"), (k, "k"), (v, "v")] {
        x.layout.check(shape, x.ptr, 16, name)?;
    }
    out.layout.check(shape, out.ptr, 4, "the output")?;
    check_lse(lse)?;
    if shape.is_empty() {
        return Ok(());
    }
    // SAFETY: the caller's promise, and the layouts checked above
    unsafe { launch(gpu, config, shape, dtype, [q, k, v], out, lse) }
}

/// That the log-sum-exps' address can hold f32 values.
pub(crate) fn check_lse(lse: u64) -> Result<(), AttnError> {
    if !lse.is_multiple_of(4) {
        return Err(AttnError::Unsupported {
            what: format!("the log-sum-exp at {lse:#x}: f32 values need a 4-byte address"),
        });
    }
    Ok(())
}

/// The forward's launch, after its callers' checks (every layout fits the shape; the shape is
/// not empty).
///
/// # Safety
/// As [`forward_into`].
unsafe fn launch(
    gpu: &Gpu,
    config: HopperConfig,
    shape: Shape,
    dtype: Dtype,
    [q, k, v]: [Strided; 3],
    out: Strided,
    lse: u64,
) -> Result<(), AttnError> {
    let d = shape.head_dim;
    let smem = config.smem_bytes(d);
    if !config.fits(d) {
        return Err(AttnError::Unsupported {
            what: format!(
                "the Hopper block shape {} takes {smem} bytes of shared memory a block at head dim {d}, {} blocks a multiprocessor: more than its {SMEM_PER_SM} bytes (at most {SMEM_PER_BLOCK} a block)",
                config.name(),
                config.min_blocks
            ),
        });
    }
    let grid = config.grid(shape)?;
    let rank = TmaRank::of(&[q.layout, k.layout, v.layout], shape);
    let f = gpu.kernel(
        format!("hopper forward {dtype:?} d{d} {} {rank:?}", config.name()),
        HOPPER_FORWARD,
        smem,
        || compile(dtype, d, config, Descriptors::default(), rank),
    )?;
    if config.producer_warpgroup {
        check_register_pool(
            &f,
            config.warpgroups,
            default_producer_registers(config.warpgroups),
            config.threads(),
            HOPPER_FORWARD,
        )?;
    }
    let block_m = config.block_m();
    // SAFETY: the caller's promise
    let maps = unsafe {
        [
            tensor_map(q, dtype, shape, block_m, rank)?,
            tensor_map(k, dtype, shape, BLOCK_N, rank)?,
            tensor_map(v, dtype, shape, BLOCK_N, rank)?,
        ]
    };
    let launch_config = LaunchConfig {
        grid_dim: grid,
        block_dim: (config.threads(), 1, 1),
        shared_mem_bytes: smem,
    };
    let tokens = shape.tokens as i32;
    let scale_log2 = shape.scale_log2();
    let mut launch = gpu.stream().launch_builder(&f);
    launch
        .arg(&maps[0])
        .arg(&maps[1])
        .arg(&maps[2])
        .arg(&out.ptr)
        .arg(&out.layout)
        .arg(&lse)
        .arg(&tokens)
        .arg(&scale_log2);
    // SAFETY: the maps read within q, k and v (rows past a head's end read as zeros); the
    // kernel writes the output where its layout says and lse, for rows below `tokens` only,
    // within what the caller vouched for; the grid is one block per block_m queries of each
    // head, within the limits check_shape tested
    unsafe { launch.launch(launch_config) }.map_err(device_error("launching hopper_forward"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Longest first, the grid is (heads, query blocks); a shape with more query blocks
    /// than the y dimension takes is an error that says so, and `for_shape` takes the order
    /// only where every length it covers fits.
    #[test]
    fn longest_first_swaps_the_grid_and_names_its_limit() {
        let one = HopperConfig::for_shape(1 << 14, 64);
        let lf = HopperConfig {
            longest_first: true,
            ..one
        };
        let s = Shape::new(4, 12, 1000, 64);
        assert_eq!(one.grid(s).unwrap(), (6, 48, 1));
        assert_eq!(lf.grid(s).unwrap(), (48, 6, 1));
        let long = Shape::new(1, 1, 65_536 * 192, 64);
        assert!(one.grid(long).is_ok());
        let e = lf.grid(long).unwrap_err().to_string();
        assert!(
            e.contains("65,535 blocks of queries") && e.contains("65536"),
            "{e}"
        );
        for d in HEAD_DIMS {
            for t in [1, 4096, 4097, 8192, 8193, 1 << 16, 1 << 24] {
                let c = HopperConfig::for_shape(t, d);
                assert!(c.grid(Shape::new(1, 1, t, d)).is_ok(), "{t} d{d}: {c:?}");
            }
        }
    }

    /// What `for_shape` picks at any length is a candidate, so the GPU tests, `hopper-check`
    /// and `hopper-kernel-check` cover it; and no two candidates share a name.
    #[test]
    fn the_defaults_are_candidates_with_names_of_their_own() {
        for d in HEAD_DIMS {
            let all = HopperConfig::candidates(d);
            for t in [1, 2048, 2049, 4096, 4097, 8192, 8193, 1 << 14, 1 << 20] {
                let c = HopperConfig::for_shape(t, d);
                assert!(
                    all.contains(&c),
                    "{t} d{d}: {} is not a candidate",
                    c.name()
                );
            }
            let names: std::collections::HashSet<_> = all.iter().map(|c| c.name()).collect();
            assert_eq!(names.len(), all.len(), "d{d}: two candidates share a name");
        }
    }

    /// Every producer-warpgroup shape starts with at least the registers its roles end with,
    /// so `setmaxnreg.inc` never waits for registers that will not come.
    #[test]
    fn every_producer_warpgroup_shape_fits_the_register_file() {
        for d in HEAD_DIMS {
            for c in HopperConfig::candidates(d)
                .into_iter()
                .filter(|c| c.producer_warpgroup)
            {
                let (producer, consumer) = producer_consumer_registers(
                    c.warpgroups,
                    default_producer_registers(c.warpgroups),
                );
                let needed = 128 * producer + 128 * c.warpgroups as u32 * consumer;
                let have = start_registers(c.warpgroups) * c.threads();
                assert!(needed <= have, "{}: {needed} > {have}", c.name());
                assert!(consumer % 8 == 0 && (24..=256).contains(&consumer));
                assert!(producer % 8 == 0 && (24..=256).contains(&producer));
            }
            for (entry, c) in crate::backward::BackwardConfigs::shapes(d)
                .into_iter()
                .filter(|(_, c)| c.producer_warpgroup)
            {
                let (producer, consumer) =
                    producer_consumer_registers(c.warpgroups, c.producer_registers());
                let needed = 128 * producer + 128 * c.warpgroups as u32 * consumer;
                let have = start_registers(c.warpgroups) * c.threads();
                assert!(needed <= have, "{entry} {}: {needed} > {have}", c.name());
                assert!(consumer % 8 == 0 && (24..=256).contains(&consumer));
                assert!(producer % 8 == 0 && (24..=256).contains(&producer));
            }
        }
    }
}
