//! # Step 03: the forward pass as a CUDA kernel
//!
//! The online softmax of step 02, moved onto a GPU's tensor cores: one thread block per 128
//! queries of a head, keys and values streamed through shared memory 128 at a time,
//! `mma.sync` products in bf16 or f16 with f32 accumulation, and each row's log-sum-exp
//! stored for the backward pass. The kernel lives in a real `.cu` file; NVRTC compiles it
//! on first use (cached per dtype and head dim) and cudarc launches it. cudarc opens
//! `libcuda` and `libnvrtc` at run time, so this crate builds and its CPU tests run on
//! machines without CUDA: there, every call returns [`AttnError::Device`] saying what is
//! missing.
//!
//! ## Kernels
//!
//! The step's kernel is the last of five rungs of a ladder ([`ladder`]): each of the first
//! four is the same causal forward one idea slower, so that the book can build the fast
//! kernel up one idea at a time.
//!
//! | kernel | what it does | H200, B=4 H=12 D=64 bf16 causal: TFLOP/s at 1k / 4k / 16k (× FA2) |
//! | --- | --- | --- |
//! | `kernels/ladder_1_rows.cu` (rung 1, `cuda_rows`) | one thread per query row, f32, keys and values read from global memory one value at a time | 4.3 / 5.1 / 7.1 (0.03× / 0.02× / 0.02×) |
//! | `kernels/ladder_2_shared.cu` (rung 2, `cuda_shared`) | rung 1 with keys and values staged through shared memory, 64 at a time, widened to f32 once | 13.2 / 20.0 / 23.9 (0.09× / 0.08× / 0.08×) |
//! | `kernels/ladder_3_mma.cu` (rung 3, `cuda_mma`) | rung 5's tiles and `mma.sync`, fragments by plain loads from tiles stored row by row (bank conflicts), copies through registers that the products wait for, blocks in grid order | 44.8 / 68.1 / 84.0 (0.31× / 0.27× / 0.27×) |
//! | `kernels/ladder_4_ldmatrix.cu` (rung 4, `cuda_ldmatrix`) | rung 3 with fragments by `ldmatrix` from swizzled tiles | 93.0 / 115.4 / 165.7 (0.65× / 0.46× / 0.54×) |
//! | `kernels/flash_forward.cu` (rung 5, `cuda_flash`) | 4 warps × 32 rows, 128 keys a step, `ldmatrix` from swizzled shared memory, `cp.async` two-stage K/V pipeline, `exp2` with log2 e folded into the scale, mask on diagonal blocks only, every head's longest query blocks first | 208.8 / 329.3 / 349.9 (1.46× / 1.31× / 1.14×), `charts/data/gpu.json` |
//! | `kernels/causal_softmax.cu` (with cuBLAS) | attention by hand: the whole table in device memory | 43 / 31 / 25 |
//!
//! The tile shape came from the lab's `forward-tune` (the tuning log,
//! `lab/logs/03-cuda-forward/README.md`): 16 rows a warp instead of 32 ran at 223 TFLOP/s
//! at 16k, 64 keys a step instead of 128 at 294, and one head after another instead of all
//! heads' longest blocks first lost 27% at 1k (145.5 against 200.5). At head dim 128 (runs
//! 14 and 16): 4 warps × 32 rows over 64 keys taken 32 at a time, one ldmatrix offset
//! register per operand, 229.5 / 338.8 / 358.5 / 352.0 at 1k / 4k / 8k / 16k against FA2's
//! 168.9 / 290.0 /
//! 330.5 / 346.0. The copies of each block take a fixed count of instructions with no test
//! per row (`load_rows`, run 16: 5–13% at both head dims). The variants that lost and left
//! the kernel are in `lab/notes/03-cuda-forward.md`.
//!
//! ## Layout
//!
//! - This file: the forward on the GPU runtime's [`Gpu`]: [`Gpu::forward`] on device
//!   tensors into a [`DeviceAttention`], [`Gpu::attention`] on host arrays,
//!   [`Gpu::forward_built`] with a build of the kernel compiled apart (the lab's other
//!   tiles), and the checks before a launch ([`check_device`]).
//! - [`gpu`]: the GPU runtime this step brings and every later step's kernels run on: the
//!   device and its stream ([`Gpu`]), tensors in its memory ([`DeviceTensor`]), one NVRTC
//!   compile for every kernel's typed description ([`KernelSpec`](gpu::KernelSpec),
//!   [`compile`](gpu::compile)) and the cache of compiled kernels, timing and copies.
//! - [`ladder`]: the rungs ([`Rung`]), run by [`Gpu::ladder_forward_into`] on device
//!   tensors and [`Gpu::ladder_attention`] on host arrays.
//! - [`kernel`]: the `.cu` sources (with `kernels/tensor_cores.cuh`, the helpers every
//!   kernel shares, in front) and their typed descriptions:
//!   [`ForwardKernel`](kernel::ForwardKernel), which alone turns a dtype and a head dim
//!   into the kernel's `-D` options, and the tile `flash_forward.cu` fixes for each head
//!   dim, as its launch needs it ([`ForwardLaunch`](kernel::ForwardLaunch)).
//! - [`host`]: rounding to bf16/f16 and back, and attention by hand in those precisions on
//!   the CPU (the yardstick of the GPU tests).
//! - [`by_hand`]: attention by hand on the GPU (cuBLAS and `kernels/causal_softmax.cu`).
//! - [`rule`]: FlashAttention's rule ([`ForwardCheck`](rule::ForwardCheck)), which the GPU
//!   tests and the exercise checker both apply.
//! - [`banks`]: chapter 3's first CPU exercise, the turns shared memory's banks take for a
//!   warp's loads, written by the reader in `exercises/banks.rs`, and its checker.
//! - [`exercise`]: chapter 3's exercises: the swizzle written by the reader in Rust in
//!   `exercises/swizzle.rs`, checked on the CPU; rung 1's key loop in `exercises/rows.cu`,
//!   checked on the GPU. `src/bin/exercise.rs` runs any of them
//!   (`cargo run -p step03-cuda-forward --bin exercise -- banks`).
//! - [`ptxas`]: what the kernel-check binaries share; `src/bin/kernel-check.rs` compiles
//!   every kernel the library launches (and the exercise's template) with NVRTC and ptxas
//!   and fails on any spill (no GPU needed).
//! - [`tool`]: the command-line tools' flag parsers.
//! - [`methods`](mod@methods): the step's methods in the registry, [`Ladder`],
//!   [`CudaNaive`] and [`CudaFlash`].

pub mod banks;
pub mod by_hand;
pub mod exercise;
pub mod gpu;
pub mod host;
pub mod kernel;
pub mod ladder;
pub mod methods;
pub mod ptxas;
pub mod rule;
pub mod tool;

pub use ladder::Rung;
pub use methods::{CudaFlash, CudaNaive, Ladder, methods};

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use flash_core::{Attention, AttnError, Shape, check_qkv};
use ndarray::{Array3, ArrayView4};

use gpu::{
    DeviceTensor, Dtype, Gpu, alloc_error, cudarc, device_error, grid_blocks, half_dtype,
};
use kernel::{ForwardKernel, ForwardLaunch, SoftmaxKernel};

/// What the forward kernel writes: the output and each row's natural log-sum-exp.
pub struct DeviceAttention {
    pub out: DeviceTensor,
    /// `[batch, heads, tokens]`, f32
    pub lse: CudaSlice<f32>,
}

impl Gpu {
    fn forward_kernel(
        &self,
        dtype: Dtype,
        head_dim: usize,
    ) -> Result<CudaFunction, AttnError> {
        self.kernel(
            &ForwardKernel::new(dtype, head_dim),
            kernel::FLASH_FORWARD,
            kernel::smem_bytes(head_dim),
        )
    }

    pub(crate) fn softmax_kernel(&self, dtype: Dtype) -> Result<CudaFunction, AttnError> {
        self.kernel(&SoftmaxKernel { dtype }, kernel::CAUSAL_SOFTMAX, 0)
    }

    /// Allocates what [`Gpu::forward_into`] writes, for a given input.
    pub fn alloc_output(
        &self,
        shape: Shape,
        dtype: Dtype,
    ) -> Result<DeviceAttention, AttnError> {
        let dtype = half_dtype(dtype)?;
        let out = self
            .stream()
            .alloc_zeros::<u16>(shape.len())
            .map_err(alloc_error(
                "allocating the output",
                shape.len() as u128 * 2,
            ))?;
        let rows = shape.batch * shape.heads * shape.tokens;
        let lse = self
            .stream()
            .alloc_zeros::<f32>(rows)
            .map_err(alloc_error("allocating the log-sum-exp", rows as u128 * 4))?;
        Ok(DeviceAttention {
            out: DeviceTensor {
                data: out,
                shape,
                dtype,
            },
            lse,
        })
    }

    // ANCHOR: forward
    /// Causal attention on the GPU: `out = softmax(mask(q·kᵀ/√d))·v` and each row's
    /// log-sum-exp.
    pub fn forward(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
    ) -> Result<DeviceAttention, AttnError> {
        let mut result = self.alloc_output(q.shape, q.dtype)?;
        self.forward_into(q, k, v, &mut result)?;
        Ok(result)
    }

    /// [`Gpu::forward`] into buffers allocated before (the benchmark times this alone).
    pub fn forward_into(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        let shape = check_device(q, k, v)?;
        check_output(shape, q.dtype, result)?;
        if shape.is_empty() {
            return Ok(());
        }
        let f = self.forward_kernel(q.dtype, shape.head_dim)?;
        let launch = ForwardLaunch::for_head_dim(shape.head_dim);
        self.launch_forward(&f, launch, q, k, v, result)
    }
    // ANCHOR_END: forward

    /// [`Gpu::forward_into`] with a build of the kernel compiled apart, of the same entry
    /// point and arguments, launched as `launch` says: the lab's builds of other tiles.
    pub fn forward_built(
        &self,
        f: &CudaFunction,
        launch: ForwardLaunch,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        let shape = check_device(q, k, v)?;
        check_output(shape, q.dtype, result)?;
        if shape.is_empty() {
            return Ok(());
        }
        self.launch_forward(f, launch, q, k, v, result)
    }

    // [step 07]
    /// [`Gpu::forward_into`] without the causal mask: every query sees every key. Step 07's
    /// ring computes so the blocks of keys that lie wholly before their queries.
    pub fn forward_full_into(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        let shape = check_device(q, k, v)?;
        check_output(shape, q.dtype, result)?;
        if shape.is_empty() {
            return Ok(());
        }
        let head_dim = shape.head_dim;
        let full = ForwardKernel {
            causal: false,
            ..ForwardKernel::new(q.dtype, head_dim)
        };
        let launch = ForwardLaunch::for_head_dim(head_dim);
        let f = self.kernel(&full, kernel::FLASH_FORWARD, launch.smem_bytes)?;
        self.launch_forward(&f, launch, q, k, v, result)
    }
    // [/step 07]

    // ANCHOR: launch_forward
    /// Launches a compiled forward kernel on checked, non-empty inputs.
    fn launch_forward(
        &self,
        f: &CudaFunction,
        launch: ForwardLaunch,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
        result: &mut DeviceAttention,
    ) -> Result<(), AttnError> {
        let shape = q.shape;
        let heads = shape.batch * shape.heads;
        let blocks = grid_blocks(shape, launch.block_m)?;
        let launch_config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (launch.threads, 1, 1),
            shared_mem_bytes: launch.smem_bytes,
        };
        let (tokens, heads_arg) = (shape.tokens as i32, heads as i32);
        let scale_log2 = shape.scale_log2();
        // [step 08]
        // query heads a head of k and v serves (1 unless they are grouped)
        let q_per_kv = (shape.heads / k.shape.heads) as i32;
        // [/step 08]
        let mut args = self.stream().launch_builder(f);
        args.arg(&q.data)
            .arg(&k.data)
            .arg(&v.data)
            .arg(&mut result.out.data)
            .arg(&mut result.lse)
            .arg(&tokens)
            .arg(&heads_arg)
            .arg(&q_per_kv) // [step 08]
            .arg(&scale_log2);
        // SAFETY: check_device proved q, k, v hold batch·heads·tokens·head_dim values of
        // one dtype, the output was checked to match, lse holds batch·heads·tokens; the
        // grid covers tokens in blocks of BLOCK_M and batch·heads heads, and the kernel
        // writes only rows below `tokens`; the dynamic shared memory is what the kernel's
        // tiles take.
        // [step 08]
        // With grouped heads, k and v hold batch·(heads / q_per_kv)·tokens·head_dim values
        // and query head bh reads their head bh / q_per_kv.
        // [/step 08]
        unsafe { args.launch(launch_config) }
            .map_err(device_error("launching flash_forward"))?;
        Ok(())
    }
    // ANCHOR_END: launch_forward

    /// Host-side entry point: rounds `f32` inputs to `dtype`, runs [`Gpu::forward`] and
    /// returns the output widened back to `f32`.
    pub fn attention(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        self.on_host(q, k, v, dtype, |q, k, v| self.forward(q, k, v))
    }

    /// Host-side entry point for [`Gpu::by_hand`].
    pub fn attention_by_hand(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        self.on_host(q, k, v, dtype, |q, k, v| self.by_hand(q, k, v))
    }

    fn on_host(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
        run: impl FnOnce(
            &DeviceTensor,
            &DeviceTensor,
            &DeviceTensor,
        ) -> Result<DeviceAttention, AttnError>,
    ) -> Result<Attention, AttnError> {
        let shape = check_qkv(&q, &k, &v)?;
        check_head_dim(shape.head_dim)?;
        if shape.is_empty() {
            return Ok(Attention::empty(shape));
        }
        let (q, k, v) = (
            self.upload(q, dtype)?,
            self.upload(k, dtype)?,
            self.upload(v, dtype)?,
        );
        let result = run(&q, &k, &v)?;
        self.download_attention(&result)
    }

    /// Copies a result back: the output widened to `f32`, the log-sum-exp as it is.
    pub fn download_attention(
        &self,
        result: &DeviceAttention,
    ) -> Result<Attention, AttnError> {
        let shape = result.out.shape;
        let out = self.download(&result.out)?;
        let lse = self
            .stream()
            .clone_dtoh(&result.lse)
            .map_err(device_error("copying from the GPU"))?;
        let lse = Array3::from_shape_vec((shape.batch, shape.heads, shape.tokens), lse)
            .expect("b·h·T values");
        Ok(Attention { out, lse })
    }
}

fn check_head_dim(head_dim: usize) -> Result<(), AttnError> {
    if kernel::HEAD_DIMS.contains(&head_dim) {
        Ok(())
    } else {
        Err(kernel::unsupported_head_dim(head_dim))
    }
}

/// That the output buffers were allocated for inputs of this shape and dtype.
pub(crate) fn check_output(
    shape: Shape,
    dtype: Dtype,
    result: &DeviceAttention,
) -> Result<(), AttnError> {
    if result.out.shape != shape
        || result.out.dtype != dtype
        || result.lse.len() != shape.batch * shape.heads * shape.tokens
    {
        return Err(AttnError::ShapeMismatch {
            what: format!(
                "the output buffers are for {} {}, the inputs are {shape} {}",
                result.out.shape,
                result.out.dtype.name(),
                dtype.name()
            ),
        });
    }
    Ok(())
}

/// The checks [`Gpu::forward`] makes before a launch: q, k and v as the runtime takes them
/// ([`check_tensors`](gpu::check_tensors)), a head dim the kernel is compiled for, and sizes
/// its grid can take.
pub fn check_device(
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
) -> Result<Shape, AttnError> {
    let shape = gpu::check_tensors(q, k, v)?;
    check_head_dim(shape.head_dim)?;
    grid_blocks(shape, kernel::BLOCK_M)?;
    Ok(shape)
}

// [step 08]
/// `Ok` when k has as many heads as q; otherwise an error saying that `method` takes one
/// head of k and v for each head of q, not grouped-query attention's fewer.
pub fn same_heads(
    q: &DeviceTensor,
    k: &DeviceTensor,
    method: &str,
) -> Result<(), AttnError> {
    if q.shape.heads == k.shape.heads {
        return Ok(());
    }
    Err(AttnError::Unsupported {
        what: format!(
            "q has {} heads and k and v {}: {method} takes one head of k and v for each \
             head of q (grouped heads are for flash_forward, step 04's backward and step \
             06's kernels)",
            q.shape.heads, k.shape.heads
        ),
    })
}
// [/step 08]

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_limits_name_the_block_the_kernel_uses() {
        let block_m = kernel::BLOCK_M;
        assert_eq!(
            grid_blocks(Shape::new(4, 12, 1000, 64), block_m),
            Ok(4 * 12 * 8)
        );
        let huge = Shape::new(1 << 20, 1 << 20, 1024, 64);
        let err = grid_blocks(huge, block_m).unwrap_err().to_string();
        assert!(
            err.contains(&format!("blocks of {block_m} queries")),
            "{err}"
        );
        assert!(grid_blocks(Shape::new(1, 1, (1 << 30) + 1, 64), block_m).is_err());
    }
}
