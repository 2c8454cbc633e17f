//! The backward by hand on the GPU, as PyTorch's eager autograd runs it after chapter 3's
//! attention by hand ([`Gpu::by_hand`]): whole `[batch·heads, T, T]` tables in device
//! memory, cuBLAS for the five products and `kernels/by_hand_backward.cu` for the two
//! elementwise steps between them. It is the yardstick the kernels of [`cuda`](crate::cuda)
//! are measured against, in time and in memory: it holds two tables, so its memory grows
//! with T².
//!
//! The forward hands over only its output and log-sum-exp ([`DeviceAttention`]), so the
//! probabilities are rebuilt from them, `P = exp(S − lse)`, as the kernels rebuild them;
//! the rest is the chain rule of [`reference`](crate::reference) one whole product at a
//! time.

use std::borrow::Cow;
use std::hash::{Hash, Hasher};

use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use flash_core::{Attention, AttnError, Shape};
use half::{bf16, f16};
use ndarray::ArrayView4;
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::by_hand::{products, warp_per_row};
use step03_cuda_forward::gpu::{
    DeviceTensor, Dtype, Gpu, KernelSpec, cudarc, device_error,
};
use step03_cuda_forward::kernel::TENSOR_CORES_CUH;

use crate::Grads;
use crate::cuda::{DeviceGrads, check_backward_device, forward_backward_with};

/// The two elementwise kernels, embedded so that binaries carry them; compiled with step
/// 03's [`TENSOR_CORES_CUH`] in front for its 16-bit conversions.
pub const BY_HAND_BACKWARD_CU: &str = include_str!("../kernels/by_hand_backward.cu");

/// Bytes the backward by hand allocates on the GPU for inputs of `shape` in a 16-bit dtype:
/// its two tables, and the three gradients it returns.
pub fn backward_bytes(shape: Shape) -> u128 {
    let tables = 2 * (shape.batch * shape.heads) as u128 * (shape.tokens as u128).pow(2);
    (tables + 3 * shape.len() as u128) * 2
}

/// One build of the two elementwise kernels: [`BY_HAND_BACKWARD_CU`] or a file with its two
/// entry points (a reader's, in chapter 4's exercise), with step 03's
/// [`TENSOR_CORES_CUH`] in front, for one dtype.
#[derive(Clone, Copy, Debug)]
pub struct ByHandBackwardKernel<'a> {
    pub source: &'a str,
    pub dtype: Dtype,
}

impl ByHandBackwardKernel<'static> {
    /// The step's own kernels for `dtype`.
    pub fn new(dtype: Dtype) -> Self {
        ByHandBackwardKernel {
            source: BY_HAND_BACKWARD_CU,
            dtype,
        }
    }
}

impl KernelSpec for ByHandBackwardKernel<'_> {
    fn name(&self) -> String {
        format!("by_hand_backward_{}.cu", self.dtype.name())
    }

    fn source(&self) -> Cow<'_, str> {
        [TENSOR_CORES_CUH, self.source].concat().into()
    }

    fn defines(&self) -> Vec<String> {
        vec![
            // tensor_cores.cuh sizes its tiles by a head dim; the row kernels use none of
            // them
            "-DHEAD_DIM=64".into(),
            format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8),
        ]
    }

    /// The name and the source's hash: a reader's kernels are compiled apart from the
    /// step's own.
    fn key(&self) -> String {
        let mut hasher = std::hash::DefaultHasher::new();
        self.source.hash(&mut hasher);
        format!("{} {:016x}", self.name(), hasher.finish())
    }
}

/// The gradients of q, k and v by hand on the GPU, given the forward's output and
/// log-sum-exp (from [`Gpu::by_hand`] or [`Gpu::forward`]) and the output's gradient
/// `dout`: the same arguments and result as [`cuda::backward`](crate::cuda::backward).
/// Fails with `OutOfMemory`, naming the table and its bytes, when a table does not fit.
pub fn backward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    backward_from(gpu, BY_HAND_BACKWARD_CU, q, k, v, fwd, dout)
}

/// [`backward`] with its two row kernels compiled from `source` instead of
/// [`BY_HAND_BACKWARD_CU`], with the same options and launches: chapter 4's exercise runs a
/// reader's `softmax_backward` so.
pub fn backward_from(
    gpu: &Gpu,
    source: &str,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
) -> Result<DeviceGrads, AttnError> {
    let shape = check_backward_device(q, k, v, fwd, dout)?;
    step03_cuda_forward::same_heads(q, k, "the backward by hand")?; // [step 08]
    let inputs = Inputs {
        source,
        shape,
        q,
        k,
        v,
        fwd,
        dout,
    };
    match step03_cuda_forward::gpu::half_dtype(q.dtype)? {
        Dtype::Bf16 => backward_in(gpu, &inputs, bf16::from_f32),
        _ => backward_in(gpu, &inputs, f16::from_f32),
    }
}

/// What [`backward_from`] was given, checked.
struct Inputs<'a> {
    source: &'a str,
    shape: Shape,
    q: &'a DeviceTensor,
    k: &'a DeviceTensor,
    v: &'a DeviceTensor,
    fwd: &'a DeviceAttention,
    dout: &'a DeviceTensor,
}

// ANCHOR: by_hand_backward_gpu
/// [`backward`] in the element type `T` of cuBLAS's products, whose values `to` makes.
fn backward_in<T: Copy>(
    gpu: &Gpu,
    &Inputs {
        source,
        shape,
        q,
        k,
        v,
        fwd,
        dout,
    }: &Inputs,
    to: fn(f32) -> T,
) -> Result<DeviceGrads, AttnError>
where
    CudaBlas: Gemm<T>,
{
    // SAFETY: each gradient is the output of one product below, which writes all of it
    // (beta = 0: cuBLAS reads nothing there); an empty shape has nothing to write
    let mut grads = unsafe { DeviceGrads::alloc(gpu, shape, q.dtype) }?;
    if shape.is_empty() {
        return Ok(grads);
    }
    // SAFETY: the first product into each table writes every entry before anything reads it
    let whose = "the backward by hand's";
    let mut p = unsafe { gpu.alloc_table(shape, whose, "probabilities") }?;
    let mut ds = unsafe { gpu.alloc_table(shape, whose, "dP and dS") }?;
    let (heads, t, d) = (
        (shape.batch * shape.heads) as i64,
        shape.tokens as i64,
        shape.head_dim as i64,
    );
    let (scale, one, zero) = (to(1.0 / (shape.head_dim as f32).sqrt()), to(1.0), to(0.0));
    // chapter 3's two products, a·bᵀ into a table and table·b out of one, with the scale on
    // one or the other
    let (scores, weighted) = products(heads, t, d, scale, one, zero);
    let (unscaled_scores, scaled_weighted) = products(heads, t, d, one, scale, zero);
    let (rows, tokens) = (heads * t, t as i32);
    // P = exp(scale·q·kᵀ − lse), the mask's entries exact zeros
    gpu.gemm(scores, &k.data, &q.data, &mut p)?;
    let (f, cfg) = row_kernel(gpu, source, q.dtype, "probabilities_from_lse", rows)?;
    let mut launch = gpu.stream().launch_builder(&f);
    launch.arg(&mut p).arg(&fwd.lse).arg(&tokens).arg(&rows);
    // SAFETY: the table holds rows·T values and lse rows (check_backward_device); each warp
    // touches its own row alone
    unsafe { launch.launch(cfg) }
        .map_err(device_error("launching probabilities_from_lse"))?;
    // dV = Pᵀ·dO
    gpu.gemm(transposed(weighted), &dout.data, &p, &mut grads.dv.data)?;
    // dP = dO·vᵀ, then dS = P ∘ (dP − rowsum(P ∘ dP)) in its place
    gpu.gemm(unscaled_scores, &v.data, &dout.data, &mut ds)?;
    let (f, cfg) = row_kernel(gpu, source, q.dtype, "softmax_backward", rows)?;
    let mut launch = gpu.stream().launch_builder(&f);
    launch.arg(&p).arg(&mut ds).arg(&tokens).arg(&rows);
    // SAFETY: as above, for two tables
    unsafe { launch.launch(cfg) }.map_err(device_error("launching softmax_backward"))?;
    // dQ = scale·dS·k, dK = scale·dSᵀ·q
    gpu.gemm(scaled_weighted, &k.data, &ds, &mut grads.dq.data)?;
    gpu.gemm(
        transposed(scaled_weighted),
        &q.data,
        &ds,
        &mut grads.dk.data,
    )?;
    Ok(grads)
}
// ANCHOR_END: by_hand_backward_gpu

/// `table·b` of [`products`] with the table read transposed: row-major `tableᵀ·b`. The
/// table is square, so its leading dimension stays T.
fn transposed<T>(c: StridedBatchedConfig<T>) -> StridedBatchedConfig<T> {
    StridedBatchedConfig {
        gemm: GemmConfig {
            transb: CUBLAS_OP_T,
            ..c.gemm
        },
        ..c
    }
}

/// One of the two kernels of `source` for `dtype`, and its launch over `rows` rows, a warp
/// a row.
fn row_kernel(
    gpu: &Gpu,
    source: &str,
    dtype: Dtype,
    entry: &str,
    rows: i64,
) -> Result<(CudaFunction, LaunchConfig), AttnError> {
    let f = gpu.kernel(&ByHandBackwardKernel { source, dtype }, entry, 0)?;
    Ok((f, warp_per_row(rows as usize, entry)?))
}

/// Forward and backward by hand on host arrays: inputs rounded to `dtype`,
/// [`Gpu::by_hand`], then [`backward`]; everything widened back to `f32`.
pub fn forward_backward(
    gpu: &Gpu,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<(Attention, Grads), AttnError> {
    forward_backward_with(gpu, Gpu::by_hand, backward, q, k, v, dout, dtype)
}

/// [`forward_backward`] with the backward's row kernels compiled from `source`
/// ([`backward_from`]).
pub fn forward_backward_from(
    gpu: &Gpu,
    source: &str,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<(Attention, Grads), AttnError> {
    let backward = |gpu: &Gpu, q: &_, k: &_, v: &_, fwd: &_, dout: &_| {
        backward_from(gpu, source, q, k, v, fwd, dout)
    };
    forward_backward_with(gpu, Gpu::by_hand, backward, q, k, v, dout, dtype)
}
