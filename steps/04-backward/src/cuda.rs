//! The backward pass on the GPU: `kernels/flash_backward.cu`, compiled by NVRTC through
//! step 03's [`Gpu`] and launched after the same kind of checks. Three launches: δ for
//! every row, then dK and dV with one block per 128 keys, then dQ with one block per 128
//! queries (four warps of 32 rows up to head dim 64, eight of 16 at 128: [`warps`] and
//! [`m_tiles`]). Each block writes only its own rows: no atomics, the same bits on every
//! run.

use std::borrow::Cow;

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use flash_core::{Attention, AttnError, Shape, check_qkv, check_same};
use ndarray::{Array4, ArrayView4};
use step03_cuda_forward::by_hand::warp_per_row;
use step03_cuda_forward::gpu::{
    DeviceTensor, Dtype, Gpu, KernelSpec, alloc_error, cudarc, device_error,
};
use step03_cuda_forward::kernel::TENSOR_CORES_CUH;
use step03_cuda_forward::{DeviceAttention, check_device};

use crate::Grads;

/// The backward kernels, embedded so that binaries carry them; compiled with step 03's
/// [`TENSOR_CORES_CUH`](step03_cuda_forward::kernel::TENSOR_CORES_CUH) in front.
pub const FLASH_BACKWARD_CU: &str = include_str!("../kernels/flash_backward.cu");
/// The head dims the backward kernels are compiled for: the forward kernel's (chapter 3),
/// so that every forward the GPU runs has a backward.
pub const HEAD_DIMS: [usize; 3] = step03_cuda_forward::kernel::HEAD_DIMS;

/// [`HEAD_DIMS`] as error messages list them.
fn supported_head_dims() -> String {
    HEAD_DIMS.map(|d| d.to_string()).join(", ")
}

/// A grid's largest second dimension: the blocks of rows of one head.
const MAX_GRID_Y: usize = 65_535;

/// Queries streamed past `backward_dkdv`'s keys per stage (`DKDV_STREAM`, fixed in
/// `kernels/flash_backward.cu`, as are the steps of both inner loops; a test below reads it
/// there).
pub const DKDV_STREAM: usize = 128;
/// Keys streamed past `backward_dq`'s queries per stage (`DQ_STREAM`).
pub const DQ_STREAM: usize = 64;

/// Warps per thread block at a head dim (`WARPS`, a macro of the head dim in
/// `kernels/flash_backward.cu`, as are `M_TILES` and each kernel's blocks a multiprocessor;
/// a test below reads them there): four up to head dim 64, eight at 128. The fastest
/// measured on the H200 (the tuning log, `lab/logs/04-backward/README.md`).
pub fn warps(head_dim: usize) -> usize {
    if head_dim <= 64 { 4 } else { 8 }
}

/// 16-row tiles of keys (dK/dV) or queries (dQ) per warp at a head dim (`M_TILES`): 2 up to
/// head dim 64, so that each B fragment read from shared memory feeds two `mma`; 1 at 128,
/// where 32 rows of two operands and two gradients would not fit in a warp's registers.
pub fn m_tiles(head_dim: usize) -> usize {
    if head_dim <= 64 { 2 } else { 1 }
}

/// Rows (keys or queries) per thread block at a head dim (`BLOCK_ROWS`): 128 at each.
pub fn block_rows(head_dim: usize) -> usize {
    warps(head_dim) * m_tiles(head_dim) * 16
}

/// One build of the backward kernels: everything their `-D` options say. It alone turns a
/// dtype and a head dim into those options ([`KernelSpec::defines`]), a module name and the
/// checks they must pass; `kernels/flash_backward.cu` holds no defaults (its thread blocks
/// are macros of the head dim, its streams and steps constants).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardKernel {
    pub dtype: Dtype,
    pub head_dim: usize,
    // [step 07]
    /// Each query sees the keys up to its own position (`CAUSAL`); without the mask, every
    /// key.
    pub causal: bool,
    /// dq, dk and dv are `f32` sums each block's share is added to (`ACCUMULATE`), rather
    /// than 16-bit values written once.
    pub accumulate: bool,
    // [/step 07]
}

impl BackwardKernel {
    /// The causal kernels, writing 16-bit gradients, for a dtype and head dim.
    pub fn new(dtype: Dtype, head_dim: usize) -> Self {
        BackwardKernel {
            dtype,
            head_dim,
            causal: true,      // [step 07]
            accumulate: false, // [step 07]
        }
    }
}

impl KernelSpec for BackwardKernel {
    /// The module's name: the kernels, what the build changes about them, the dtype and the
    /// head dim.
    fn name(&self) -> String {
        let build = format!("{}_d{}.cu", self.dtype.name(), self.head_dim);
        // [step 07]
        if !self.causal || self.accumulate {
            let full = if self.causal { "" } else { "_full" };
            let sums = if self.accumulate { "_accumulate" } else { "" };
            return format!("flash_backward{full}{sums}_{build}");
        }
        // [/step 07]
        format!("flash_backward_{build}")
    }

    /// Step 03's tensor-core helpers, then the backward kernels.
    fn source(&self) -> Cow<'_, str> {
        [TENSOR_CORES_CUH, FLASH_BACKWARD_CU].concat().into()
    }

    /// The `-D` options that specialise `kernels/flash_backward.cu`, one for each of its
    /// parameters.
    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8),
            format!("-DCAUSAL={}", self.causal as u8), // [step 07]
            format!("-DACCUMULATE={}", self.accumulate as u8), // [step 07]
        ]
    }

    /// A head dim the kernels are compiled for.
    fn check(&self) -> Result<(), AttnError> {
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(AttnError::UnsupportedHeadDim {
                head_dim: self.head_dim,
                supported: supported_head_dims(),
            });
        }
        Ok(())
    }
}

/// dq, dk and dv on the GPU, in the inputs' dtype.
pub struct DeviceGrads {
    pub dq: DeviceTensor,
    pub dk: DeviceTensor,
    pub dv: DeviceTensor,
}

fn kernel(
    gpu: &Gpu,
    dtype: Dtype,
    head_dim: usize,
    entry: &str,
    smem: u32,
) -> Result<cudarc::driver::CudaFunction, AttnError> {
    gpu.kernel(&BackwardKernel::new(dtype, head_dim), entry, smem)
}

impl DeviceGrads {
    /// dq, dk and dv for inputs of `shape` and `dtype`, left uninitialised.
    ///
    /// # Safety
    ///
    /// The caller writes every value before anything reads it.
    pub unsafe fn alloc(
        gpu: &Gpu,
        shape: Shape,
        dtype: Dtype,
    ) -> Result<DeviceGrads, AttnError> {
        let alloc = |what: &str| {
            // SAFETY: the caller's promise
            unsafe { gpu.stream().alloc::<u16>(shape.len()) }
                .map_err(alloc_error(what, shape.len() as u128 * 2))
                .map(|data| DeviceTensor { data, shape, dtype })
        };
        Ok(DeviceGrads {
            dq: alloc("allocating dq")?,
            dk: alloc("allocating dk")?,
            dv: alloc("allocating dv")?,
        })
    }
}

/// The checks every backward on the device makes before any work, and the shape they agree
/// on: q, k and v as the forward takes them ([`check_device`]), `dout` and the forward's
/// output of q's shape and dtype, and one log-sum-exp per row.
pub fn check_backward_device(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<Shape, AttnError> {
    let shape = check_device(q, k, v)?;
    same("dout", dout, q)?;
    same("the forward's output", &fwd.out, q)?;
    let rows = shape.batch * shape.heads * shape.tokens;
    if fwd.lse.len() != rows {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the forward's lse holds {} values; {shape} needs {rows}",
                fwd.lse.len()
            ),
        });
    }
    Ok(shape)
}

fn same(name: &str, x: &DeviceTensor, q: &DeviceTensor) -> Result<(), AttnError> {
    if x.shape != q.shape || x.dtype != q.dtype || x.data.len() != q.shape.len() {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "{name} is {} {} but q is {} {}",
                x.shape,
                x.dtype.name(),
                q.shape,
                q.dtype.name()
            ),
        });
    }
    Ok(())
}

// ANCHOR: backward_gpu
/// The gradients of q, k and v on the GPU, given the forward's output and log-sum-exp (from
/// [`Gpu::forward`]) and the output's gradient `dout`.
pub fn backward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let (dtype, head_dim) = (q.dtype, q.shape.head_dim);
    let kernels = |entry: &str, smem| kernel(gpu, dtype, head_dim, entry, smem);
    let launch = BackwardLaunch::for_head_dim(head_dim);
    launch_backward(gpu, launch, &kernels, q, k, v, fwd, dout, &mut || Ok(()))
}
// ANCHOR_END: backward_gpu

/// How the backward's kernels are launched: the threads and rows (keys or queries) of a
/// thread block, and each kernel's dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackwardLaunch {
    pub threads: u32,
    /// Keys (`backward_dkdv`) or queries (`backward_dq`) per thread block.
    pub block_rows: usize,
    pub dkdv_smem_bytes: u32,
    pub dq_smem_bytes: u32,
}

impl BackwardLaunch {
    /// The launch of `kernels/flash_backward.cu` at a head dim: `backward_dkdv`'s shared
    /// memory holds its own rows of k and v, and two stages of queries' q and dO with their
    /// log-sum-exp and δ; `backward_dq`'s its own rows of q and dO, and two stages of keys'
    /// k and v.
    pub fn for_head_dim(head_dim: usize) -> Self {
        let rows = block_rows(head_dim);
        BackwardLaunch {
            threads: (warps(head_dim) * 32) as u32,
            block_rows: rows,
            dkdv_smem_bytes: ((2 * rows + 4 * DKDV_STREAM) * head_dim * 2
                + 4 * DKDV_STREAM * 4) as u32,
            dq_smem_bytes: ((2 * rows + 4 * DQ_STREAM) * head_dim * 2) as u32,
        }
    }
}

/// [`backward`] with a build of the kernels compiled apart, of the same entry points and
/// arguments: `kernels(entry, shared memory)` gives each, launched as `launch` says; `mark`
/// is called before the first launch and after each of the three (to record an event on the
/// stream there, say). The lab's builds of other tiles (its `backward-tune --split` times
/// each kernel so).
#[allow(clippy::too_many_arguments)]
pub fn backward_built(
    gpu: &Gpu,
    launch: BackwardLaunch,
    kernels: &dyn Fn(&str, u32) -> Result<cudarc::driver::CudaFunction, AttnError>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
    mark: &mut dyn FnMut() -> Result<(), AttnError>,
) -> Result<DeviceGrads, AttnError> {
    launch_backward(gpu, launch, kernels, q, k, v, fwd, dout, mark)
}

// [step 07]
/// [`backward`] without the causal mask: the gradients of a block of queries that sees
/// every key of a block of keys. Step 07's ring computes so the blocks that lie wholly
/// before their queries; `fwd` then holds the whole row's output and log-sum-exp, so the
/// probabilities are the row's own and the gradients are this block's share.
pub fn backward_full(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let head_dim = q.shape.head_dim;
    let full = BackwardKernel {
        causal: false,
        ..BackwardKernel::new(q.dtype, head_dim)
    };
    let kernels = |entry: &str, smem| gpu.kernel(&full, entry, smem);
    let launch = BackwardLaunch::for_head_dim(head_dim);
    launch_backward(gpu, launch, &kernels, q, k, v, fwd, dout, &mut || Ok(()))
}
// [/step 07]

/// δ = rowsum(dO ∘ O) for every row, the backward's first launch, with its kernel
/// from the kernels' module (any build's computes the same): for a backward of
/// other kernels that starts from it (step 07's ring, from the merged output).
pub fn delta(
    gpu: &Gpu,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<CudaSlice<f32>, AttnError> {
    let (dtype, head_dim) = (dout.dtype, dout.shape.head_dim);
    let f = kernel(gpu, dtype, head_dim, "backward_delta", 0)?;
    launch_delta(gpu, &f, fwd, dout)
}

/// One launch of `backward_delta` (`f`, from this step's kernel file or a copy of it): a
/// warp per row.
pub fn launch_delta(
    gpu: &Gpu,
    f: &cudarc::driver::CudaFunction,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<CudaSlice<f32>, AttnError> {
    let rows = dout.shape.batch * dout.shape.heads * dout.shape.tokens;
    if fwd.out.data.len() != dout.data.len() || fwd.lse.len() != rows {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the forward's output holds {} values and its lse {}; dout {} has {} and {rows} rows",
                fwd.out.data.len(),
                fwd.lse.len(),
                dout.shape,
                dout.data.len()
            ),
        });
    }
    // SAFETY: backward_delta writes every row
    let mut delta: CudaSlice<f32> = unsafe { gpu.stream().alloc(rows.max(1)) }
        .map_err(alloc_error("allocating delta", rows as u128 * 4))?;
    if rows == 0 {
        return Ok(delta);
    }
    let rows_i = rows as i64;
    let mut launch = gpu.stream().launch_builder(f);
    launch
        .arg(&fwd.out.data)
        .arg(&dout.data)
        .arg(&mut delta)
        .arg(&rows_i);
    let cfg = warp_per_row(rows, "backward_delta")?;
    // SAFETY: out and dout hold `rows` rows of the head dim (checked above); the kernel
    // reads them and writes one δ per row
    unsafe { launch.launch(cfg) }.map_err(device_error("launching backward_delta"))?;
    Ok(delta)
}

// ANCHOR: launch_backward
/// The backward's three launches, with kernels from `kernels(entry, shared memory)`.
#[allow(clippy::too_many_arguments)]
fn launch_backward(
    gpu: &Gpu,
    launch: BackwardLaunch,
    kernels: &dyn Fn(&str, u32) -> Result<cudarc::driver::CudaFunction, AttnError>,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
    mark: &mut dyn FnMut() -> Result<(), AttnError>,
) -> Result<DeviceGrads, AttnError> {
    let shape = check_backward_device(q, k, v, fwd, dout)?;
    if !HEAD_DIMS.contains(&shape.head_dim) {
        return Err(AttnError::UnsupportedHeadDim {
            head_dim: shape.head_dim,
            supported: supported_head_dims(),
        });
    }
    // the grid is (heads, blocks of rows): its second dimension stops at 65,535
    let block = launch.block_rows;
    if shape.tokens.div_ceil(block) > MAX_GRID_Y
        || shape.batch * shape.heads > i32::MAX as usize
    {
        return Err(AttnError::Unsupported {
            what: format!(
                "{shape}: the backward kernels take at most {MAX_GRID_Y} blocks of {block} \
                 tokens ({} tokens) and 2^31 sequences × heads",
                MAX_GRID_Y * block
            ),
        });
    }
    let stream = gpu.stream();
    // SAFETY: every row of every head is written below before anything reads it (an empty
    // shape has no rows)
    let mut grads = unsafe { DeviceGrads::alloc(gpu, shape, q.dtype) }?;
    if shape.is_empty() {
        return Ok(grads);
    }
    let (t, scale) = (shape.tokens as i32, 1.0 / (shape.head_dim as f32).sqrt());
    let heads = (shape.batch * shape.heads) as u32;
    let blocks = shape.tokens.div_ceil(block) as u32;
    // [step 08]
    // query heads a head of k and v serves (1 unless they are grouped); dk and dv are
    // computed for each query head, then each group's summed
    let q_per_kv = (shape.heads / k.shape.heads) as i32;
    // [/step 08]
    // SAFETY (every launch): check_device and the checks above proved every buffer holds
    // what the shape says; each kernel reads rows below T and writes only its own rows of
    // delta, dk/dv or dq, and together they write all of them; each gets the dynamic shared
    // memory its layout needs, which Gpu::kernel has allowed it.
    mark()?;
    let delta = launch_delta(gpu, &kernels("backward_delta", 0)?, fwd, dout)?;
    mark()?;
    // the head is blockIdx.x, so the longest blocks of every head go first
    let cfg = |grid_y, smem| LaunchConfig {
        grid_dim: (heads, grid_y, 1),
        block_dim: (launch.threads, 1, 1),
        shared_mem_bytes: smem,
    };
    let (dkdv_smem, dq_smem) = (launch.dkdv_smem_bytes, launch.dq_smem_bytes);
    {
        let f = kernels("backward_dkdv", dkdv_smem)?;
        let mut args = stream.launch_builder(&f);
        args.arg(&q.data)
            .arg(&k.data)
            .arg(&v.data)
            .arg(&dout.data)
            .arg(&fwd.lse)
            .arg(&delta);
        args.arg(&mut grads.dk.data)
            .arg(&mut grads.dv.data)
            .arg(&q_per_kv) // [step 08]
            .arg(&t)
            .arg(&scale);
        unsafe { args.launch(cfg(blocks, dkdv_smem)) }
            .map_err(device_error("launching backward_dkdv"))?;
    }
    // [step 08]
    if q_per_kv > 1 {
        grads.dk = group_sum(gpu, &kernels("backward_group_sum", 0)?, &grads.dk, k.shape)?;
        grads.dv = group_sum(gpu, &kernels("backward_group_sum", 0)?, &grads.dv, k.shape)?;
    }
    // [/step 08]
    mark()?;
    {
        let f = kernels("backward_dq", dq_smem)?;
        let mut args = stream.launch_builder(&f);
        args.arg(&q.data)
            .arg(&k.data)
            .arg(&v.data)
            .arg(&dout.data)
            .arg(&fwd.lse)
            .arg(&delta);
        args.arg(&mut grads.dq.data)
            .arg(&q_per_kv) // [step 08]
            .arg(&t)
            .arg(&scale);
        unsafe { args.launch(cfg(blocks, dq_smem)) }
            .map_err(device_error("launching backward_dq"))?;
    }
    mark()?;
    Ok(grads)
}
// ANCHOR_END: launch_backward

// [step 08]
/// Grouped-query attention's dk or dv: the gradient of each query head (`per_q`, q's
/// shape) summed over the query heads of each group, into a tensor of `kv`'s shape, with
/// `backward_group_sum` from the kernels' module (step 06's backward sums its groups so).
pub fn sum_groups(
    gpu: &Gpu,
    per_q: &DeviceTensor,
    kv: Shape,
) -> Result<DeviceTensor, AttnError> {
    let (dtype, head_dim) = (per_q.dtype, per_q.shape.head_dim);
    let f = kernel(gpu, dtype, head_dim, "backward_group_sum", 0)?;
    group_sum(gpu, &f, per_q, kv)
}

/// [`sum_groups`] with the kernel given.
fn group_sum(
    gpu: &Gpu,
    f: &cudarc::driver::CudaFunction,
    per_q: &DeviceTensor,
    kv: Shape,
) -> Result<DeviceTensor, AttnError> {
    let q_per_kv = (per_q.shape.heads / kv.heads) as i32;
    let head_pairs = (kv.tokens * kv.head_dim / 2) as i64;
    let pairs = (kv.batch * kv.heads) as i64 * head_pairs;
    // SAFETY: the kernel writes every value (pairs · 2 of them) before anything reads it
    let mut sum = unsafe { gpu.stream().alloc::<u16>(kv.len()) }.map_err(alloc_error(
        "allocating a group's sum",
        kv.len() as u128 * 2,
    ))?;
    let cfg = LaunchConfig {
        grid_dim: ((pairs as u64).div_ceil(256).min(65_535) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = gpu.stream().launch_builder(f);
    launch
        .arg(&per_q.data)
        .arg(&mut sum)
        .arg(&head_pairs)
        .arg(&pairs)
        .arg(&q_per_kv);
    // SAFETY: per_q holds batch·heads·tokens·head_dim values (q's shape), sum kv's: the
    // kernel reads the q_per_kv heads of each group of per_q and writes sum's pairs, a
    // grid-stride loop over them (head dims are even)
    unsafe { launch.launch(cfg) }.map_err(device_error("launching backward_group_sum"))?;
    Ok(DeviceTensor {
        data: sum,
        shape: kv,
        dtype: per_q.dtype,
    })
}
// [/step 08]

/// A forward on device tensors: [`Gpu::forward`] or [`Gpu::by_hand`].
pub type DeviceForwardFn = fn(
    &Gpu,
    &DeviceTensor,
    &DeviceTensor,
    &DeviceTensor,
) -> Result<DeviceAttention, AttnError>;

/// A backward on device tensors: [`backward`] or
/// [`cuda_by_hand::backward`](crate::cuda_by_hand::backward).
pub type DeviceBackwardFn = fn(
    &Gpu,
    &DeviceTensor,
    &DeviceTensor,
    &DeviceTensor,
    &DeviceAttention,
    &DeviceTensor,
) -> Result<DeviceGrads, AttnError>;

/// Forward and backward on host arrays: inputs rounded to `dtype`, the forward kernel of
/// step 03, then [`backward`]; everything widened back to `f32`.
pub fn forward_backward(
    gpu: &Gpu,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<(Attention, Grads), AttnError> {
    forward_backward_with(gpu, Gpu::forward, backward, q, k, v, dout, dtype)
}

/// [`forward_backward`] with another forward and backward on device tensors.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward_with(
    gpu: &Gpu,
    forward: DeviceForwardFn,
    backward: impl Fn(
        &Gpu,
        &DeviceTensor,
        &DeviceTensor,
        &DeviceTensor,
        &DeviceAttention,
        &DeviceTensor,
    ) -> Result<DeviceGrads, AttnError>,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<(Attention, Grads), AttnError> {
    let shape = check_qkv(&q, &k, &v)?;
    check_same("dout", &dout, shape)?;
    if shape.is_empty() {
        let z = || Array4::zeros(shape.dims());
        return Ok((
            Attention::empty(shape),
            Grads {
                dq: z(),
                dk: z(),
                dv: z(),
            },
        ));
    }
    let up = |x: ArrayView4<f32>| gpu.upload(x, dtype);
    let (q, k, v, dout) = (up(q)?, up(k)?, up(v)?, up(dout)?);
    let fwd = forward(gpu, &q, &k, &v)?;
    let grads = backward(gpu, &q, &k, &v, &fwd, &dout)?;
    let lse = gpu
        .stream()
        .clone_dtoh(&fwd.lse)
        .map_err(device_error("copying from the GPU"))?;
    let attention = Attention {
        out: gpu.download(&fwd.out)?,
        lse: ndarray::Array3::from_shape_vec((shape.batch, shape.heads, shape.tokens), lse)
            .expect("b·h·T values"),
    };
    let grads = Grads {
        dq: gpu.download(&grads.dq)?,
        dk: gpu.download(&grads.dk)?,
        dv: gpu.download(&grads.dv)?,
    };
    Ok((attention, grads))
}

/// The backward by hand as PyTorch's autograd computes it on a GPU in `dtype`: every
/// product's result and the softmax's gradient rounded to `dtype`, arithmetic in f32. The
/// baseline of FlashAttention's rule for the gradients.
pub fn backward_by_hand_low_precision(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Grads {
    use ndarray::linalg::general_mat_mul;
    use ndarray::{Array2, s};
    use step03_cuda_forward::host::{probabilities_low_precision, round, round_array};
    let (q, k, v, dout) = (
        round_array(q, dtype),
        round_array(k, dtype),
        round_array(v, dtype),
        round_array(dout, dtype),
    );
    let shape = Shape::new(q.dim().0, q.dim().1, q.dim().2, q.dim().3);
    let [b_n, h_n, t_n, _] = shape.dims();
    let scale = round(shape.scale() as f32, dtype);
    let r = |a: &mut Array2<f32>| a.mapv_inplace(|x| round(x, dtype));
    let mut grads = Grads {
        dq: Array4::zeros(shape.dims()),
        dk: Array4::zeros(shape.dims()),
        dv: Array4::zeros(shape.dims()),
    };
    for b in 0..b_n {
        for h in 0..h_n {
            let (qh, kh, vh, doh) = (
                q.slice(s![b, h, .., ..]),
                k.slice(s![b, h, .., ..]),
                v.slice(s![b, h, .., ..]),
                dout.slice(s![b, h, .., ..]),
            );
            // the forward by hand's table, rounded as step 03's by_hand_low_precision
            // rounds it
            let p = probabilities_low_precision(qh, kh, dtype);
            let mut dv = grads.dv.slice_mut(s![b, h, .., ..]);
            general_mat_mul(1.0, &p.t(), &doh, 0.0, &mut dv);
            dv.mapv_inplace(|x| round(x, dtype));
            let mut dp = Array2::<f32>::zeros((t_n, t_n));
            general_mat_mul(1.0, &doh, &vh.t(), 0.0, &mut dp);
            r(&mut dp);
            // softmax's gradient: ds = p ∘ (dp − rowsum(p ∘ dp)), then through the scale
            for (mut dprow, prow) in dp.rows_mut().into_iter().zip(p.rows()) {
                let dot: f32 = dprow.iter().zip(prow.iter()).map(|(a, b)| a * b).sum();
                for (x, &pv) in dprow.iter_mut().zip(prow.iter()) {
                    *x = round(round(pv * (*x - dot), dtype) * scale, dtype);
                }
            }
            let mut dq = grads.dq.slice_mut(s![b, h, .., ..]);
            general_mat_mul(1.0, &dp, &kh, 0.0, &mut dq);
            dq.mapv_inplace(|x| round(x, dtype));
            let mut dk = grads.dk.slice_mut(s![b, h, .., ..]);
            general_mat_mul(1.0, &dp.t(), &qh, 0.0, &mut dk);
            dk.mapv_inplace(|x| round(x, dtype));
        }
    }
    grads
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `#define NAME ...` gives NAME in `kernels/flash_backward.cu`, without its
    /// comment.
    fn defined(name: &str) -> Vec<&'static str> {
        let start = format!("#define {name} ");
        FLASH_BACKWARD_CU
            .lines()
            .filter_map(|l| l.strip_prefix(&start))
            .map(|v| v.split("//").next().unwrap_or(v).trim())
            .collect()
    }

    /// The launch uses the thread blocks and streams `flash_backward.cu` fixes: its lines
    /// for them, as the functions and constants above write them.
    #[test]
    fn the_launch_uses_the_blocks_and_streams_the_kernels_fix() {
        let (small, large) = (HEAD_DIMS[0], HEAD_DIMS[HEAD_DIMS.len() - 1]);
        assert_eq!((warps(small), m_tiles(small)), (warps(64), m_tiles(64)));
        let of_head_dim =
            |f: fn(usize) -> usize| format!("(HEAD_DIM <= 64 ? {} : {})", f(64), f(large));
        let sizes = [
            ("WARPS", of_head_dim(warps)),
            ("M_TILES", of_head_dim(m_tiles)),
            ("THREADS", "(WARPS * 32)".into()),
            ("WARP_ROWS", "(M_TILES * 16)".into()),
            ("BLOCK_ROWS", "(WARPS * WARP_ROWS)".into()),
            ("DKDV_STREAM", DKDV_STREAM.to_string()),
            ("DQ_STREAM", DQ_STREAM.to_string()),
        ];
        for (name, value) in sizes {
            assert_eq!(
                defined(name),
                [value.as_str()],
                "kernels/flash_backward.cu's {name}"
            );
        }
    }
}
