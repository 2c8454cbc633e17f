//! The forward's host side: the checks, the tensor maps TMA reads through, the launch of a
//! [`ForwardKernel`].

use cudarc::driver::sys::{
    CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
    cuTensorMapEncodeTiled,
};
use cudarc::driver::{
    CudaFunction, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use flash_core::{AttnError, Shape};
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{
    DeviceTensor, Dtype, Gpu, check_tensors, device_error, grid_blocks,
};

use crate::kernel::{BLOCK_N, ForwardKernel, HEAD_DIMS};
use crate::layout::{Layout, Strided, TmaRank};

/// A tensor map as a kernel parameter: 128 bytes, aligned on 64.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TensorMap(CUtensorMap);
// SAFETY: plain bytes, passed by value as the kernel's `TensorMap` parameter
unsafe impl DeviceRepr for TensorMap {}

// ANCHOR: tensor_map
/// The map of a `[batch, heads, tokens, head_dim]` tensor of 16-bit values where `x`'s
/// layout puts them, read in boxes of `rows` tokens of one head and (at most) 64 columns,
/// 128 bytes, in the 128-byte swizzle; rows past the end read as zeros. Of rank 3 (batches
/// and heads merged, the sequence `b · heads + h` at `h`'s offset) or 4, as `rank` says.
///
/// # Safety
/// `x` must describe values of a live allocation on this GPU's context (its layout checked
/// against the shape, 16-byte aligned: [`Layout::check`]); with [`TmaRank::Three`] its
/// layout must merge batches and heads ([`TmaRank::of`]).
pub unsafe fn tensor_map(
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

/// A tiled tensor map in the 128-byte swizzle: `dims` innermost first, `strides` in bytes
/// for every dimension but the innermost, one box of `boxes` per copy.
///
/// # Safety
/// `ptr` must be a live device allocation of the values `dims` and `strides` describe,
/// 16-byte aligned.
pub unsafe fn encode_tiled(
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

/// [`check_hopper`] for compute capability `major.minor`: what a GPU of another generation
/// is told (a test asks it on machines without one too).
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

/// The checks before a launch: q, k and v as the GPU runtime takes them
/// ([`check_tensors`]), then what the Hopper kernels need of their shape
/// ([`check_shape`]). The kernel's own limits (shared memory, warpgroups) are its
/// [`KernelSpec::check`](step03_cuda_forward::gpu::KernelSpec::check), made once, when its
/// module is compiled.
pub fn check(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
) -> Result<Shape, AttnError> {
    let shape = check_tensors(q, k, v)?;
    check_shape(shape)?;
    Ok(shape)
}

/// What the kernels need of a shape, wherever its values are: a head dim they take, at most
/// 65,535 sequences × heads (the grid's y dimension), and at most 2^31 − 1 blocks of the
/// smallest block of queries, 64, on its x (and 2^30 tokens).
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
        ForwardKernel::for_shape(q.shape, k.shape.heads),
        q,
        k,
        v,
        &mut result,
    )?;
    Ok(result)
}

/// The compiled kernel for a dtype, a head dim and a rank of the tensor maps, and the
/// dynamic shared memory it takes.
pub type BuildFn<'a> =
    &'a dyn Fn(Dtype, usize, TmaRank) -> Result<(CudaFunction, u32), AttnError>;

/// `kernel` as this step builds it: its [`Build`](crate::kernel::Build) compiled, with
/// [`ForwardKernel::smem_bytes`].
fn build_of(
    gpu: &Gpu,
    kernel: ForwardKernel,
) -> impl Fn(Dtype, usize, TmaRank) -> Result<(CudaFunction, u32), AttnError> {
    move |dtype, d, rank| {
        let smem = kernel.smem_bytes(d);
        let f = gpu.kernel(&kernel.build(dtype, d, rank), "hopper_forward", smem)?;
        Ok((f, smem))
    }
}

/// [`forward`] into buffers allocated before, with the kernel given.
pub fn forward_with(
    gpu: &Gpu,
    kernel: ForwardKernel,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    result: &mut DeviceAttention,
) -> Result<(), AttnError> {
    forward_built(gpu, kernel, &build_of(gpu, kernel), q, k, v, result)
}

/// [`forward_with`] with a build of the kernel compiled apart by `build`, of the same entry
/// point and arguments, its thread blocks as `kernel` says: the lab's builds of other sizes.
pub fn forward_built(
    gpu: &Gpu,
    kernel: ForwardKernel,
    build: BuildFn,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    result: &mut DeviceAttention,
) -> Result<(), AttnError> {
    check_hopper(gpu)?;
    let shape = check(q, k, v)?;
    let rows = shape.batch * shape.heads * shape.tokens;
    if result.out.shape != shape || result.out.dtype != q.dtype || result.lse.len() != rows
    {
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
        layout: Layout::heads(x.shape),
    };
    let (out, _out) = result.out.data.device_ptr_mut(gpu.stream());
    let (lse, _lse) = result.lse.device_ptr_mut(gpu.stream());
    let out = Strided {
        ptr: out,
        layout: Layout::heads(shape),
    };
    // SAFETY: check() proved q, k, v hold the shape's values in one dtype, contiguous; the
    // output buffers were checked to match them; all are allocations of this stream's
    // context (256-byte aligned, as every allocation), alive until the launch is queued
    unsafe {
        launch(
            gpu,
            kernel,
            build,
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
/// kernel writes the output in pairs of values: 4 bytes. Both are checked, with each
/// layout's heads and token stride.
///
/// # Safety
/// Each address must point into a live allocation on this GPU's context, in `dtype`, with
/// [`Layout::span`] values for `shape` from it inside that allocation (`lse`: `batch ·
/// heads · tokens` f32), alive until the stream has run the kernel; what the output and
/// `lse` reach must not overlap each other or any input.
pub unsafe fn forward_into(
    gpu: &Gpu,
    kernel: ForwardKernel,
    shape: Shape,
    dtype: Dtype,
    [q, k, v]: [Strided; 3],
    out: Strided,
    lse: u64,
) -> Result<(), AttnError> {
    check_hopper(gpu)?;
    check_shape(shape)?;
    // k's and v's shape: q's
    let kv = shape;
    // [step 08]
    // or q's with fewer heads, as their layouts say, each shared by a group of q's heads
    let kv = flash_core::check::grouped_kv(kv, k.layout.heads.max(0) as usize)?;
    // [/step 08]
    for (x, s, name) in [(q, shape, "q"), (k, kv, "k"), (v, kv, "v")] {
        x.layout.check(s, x.ptr, 16, name)?;
    }
    out.layout.check(shape, out.ptr, 4, "the output")?;
    check_lse(lse)?;
    if shape.is_empty() {
        return Ok(());
    }
    let build = build_of(gpu, kernel);
    // SAFETY: the caller's promise, and the layouts checked above
    unsafe { launch(gpu, kernel, &build, shape, dtype, [q, k, v], out, lse) }
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

/// The forward's launch, after its callers' checks (every layout fits the shape; the shape
/// is not empty).
///
/// # Safety
/// As [`forward_into`].
#[allow(clippy::too_many_arguments)]
unsafe fn launch(
    gpu: &Gpu,
    kernel: ForwardKernel,
    build: BuildFn,
    shape: Shape,
    dtype: Dtype,
    [q, k, v]: [Strided; 3],
    out: Strided,
    lse: u64,
) -> Result<(), AttnError> {
    let d = shape.head_dim;
    let grid = kernel.grid(shape)?;
    let rank = TmaRank::of(&[q.layout, k.layout, v.layout], shape);
    let (f, smem) = build(dtype, d, rank)?;
    kernel.check_registers(&f)?;
    let block_m = kernel.block_m();
    // k's and v's shape: q's
    let kv = shape;
    // [step 08]
    // or q's with fewer heads, as their layouts say: each serves q_per_kv query heads
    let kv = Shape {
        heads: k.layout.heads as usize,
        ..kv
    };
    let q_per_kv = (shape.heads / kv.heads) as i32;
    // [/step 08]
    // SAFETY: the caller's promise
    let maps = unsafe {
        [
            tensor_map(q, dtype, shape, block_m, rank)?,
            tensor_map(k, dtype, kv, BLOCK_N, rank)?,
            tensor_map(v, dtype, kv, BLOCK_N, rank)?,
        ]
    };
    let launch_config = LaunchConfig {
        grid_dim: grid,
        block_dim: (kernel.threads(), 1, 1),
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
        .arg(&q_per_kv) // [step 08]
        .arg(&scale_log2);
    // SAFETY: the maps read within q, k and v (rows past a head's end read as zeros); the
    // kernel writes the output where its layout says and lse, for rows below `tokens` only,
    // within what the caller vouched for; the grid is one block per block_m queries of each
    // head, within the limits check_shape tested
    unsafe { launch.launch(launch_config) }
        .map_err(device_error("launching hopper_forward"))?;
    Ok(())
}
