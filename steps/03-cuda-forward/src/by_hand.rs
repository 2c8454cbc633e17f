//! Attention by hand on the GPU, the analogue of step 01 and of the tutorial's PyTorch by
//! hand: cuBLAS writes the whole `[batch·heads, T, T]` table of scaled scores to device
//! memory, a softmax kernel turns it into probabilities in place, and cuBLAS multiplies it
//! by v. Its memory grows with T², so at long lengths it runs out of memory where the
//! kernel does not.

use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use flash_core::{AttnError, Shape};
use half::{bf16, f16};

use crate::gpu::{DeviceTensor, Dtype, Gpu, device_error, half_dtype};
use crate::{DeviceAttention, check_device};

/// Bytes attention by hand takes on the GPU beyond its inputs: the table, the output and
/// the log-sum-exp.
pub fn by_hand_bytes(q: &DeviceTensor) -> u128 {
    let s = q.shape;
    let heads = (s.batch * s.heads) as u128;
    heads * (s.tokens as u128).pow(2) * 2
        + s.len() as u128 * 2
        + heads * s.tokens as u128 * 4
}

impl Gpu {
    // ANCHOR: by_hand_gpu
    /// Causal attention by hand on the GPU: `S = q·kᵀ/√d` for every head into one table,
    /// softmax of each row with the mask, `out = S·v`. Fails with `OutOfMemory` when the
    /// table does not fit.
    pub fn by_hand(
        &self,
        q: &DeviceTensor,
        k: &DeviceTensor,
        v: &DeviceTensor,
    ) -> Result<DeviceAttention, AttnError> {
        let shape = check_device(q, k, v)?;
        crate::same_heads(q, k, "attention by hand")?; // [step 08]
        let mut result = self.alloc_output(shape, q.dtype)?;
        if shape.is_empty() {
            return Ok(result);
        }
        let (heads, t, d) = (
            (shape.batch * shape.heads) as i64,
            shape.tokens as i64,
            shape.head_dim as i64,
        );
        // SAFETY: uninitialised device memory is never read: the first product writes every
        // entry (beta = 0, so cuBLAS does not read it) before the softmax reads any
        let mut table =
            unsafe { self.alloc_table(shape, "attention by hand's", "scores") }?;
        let rows = heads as usize * shape.tokens;
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        match q.dtype {
            Dtype::Bf16 => {
                let (s, w) =
                    products(heads, t, d, bf16::from_f32(scale), bf16::ONE, bf16::ZERO);
                self.gemm(s, &k.data, &q.data, &mut table)?;
                self.softmax(q.dtype, &mut table, &mut result.lse, shape.tokens, rows)?;
                self.gemm(w, &v.data, &table, &mut result.out.data)?;
            }
            Dtype::F16 => {
                let (s, w) =
                    products(heads, t, d, f16::from_f32(scale), f16::ONE, f16::ZERO);
                self.gemm(s, &k.data, &q.data, &mut table)?;
                self.softmax(q.dtype, &mut table, &mut result.lse, shape.tokens, rows)?;
                self.gemm(w, &v.data, &table, &mut result.out.data)?;
            }
            Dtype::F32 => {
                half_dtype(q.dtype)?;
            }
        }
        Ok(result)
    }
    // ANCHOR_END: by_hand_gpu

    /// A `[batch·heads, T, T]` table of 16-bit values for `shape`, left uninitialised; when
    /// it does not fit (or its size overflows), `OutOfMemory` naming `whose` table of
    /// `what` and its bytes.
    ///
    /// # Safety
    ///
    /// The caller writes every entry before anything reads it.
    pub unsafe fn alloc_table(
        &self,
        shape: Shape,
        whose: &str,
        what: &str,
    ) -> Result<CudaSlice<u16>, AttnError> {
        let (heads, t) = (shape.batch * shape.heads, shape.tokens);
        let len = heads
            .checked_mul(t)
            .and_then(|n| n.checked_mul(t))
            .filter(|&n| n <= isize::MAX as usize / 2);
        let bytes = heads as u128 * (t as u128).pow(2) * 2;
        let oom = || AttnError::OutOfMemory {
            what: format!("{whose} [{heads}, {t}, {t}] table of {what}"),
            bytes,
        };
        let len = len.ok_or_else(oom)?;
        // SAFETY: the caller's promise
        unsafe { self.stream().alloc(len) }.map_err(|e| match device_error("")(e) {
            AttnError::OutOfMemory { .. } => oom(),
            other => other,
        })
    }

    /// One strided batched product on 16-bit values stored as raw bits, with a config from
    /// [`products`] (later steps run their own products on the table through here).
    pub fn gemm<T>(
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
        let mut c: CudaViewMut<'_, T> =
            unsafe { c.transmute_mut(c_len) }.expect("same size");
        // SAFETY: the caller's configs read stride·batch values of a and b and write those
        // of c, within the buffers check_device and the allocations above sized
        unsafe { blas.gemm_strided_batched(cfg, &a, &b, &mut c) }.map_err(|e| {
            AttnError::Device {
                what: format!("cuBLAS: {e:?}"),
            }
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
        let config = warp_per_row(rows, "causal_softmax")?;
        let (t, rows) = (tokens as i32, rows as i64);
        let mut launch = self.stream().launch_builder(&f);
        launch.arg(table).arg(lse).arg(&t).arg(&rows);
        // SAFETY: the table holds rows·T values and lse rows values; each warp touches one
        // row
        unsafe { launch.launch(config) }
            .map_err(device_error("launching causal_softmax"))?;
        Ok(())
    }
}

/// A launch of a kernel that gives each row of a table one warp, 8 warps a block; an error
/// naming `kernel` when the rows need more blocks than a grid takes.
pub fn warp_per_row(rows: usize, kernel: &str) -> Result<LaunchConfig, AttnError> {
    const WARPS: usize = 8;
    let blocks = u32::try_from(rows.div_ceil(WARPS))
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| AttnError::Unsupported {
            what: format!(
                "{kernel} takes at most 2^31 - 1 blocks of {WARPS} rows (sequences × heads × tokens / {WARPS}); there are {rows} rows"
            ),
        })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The two products of attention by hand as cuBLAS calls, one batch entry per head. cuBLAS
/// is column-major: a row-major [T, D] matrix is a column-major [D, T] one, so row-major
/// `S = scale·q·kᵀ` is column-major `Sᵀ = scale·k·qᵀ` (k transposed, q as it is), and
/// row-major `out = P·v` is column-major `outᵀ = vᵀ·Pᵀ` (both as they are). `scores_alpha`
/// multiplies the first product (the scale), `weighted_alpha` the second (1); `zero` is
/// beta, so neither reads what its output held.
pub fn products<T: Copy>(
    heads: i64,
    t: i64,
    d: i64,
    scores_alpha: T,
    weighted_alpha: T,
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
            alpha: scores_alpha,
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
            alpha: weighted_alpha,
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
