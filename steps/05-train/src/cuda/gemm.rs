//! The model's matrix products through cuBLAS: bf16 operands, f32 accumulation, and a bf16
//! or f32 result, in the row-major terms of the model.
//!
//! cuBLAS is column-major. A row-major `[r, c]` matrix is, to cuBLAS, a column-major `[c,
//! r]` one with leading dimension `c`: its transpose. So the row-major product `out = a·b`
//! is asked of cuBLAS as the column-major `outᵀ = bᵀ·aᵀ`, with the operands swapped and no
//! copy.

use std::sync::Arc;

use step03_cuda_forward::gpu::Gpu;
use step03_cuda_forward::gpu::cudarc::cublas::CudaBlas;
use step03_cuda_forward::gpu::cudarc::cublas::result::gemm_ex;
use step03_cuda_forward::gpu::cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use step03_cuda_forward::gpu::cudarc::driver::CudaContext;
// [step 06]
use cudarc::cublaslt as lt;
use step03_cuda_forward::gpu::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
// [/step 06]

use flash_core::AttnError;

use crate::TrainError;

fn device(what: String) -> TrainError {
    TrainError::Device(AttnError::Device { what })
}

/// The type a product writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    /// Rounded to bf16: an activation that only feeds the next product or kernel.
    Bf16,
    /// Kept in f32: a weight's gradient, or what adds into the residual stream or a
    /// LayerNorm's backward.
    F32,
}

/// One operand: a device pointer to bf16 values, row-major, and whether the product takes
/// its transpose.
#[derive(Clone, Copy, Debug)]
pub struct Operand {
    pub ptr: u64,
    pub transposed: bool,
}

/// A row-major operand as stored.
pub fn plain(ptr: u64) -> Operand {
    Operand {
        ptr,
        transposed: false,
    }
}

/// The transpose of a row-major operand as stored.
pub fn transposed(ptr: u64) -> Operand {
    Operand {
        ptr,
        transposed: true,
    }
}

/// A cuBLAS handle on the trainer's stream.
pub struct Blas {
    blas: CudaBlas,
    ctx: Arc<CudaContext>,
    lt: BlasLt, // [step 06]
}

impl Blas {
    pub fn new(gpu: &Gpu) -> Result<Blas, TrainError> {
        // SAFETY: only tries to open the shared library
        if !unsafe { step03_cuda_forward::gpu::cudarc::cublas::sys::is_culib_present() } {
            return Err(TrainError::Device(AttnError::Device {
                what: "no cuBLAS (libcublas.so) found: the GPU trainer's matrix products need \
                       it; put the CUDA toolkit's lib64 folder on LD_LIBRARY_PATH"
                    .into(),
            }));
        }
        let blas = CudaBlas::new(gpu.stream().clone())
            .map_err(|e| device(format!("creating a cuBLAS handle: {e:?}")))?;
        Ok(Blas {
            blas,
            ctx: gpu.context().clone(),
            lt: BlasLt::new(gpu)?, // [step 06]
        })
    }

    // ANCHOR: matmul
    /// `out[m, n] = op(a)[m, k] · op(b)[k, n] + beta · out`, every matrix row-major: `a` is
    /// stored `[m, k]` (or `[k, m]` when transposed), `b` `[k, n]` (or `[n, k]`), `out`
    /// `[m, n]`.
    ///
    /// # Safety
    /// Every pointer must hold the values its shape says, on this handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: Operand,
        b: Operand,
        out: u64,
        out_type: Out,
        beta: f32,
    ) -> Result<(), TrainError> {
        use cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let dim = |x: usize| {
            i32::try_from(x).map_err(|_| {
                TrainError::Config(format!(
                    "a matrix product of [{m}, {k}]·[{k}, {n}]: cuBLAS takes sizes below \
                    2^31"
                ))
            })
        };
        let (mi, ni, ki) = (dim(m)?, dim(n)?, dim(k)?);
        // column-major: outᵀ[n, m] = op(b)ᵀ[n, k] · op(a)ᵀ[k, m]
        let (op_b, ld_b) = if b.transposed {
            (CUBLAS_OP_T, ki)
        } else {
            (CUBLAS_OP_N, ni)
        };
        let (op_a, ld_a) = if a.transposed {
            (CUBLAS_OP_T, mi)
        } else {
            (CUBLAS_OP_N, ki)
        };
        let c_type = match out_type {
            Out::Bf16 => cudaDataType_t::CUDA_R_16BF,
            Out::F32 => cudaDataType_t::CUDA_R_32F,
        };
        let alpha = 1.0f32;
        // cuBLAS runs in the calling thread's current context: make it the GPU's (tests
        // call from several threads)
        self.ctx
            .bind_to_thread()
            .map_err(|e| device(format!("binding the GPU's context: {e}")))?;
        // SAFETY: the caller vouches for the pointers; alpha and beta are f32 on the host,
        // as CUBLAS_COMPUTE_32F takes them
        unsafe {
            gemm_ex(
                *self.blas.handle(),
                op_b,
                op_a,
                ni,
                mi,
                ki,
                (&alpha as *const f32).cast(),
                b.ptr as *const _,
                cudaDataType_t::CUDA_R_16BF,
                ld_b,
                a.ptr as *const _,
                cudaDataType_t::CUDA_R_16BF,
                ld_a,
                (&beta as *const f32).cast(),
                out as *mut _,
                c_type,
                ni,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| {
            device(format!(
                "cuBLAS product [{m}, {k}]·[{k}, {n}] failed: {e:?}"
            ))
        })
    }
    // ANCHOR_END: matmul
    // [step 06]

    /// `out[m, n] = op(a)[m, k] · op(b)[k, n] + bias[n]` in bf16, every matrix row-major as
    /// in [`Blas::matmul`], `bias` bf16: through cuBLASLt, whose epilogue adds the bias to
    /// the f32 sums before they are rounded and written, so no kernel passes over `out`
    /// again.
    ///
    /// # Safety
    /// Every pointer must hold the values its shape says, on this handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_bias(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: Operand,
        b: Operand,
        bias: u64,
        out: u64,
    ) -> Result<(), TrainError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| device(format!("binding the GPU's context: {e}")))?;
        // SAFETY: the caller's promise
        unsafe { self.lt.matmul_bias(m, n, k, a, b, bias, out) }.map_err(|e| {
            device(format!(
                "cuBLASLt product [{m}, {k}]·[{k}, {n}] + bias failed: {e:?}"
            ))
        })
    }
    // [/step 06]
}
// [step 06]

/// A cuBLASLt handle and the workspace its products may use (32 MiB, NVIDIA's advice for
/// Hopper), on the trainer's stream.
struct BlasLt {
    handle: lt::sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
}

const LT_WORKSPACE: usize = 32 << 20;

impl BlasLt {
    fn new(gpu: &Gpu) -> Result<BlasLt, TrainError> {
        // SAFETY: only tries to open the shared library
        if !unsafe { lt::sys::is_culib_present() } {
            return Err(device(
                "no cuBLASLt (libcublasLt.so) found: the GPU trainer's products with a bias need \
                 it; put the CUDA toolkit's lib64 folder on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let handle = lt::result::create_handle()
            .map_err(|e| device(format!("creating a cuBLASLt handle: {e:?}")))?;
        let workspace = gpu.stream().alloc_zeros::<u8>(LT_WORKSPACE).map_err(|e| {
            device(format!("allocating cuBLASLt's 32 MiB workspace: {e:?}"))
        })?;
        Ok(BlasLt {
            handle,
            workspace,
            stream: gpu.stream().clone(),
        })
    }

    /// [`Blas::matmul_bias`]: the same column-major swap as [`Blas::matmul`], the bias
    /// along the column-major result's rows (the row-major result's columns).
    ///
    /// # Safety
    /// As [`Blas::matmul_bias`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn matmul_bias(
        &self,
        m: usize,
        n: usize,
        k: usize,
        a: Operand,
        b: Operand,
        bias: u64,
        out: u64,
    ) -> Result<(), lt::result::CublasError> {
        use cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use lt::sys::cublasLtMatmulDescAttributes_t as Desc;
        let bf16 = lt::sys::cudaDataType_t::CUDA_R_16BF;
        let (m, n, k) = (m as u64, n as u64, k as u64);
        // column-major: outᵀ[n, m] = op(b)ᵀ[n, k] · op(a)ᵀ[k, m]; a layout is the matrix as
        // stored: rows, columns, leading dimension
        let (op_b, b_stored) = if b.transposed {
            (CUBLAS_OP_T, (k, n, k))
        } else {
            (CUBLAS_OP_N, (n, k, n))
        };
        let (op_a, a_stored) = if a.transposed {
            (CUBLAS_OP_T, (m, k, m))
        } else {
            (CUBLAS_OP_N, (k, m, k))
        };
        let layout = |(r, c, ld): (u64, u64, u64)| {
            lt::result::create_matrix_layout(bf16, r, c, ld as i64)
        };
        let (la, lb, ld) = (layout(b_stored)?, layout(a_stored)?, layout((n, m, n))?);
        let desc = lt::result::create_matmul_desc(
            lt::sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt::sys::cudaDataType_t::CUDA_R_32F,
        )?;
        let pref = lt::result::create_matmul_pref()?;
        let run = || -> Result<(), lt::result::CublasError> {
            // SAFETY: each attribute's value has the type cuBLASLt documents for it, and
            // lives through the call that copies it
            unsafe {
                let set = |attr: Desc, value: *const std::ffi::c_void, size: usize| {
                    lt::result::set_matmul_desc_attribute(desc, attr, value, size)
                };
                // the operations and the epilogue are 32-bit enums
                let (trans_a, trans_b) = (op_b as i32, op_a as i32);
                let epilogue = lt::sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as u32;
                set(
                    Desc::CUBLASLT_MATMUL_DESC_TRANSA,
                    (&trans_a as *const i32).cast(),
                    4,
                )?;
                set(
                    Desc::CUBLASLT_MATMUL_DESC_TRANSB,
                    (&trans_b as *const i32).cast(),
                    4,
                )?;
                set(
                    Desc::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    (&epilogue as *const u32).cast(),
                    4,
                )?;
                let bias_ptr = bias as *const std::ffi::c_void;
                set(
                    Desc::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&bias_ptr as *const *const std::ffi::c_void).cast(),
                    std::mem::size_of::<*const std::ffi::c_void>(),
                )?;
                let size = LT_WORKSPACE as u64;
                lt::result::set_matmul_pref_attribute(
                    pref,
                    lt::sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&size as *const u64).cast(),
                    8,
                )?;
                let heuristic = lt::result::get_matmul_algo_heuristic(
                    self.handle,
                    desc,
                    la,
                    lb,
                    ld,
                    ld,
                    pref,
                )?;
                let (alpha, beta) = (1.0f32, 0.0f32);
                let (w, _w) = self.workspace.device_ptr(&self.stream);
                lt::result::matmul(
                    self.handle,
                    desc,
                    (&alpha as *const f32).cast(),
                    (&beta as *const f32).cast(),
                    b.ptr as *const _,
                    la,
                    a.ptr as *const _,
                    lb,
                    out as *const _,
                    ld,
                    out as *mut _,
                    ld,
                    &heuristic.algo,
                    w as *mut _,
                    LT_WORKSPACE,
                    self.stream.cu_stream() as *mut _,
                )
            }
        };
        let result = run();
        // SAFETY: created above, used only by the call above, which has been queued
        unsafe {
            lt::result::destroy_matmul_pref(pref)?;
            lt::result::destroy_matmul_desc(desc)?;
            for l in [la, lb, ld] {
                lt::result::destroy_matrix_layout(l)?;
            }
        }
        result
    }
}

impl Drop for BlasLt {
    fn drop(&mut self) {
        // SAFETY: created in new, destroyed once; a failure here leaves nothing to undo
        let _ = unsafe { lt::result::destroy_handle(self.handle) };
    }
}
// [/step 06]
