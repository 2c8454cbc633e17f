//! The model's matrix products through cuBLAS: bf16 operands, f32 accumulation, and a bf16 or
//! f32 result, in the row-major terms of the model.
//!
//! cuBLAS is column-major. A row-major `[r, c]` matrix is, to cuBLAS, a column-major `[c, r]`
//! one with leading dimension `c`: its transpose. So the row-major product `out = a·b` is asked
//! of cuBLAS as the column-major `outᵀ = bᵀ·aᵀ`, with the operands swapped and no copy.

use std::sync::Arc;

use step03_cuda_forward::Gpu;
use step03_cuda_forward::cudarc::cublas::CudaBlas;
use step03_cuda_forward::cudarc::cublas::result::gemm_ex;
use step03_cuda_forward::cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use step03_cuda_forward::cudarc::driver::CudaContext;

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
    /// Kept in f32: a weight's gradient, or what adds into the residual stream or a LayerNorm's
    /// backward.
    F32,
}

/// One operand: a device pointer to bf16 values, row-major, and whether the product takes its
/// transpose.
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
}

impl Blas {
    pub fn new(gpu: &Gpu) -> Result<Blas, TrainError> {
        // SAFETY: only tries to open the shared library
        if !unsafe { step03_cuda_forward::cudarc::cublas::sys::is_culib_present() } {
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
        })
    }

    // ANCHOR: matmul
    /// `out[m, n] = op(a)[m, k] · op(b)[k, n] + beta · out`, every matrix row-major: `a` is
    /// stored `[m, k]` (or `[k, m]` when transposed), `b` `[k, n]` (or `[n, k]`), `out` `[m, n]`.
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
                    "a matrix product of [{m}, {k}]·[{k}, {n}]: cuBLAS takes sizes below 2^31"
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
        // cuBLAS runs in the calling thread's current context: make it the GPU's (tests call
        // from several threads)
        self.ctx
            .bind_to_thread()
            .map_err(|e| device(format!("binding the GPU's context: {e}")))?;
        // SAFETY: the caller vouches for the pointers; alpha and beta are f32 on the host, as
        // CUBLAS_COMPUTE_32F takes them
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
}
