//! Attention by hand on the GPU, the analogue of step 01 and of the tutorial's PyTorch by hand:
//! cuBLAS writes the whole `[batch·heads, T, T]` table of scaled scores to device memory, a
//! softmax kernel turns it into probabilities in place, and cuBLAS multiplies it by v. Its
//! memory grows with T², so at long lengths it runs out of memory where the kernel does not.

use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use flash_core::AttnError;
use half::{bf16, f16};

use crate::{DeviceAttention, DeviceTensor, Dtype, Gpu, check_device, device_error};

/// Bytes attention by hand takes on the GPU beyond its inputs: the table, the output and the
/// log-sum-exp.
pub fn by_hand_bytes(q: &DeviceTensor) -> u128 {
    let s = q.shape;
    let heads = (s.batch * s.heads) as u128;
    heads * (s.tokens as u128).pow(2) * 2 + s.len() as u128 * 2 + heads * s.tokens as u128 * 4
}

impl Gpu {
    // ANCHOR: by_hand_gpu
    /// Causal attention by hand on the GPU: `S = q·kᵀ/√d` for every head into one table,
    /// softmax of each row with the mask, `out = S·v`. Fails with `OutOfMemory` when the table
    /// does not fit.
    pub fn by_hand(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
    ) -> Result<DeviceAttention, AttnError> {
        let shape = check_device(q, k, v)?;
        let mut result = self.alloc_output(shape, q.dtype)?;
        if shape.is_empty() {
            return Ok(result);
        }
        let (heads, t, d) = (
            (shape.batch * shape.heads) as i64,
            shape.tokens as i64,
            shape.head_dim as i64,
        );
        let table_len = (heads * t * t) as usize;
        // SAFETY: uninitialised device memory is never read: the first product writes every
        // entry (beta = 0, so cuBLAS does not read it) before the softmax reads any
        let table: Result<CudaSlice<u16>, _> = unsafe { self.stream().alloc(table_len) };
        let mut table = table.map_err(|e| match device_error("")(e) {
            AttnError::OutOfMemory { .. } => AttnError::OutOfMemory {
                what: format!("attention by hand's [{heads}, {t}, {t}] table of scores"),
                bytes: table_len as u128 * 2,
            },
            other => other,
        })?;
        let rows = heads as usize * shape.tokens;
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        match q.dtype {
            Dtype::Bf16 => {
                let (s, w) = products(heads, t, d, bf16::from_f32(scale), bf16::ONE, bf16::ZERO);
                self.gemm(s, &k.data, &q.data, &mut table)?;
                self.softmax(q.dtype, &mut table, &mut result.lse, shape.tokens, rows)?;
                self.gemm(w, &v.data, &table, &mut result.out.data)?;
            }
            Dtype::F16 => {
                let (s, w) = products(heads, t, d, f16::from_f32(scale), f16::ONE, f16::ZERO);
                self.gemm(s, &k.data, &q.data, &mut table)?;
                self.softmax(q.dtype, &mut table, &mut result.lse, shape.tokens, rows)?;
                self.gemm(w, &v.data, &table, &mut result.out.data)?;
            }
            Dtype::F32 => {
                crate::half_dtype(q.dtype)?;
            }
        }
        Ok(result)
    }
    // ANCHOR_END: by_hand_gpu

    /// One strided batched product on 16-bit values stored as raw bits.
    fn gemm<T>(
        &self,
        cfg: StridedBatchedConfig<T>,
        a: &CudaSlice<u16>,
        b: &CudaSlice<u16>,
        c: &mut CudaSlice<u16>,
    ) -> Result<(), AttnError>
    where
        cudarc::cublas::CudaBlas: Gemm<T>,
    {
        let blas = self.blas()?;
        let (a_len, b_len, c_len) = (a.len(), b.len(), c.len());
        // SAFETY: bf16 and f16 are 16-bit values with the layout of u16 (repr(transparent))
        let a: CudaView<'_, T> = unsafe { a.transmute(a_len) }.expect("same size");
        let b: CudaView<'_, T> = unsafe { b.transmute(b_len) }.expect("same size");
        let mut c: CudaViewMut<'_, T> = unsafe { c.transmute_mut(c_len) }.expect("same size");
        // SAFETY: the caller's configs read stride·batch values of a and b and write those of c,
        // within the buffers check_device and the allocations above sized
        unsafe { blas.gemm_strided_batched(cfg, &a, &b, &mut c) }.map_err(|e| AttnError::Device {
            what: format!("cuBLAS: {e:?}"),
        })
    }

    fn softmax(
        &self,
        dtype: Dtype,
        table: &mut CudaSlice<u16>,
        lse: &mut CudaSlice<f32>,
        tokens: usize,
        rows: usize,
    ) -> Result<(), AttnError> {
        let f = self.softmax_kernel(dtype)?;
        const WARPS: usize = 8;
        let config = LaunchConfig {
            grid_dim: (rows.div_ceil(WARPS) as u32, 1, 1),
            block_dim: (32 * WARPS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (t, rows) = (tokens as i32, rows as i64);
        let mut launch = self.stream().launch_builder(&f);
        launch.arg(table).arg(lse).arg(&t).arg(&rows);
        // SAFETY: the table holds rows·T values and lse rows values; each warp touches one row
        unsafe { launch.launch(config) }.map_err(device_error("launching causal_softmax"))?;
        Ok(())
    }
}

/// The two products of attention by hand as cuBLAS calls, one batch entry per head. cuBLAS is
/// column-major: a row-major [T, D] matrix is a column-major [D, T] one, so row-major
/// `S = scale·q·kᵀ` is column-major `Sᵀ = scale·k·qᵀ` (k transposed, q as it is), and row-major
/// `out = P·v` is column-major `outᵀ = vᵀ·Pᵀ` (both as they are).
fn products<T: Copy>(
    heads: i64,
    t: i64,
    d: i64,
    scale: T,
    one: T,
    zero: T,
) -> (StridedBatchedConfig<T>, StridedBatchedConfig<T>) {
    let (ti, di) = (t as i32, d as i32);
    let scores = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: CUBLAS_OP_T,
            transb: CUBLAS_OP_N,
            m: ti,
            n: ti,
            k: di,
            alpha: scale,
            lda: di,
            ldb: di,
            beta: zero,
            ldc: ti,
        },
        batch_size: heads as i32,
        stride_a: t * d,
        stride_b: t * d,
        stride_c: t * t,
    };
    let weighted = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: CUBLAS_OP_N,
            transb: CUBLAS_OP_N,
            m: di,
            n: ti,
            k: ti,
            alpha: one,
            lda: di,
            ldb: ti,
            beta: zero,
            ldc: di,
        },
        batch_size: heads as i32,
        stride_a: t * d,
        stride_b: t * t,
        stride_c: t * d,
    };
    (scores, weighted)
}
