//! Masks on any GPU from Ampere: the mask's source compiled by NVRTC into copies of step
//! 03's forward and step 04's backward (mma.sync, ldmatrix, cp.async), walking the same
//! block mask as the Hopper kernels ([`DeviceMask`], made with blocks of 128 queries).
//!
//! [`Kernels`] says which family runs: the Hopper kernels on compute capability 9.0, these
//! on 8.x (and on 9.0 when asked, so that a Hopper machine can test them).
//! [`crate::cuda::forward`] and [`crate::cuda::backward`] pick them by the block mask's
//! [`Kernels`].
//!
//! # Layout
//!
//! - `kernels/masked_ampere_forward.cu`: step 03's forward, its blocks of keys from the
//!   list, the score function on every block and the mask on the partial ones.
//! - `kernels/masked_ampere_backward.cu`: step 04's δ, dK/dV pass (one block per 128 keys,
//!   the backward list's query tiles streaming past) and dQ pass (one block per 128
//!   queries, the forward list's key blocks streaming past).

use std::borrow::Cow;

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use flash_core::{AttnError, Shape};
use step03_cuda_forward::DeviceAttention;
use step03_cuda_forward::gpu::{DeviceTensor, Dtype, Gpu, KernelSpec, device_error};
use step03_cuda_forward::kernel::TENSOR_CORES_CUH;
use step04_backward::cuda::{DeviceGrads, launch_delta};
use step06_hopper::forward::check_hopper;

use crate::cuda::{
    DeviceMask, GpuMask, MASKED_CUH, check_backward_inputs, check_qkv, zero_grads,
};

/// Step 03's forward and step 04's backward with the mask's functions.
pub const MASKED_AMPERE_FORWARD_CU: &str =
    include_str!("../kernels/masked_ampere_forward.cu");
pub const MASKED_AMPERE_BACKWARD_CU: &str =
    include_str!("../kernels/masked_ampere_backward.cu");

/// The head dims the Ampere kernels are compiled for: the Hopper kernels' (step 06's).
pub const HEAD_DIMS: [usize; 2] = [64, 128];

// The tiles the two kernel files fix, as their launches need them; a test below reads them
// in the sources.

/// Queries per block of the forward and of the dQ pass, and keys per block of the dK/dV
/// pass: 128, two of the block mask's tiles of 64 queries, one of its blocks of 128 keys.
pub const BLOCK_ROWS: usize = 128;
/// The forward's threads: step 03's four warps of 32 rows.
pub const FORWARD_THREADS: u32 = 128;
/// Queries streamed past the dK/dV pass's keys, and keys past the dQ pass's queries, per
/// stage: one of the backward list's query tiles; half a forward list's block of keys.
pub const STREAM: usize = 64;

/// Keys per block of the forward at a head dim (step 03's `BLOCK_N`): 128 up to head dim 64,
/// 64 at 128 (a block of the list then takes two).
pub fn forward_block_n(head_dim: usize) -> usize {
    if head_dim <= 64 { 128 } else { 64 }
}

/// The forward's shared memory: a tile of q, two stages each of k and v.
pub fn forward_smem_bytes(head_dim: usize) -> u32 {
    ((BLOCK_ROWS + 4 * forward_block_n(head_dim)) * head_dim * 2) as u32
}

/// The backward's threads: step 04's eight warps of 16 rows (its shape at head dim 128) at
/// both head dims.
pub const BACKWARD_THREADS: u32 = 256;

/// The dK/dV pass's shared memory: its keys and values, two stages of queries' q and dO
/// with their log-sum-exps and δs.
pub fn dkdv_smem_bytes(head_dim: usize) -> u32 {
    ((2 * BLOCK_ROWS + 4 * STREAM) * head_dim * 2 + 4 * STREAM * 4) as u32
}

/// The dQ pass's shared memory: its queries and dO, two stages of keys' k and v.
pub fn dq_smem_bytes(head_dim: usize) -> u32 {
    ((2 * BLOCK_ROWS + 4 * STREAM) * head_dim * 2) as u32
}

/// Which kernels run the masks: step 06's (wgmma and TMA, compute capability 9.0 only) or
/// steps 03's and 04's (mma.sync, any GPU from Ampere).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernels {
    Hopper,
    Ampere,
}

impl Kernels {
    /// The kernels for this GPU: Hopper's on compute capability 9.0, Ampere's on the others
    /// (the GPU runtime opens 8.0 and newer only).
    pub fn for_gpu(gpu: &Gpu) -> Result<Kernels, AttnError> {
        let (major, minor) = gpu
            .context()
            .compute_capability()
            .map_err(device_error("reading the compute capability"))?;
        Ok(Kernels::for_capability(major, minor))
    }

    /// [`Kernels::for_gpu`] for compute capability `major.minor`: `wgmma` and TMA as step 06
    /// uses them exist on 9.0 alone (`sm_90a`), `mma.sync` on every GPU from 8.0.
    pub fn for_capability(major: i32, minor: i32) -> Kernels {
        if (major, minor) == (9, 0) {
            Kernels::Hopper
        } else {
            Kernels::Ampere
        }
    }

    /// That this GPU runs these kernels: the Hopper kernels need compute capability 9.0.
    pub fn check(self, gpu: &Gpu) -> Result<(), AttnError> {
        match self {
            Kernels::Hopper => check_hopper(gpu),
            Kernels::Ampere => Ok(()),
        }
    }

    /// The name a flag takes and a row of measurements carries.
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Hopper => "hopper",
            Kernels::Ampere => "ampere",
        }
    }
}

impl std::str::FromStr for Kernels {
    type Err = String;

    fn from_str(s: &str) -> Result<Kernels, String> {
        match s {
            "hopper" => Ok(Kernels::Hopper),
            "ampere" => Ok(Kernels::Ampere),
            _ => Err(format!(
                "{s:?}: the kernels are `hopper` (step 06's, compute capability 9.0) or \
                 `ampere` (steps 03's and 04's, any GPU from 8.0)"
            )),
        }
    }
}

/// Which of the two Ampere kernel files a build compiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The masked forward on step 03's kernel.
    Forward,
    /// The masked backward on step 04's kernels (δ, dK/dV, dQ).
    Backward,
}

/// One of the masked Ampere kernel files, for a mask, a dtype and a head dim.
#[derive(Clone, Copy, Debug)]
pub struct MaskedAmpereKernel<'a> {
    pub pass: Pass,
    pub mask: &'a GpuMask,
    pub dtype: Dtype,
    pub head_dim: usize,
}

/// A head dim the kernels are compiled for.
fn check_head_dim(head_dim: usize) -> Result<(), AttnError> {
    if HEAD_DIMS.contains(&head_dim) {
        Ok(())
    } else {
        Err(AttnError::UnsupportedHeadDim {
            head_dim,
            supported: HEAD_DIMS.map(|d| d.to_string()).join(", "),
        })
    }
}

impl KernelSpec for MaskedAmpereKernel<'_> {
    fn name(&self) -> String {
        match self.pass {
            Pass::Forward => "masked_ampere_forward.cu",
            Pass::Backward => "masked_ampere_backward.cu",
        }
        .into()
    }

    fn source(&self) -> Cow<'_, str> {
        let body = match self.pass {
            Pass::Forward => MASKED_AMPERE_FORWARD_CU,
            Pass::Backward => MASKED_AMPERE_BACKWARD_CU,
        };
        format!(
            "{TENSOR_CORES_CUH}\n{}\n{MASKED_CUH}\n{body}",
            self.mask.source
        )
        .into()
    }

    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DIS_BF16={}", (self.dtype == Dtype::Bf16) as u8),
        ]
    }

    fn check(&self) -> Result<(), AttnError> {
        check_head_dim(self.head_dim)
    }

    /// The mask's key and everything the build changes.
    fn key(&self) -> String {
        let pass = match self.pass {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        };
        let (mask, dtype, d) = (&self.mask.key, self.dtype, self.head_dim);
        format!("masked ampere {pass} {mask} {dtype:?} d{d}")
    }
}

/// That a grid's dimension holds `n` blocks: `max` is 2^31 − 1 for x, 65,535 for y.
fn check_grid(n: usize, max: usize, what: &str) -> Result<u32, AttnError> {
    if n > max {
        return Err(AttnError::Unsupported {
            what: format!("{what}: {n} blocks, at most {max} in one launch"),
        });
    }
    Ok(n as u32)
}

/// [`crate::cuda::forward`] on step 03's kernel: the output and each row's log-sum-exp (a
/// row that sees no key: zeros and −∞). One block per 128 queries of a query head.
pub fn forward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    mask: &DeviceMask,
) -> Result<DeviceAttention, AttnError> {
    let kv = check_qkv(q, k, v)?;
    mask.check_shape(q.shape, kv)?;
    let mut result = gpu.alloc_output(q.shape, q.dtype)?;
    if q.shape.is_empty() {
        return Ok(result);
    }
    let (shape, dtype, d) = (q.shape, q.dtype, q.shape.head_dim);
    let batch_heads = shape.batch * shape.heads;
    let blocks = check_grid(
        shape.tokens.div_ceil(BLOCK_ROWS) * batch_heads,
        i32::MAX as usize,
        "the masked forward's blocks of 128 queries",
    )?;
    let spec = MaskedAmpereKernel {
        pass: Pass::Forward,
        mask: mask.mask(),
        dtype,
        head_dim: d,
    };
    let smem = forward_smem_bytes(d);
    let f = gpu.kernel(&spec, "masked_forward", smem)?;
    let list = mask.list(true, gpu);
    let data = mask.data_ptr(gpu);
    let (tq, tk) = (shape.tokens as i32, kv.tokens as i32);
    let (heads, batch_heads) = (shape.heads as i32, batch_heads as i32);
    let q_per_kv = (shape.heads / kv.heads) as i32;
    let scale = 1.0 / (d as f32).sqrt();
    let scale_log2 = shape.scale_log2();
    let stream = gpu.stream();
    let (out, _out) = result.out.data.device_ptr_mut(stream);
    let (lse, _lse) = result.lse.device_ptr_mut(stream);
    let mut launch = stream.launch_builder(&f);
    launch
        .arg(&q.data)
        .arg(&k.data)
        .arg(&v.data)
        .arg(&out)
        .arg(&lse)
        .arg(&tq)
        .arg(&tk)
        .arg(&heads)
        .arg(&batch_heads)
        .arg(&q_per_kv)
        .arg(&list)
        .arg(&data)
        .arg(&scale)
        .arg(&scale_log2);
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (FORWARD_THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    // SAFETY: q, k and v were checked to hold their shapes' values (k's heads dividing q's);
    // the lists were made for this shape (check_shape) and name blocks below tk's; each
    // block writes the output and lse of its own query rows below tq
    unsafe { launch.launch(config) }.map_err(device_error("launching masked_forward"))?;
    drop((_out, _lse));
    Ok(result)
}

/// [`crate::cuda::backward`] on step 04's kernels: δ, then dK and dV for each query head
/// (one block per 128 keys), then dQ (one block per 128 queries); with grouped heads each
/// group's dK and dV are summed into its head of k and v.
pub fn backward(
    gpu: &Gpu,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    fwd: &DeviceAttention,
    dout: &DeviceTensor,
    mask: &DeviceMask,
) -> Result<DeviceGrads, AttnError> {
    let kv = check_qkv(q, k, v)?;
    mask.check_shape(q.shape, kv)?;
    check_backward_inputs(q, fwd, dout)?;
    let shape = q.shape;
    let (dtype, d) = (q.dtype, shape.head_dim);
    // dK and dV for every query head (k's length), summed over each group at the end
    let per_q = Shape {
        tokens: kv.tokens,
        ..shape
    };
    let mut grads = zero_grads(gpu, shape, per_q, dtype)?;
    if shape.is_empty() || kv.is_empty() {
        return Ok(grads);
    }
    let what = "the masked backward's blocks of 128";
    let k_blocks = check_grid(kv.tokens.div_ceil(BLOCK_ROWS), 65_535, what)?;
    let q_blocks = check_grid(shape.tokens.div_ceil(BLOCK_ROWS), 65_535, what)?;
    let spec = MaskedAmpereKernel {
        pass: Pass::Backward,
        mask: mask.mask(),
        dtype,
        head_dim: d,
    };
    let stream = gpu.stream();
    // δ by step 04's launch of the kernel file's copy of its backward_delta
    let delta = launch_delta(gpu, &gpu.kernel(&spec, "backward_delta", 0)?, fwd, dout)?;
    let list_k = mask.list(false, gpu);
    let list_q = mask.list(true, gpu);
    let data = mask.data_ptr(gpu);
    let (tq, tk) = (shape.tokens as i32, kv.tokens as i32);
    let heads = shape.heads as i32;
    let q_per_kv = (shape.heads / kv.heads) as i32;
    let scale = 1.0 / (d as f32).sqrt();
    let lse = fwd.lse.device_ptr(stream).0;
    let delta_ptr = delta.device_ptr(stream).0;
    let batch_heads = (shape.batch * shape.heads) as u32;
    let threads = BACKWARD_THREADS;
    {
        let smem = dkdv_smem_bytes(d);
        let f = gpu.kernel(&spec, "masked_dkdv", smem)?;
        let (dk, _dk) = grads.dk.data.device_ptr_mut(stream);
        let (dv, _dv) = grads.dv.data.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&q.data)
            .arg(&k.data)
            .arg(&v.data)
            .arg(&dout.data)
            .arg(&lse)
            .arg(&delta_ptr)
            .arg(&dk)
            .arg(&dv)
            .arg(&tq)
            .arg(&tk)
            .arg(&heads)
            .arg(&q_per_kv)
            .arg(&list_k)
            .arg(&data)
            .arg(&scale);
        let config = LaunchConfig {
            grid_dim: (batch_heads, k_blocks, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: the tensors were checked to hold their shapes' values; each block writes
        // dk and dv of its own keys below tk for its query head (per_q's shape, as
        // allocated); the backward's lists were made for this shape
        unsafe { launch.launch(config) }.map_err(device_error("launching masked_dkdv"))?;
    }
    {
        let smem = dq_smem_bytes(d);
        let f = gpu.kernel(&spec, "masked_dq", smem)?;
        let (dq, _dq) = grads.dq.data.device_ptr_mut(stream);
        let mut launch = stream.launch_builder(&f);
        launch
            .arg(&q.data)
            .arg(&k.data)
            .arg(&v.data)
            .arg(&dout.data)
            .arg(&lse)
            .arg(&delta_ptr)
            .arg(&dq)
            .arg(&tq)
            .arg(&tk)
            .arg(&heads)
            .arg(&q_per_kv)
            .arg(&list_q)
            .arg(&data)
            .arg(&scale);
        let config = LaunchConfig {
            grid_dim: (batch_heads, q_blocks, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem,
        };
        // SAFETY: as above; each block writes dq of its own query rows below tq (q's
        // shape, as allocated); the forward's lists were made for this shape
        unsafe { launch.launch(config) }.map_err(device_error("launching masked_dq"))?;
    }
    // grouped-query attention: each group's dk and dv into its head of k and v
    if kv.heads != shape.heads {
        grads.dk = step04_backward::cuda::sum_groups(gpu, &grads.dk, kv)?;
        grads.dv = step04_backward::cuda::sum_groups(gpu, &grads.dv, kv)?;
    }
    Ok(grads)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `#define NAME ...` gives NAME in `source`, without its comment.
    fn defined<'a>(source: &'a str, name: &str) -> Vec<&'a str> {
        let start = format!("#define {name} ");
        source
            .lines()
            .filter_map(|l| l.strip_prefix(&start))
            .map(|v| v.split("//").next().unwrap_or(v).trim())
            .collect()
    }

    /// The sizes the launches use are the ones the kernel files fix.
    #[test]
    fn the_launches_use_the_tiles_the_kernels_fix() {
        let forward = [
            ("WARPS", "4".to_string()),
            ("M_TILES", "2".into()),
            (
                "BLOCK_N",
                format!(
                    "(HEAD_DIM <= 64 ? {} : {})",
                    forward_block_n(64),
                    forward_block_n(128)
                ),
            ),
            ("LIST_N", crate::cuda::TILE_K.to_string()),
        ];
        assert_eq!(FORWARD_THREADS, 4 * 32);
        assert_eq!(BLOCK_ROWS, 4 * 2 * 16);
        for (name, value) in forward {
            assert_eq!(
                defined(MASKED_AMPERE_FORWARD_CU, name),
                [value.as_str()],
                "kernels/masked_ampere_forward.cu's {name}"
            );
        }
        let backward = [
            ("WARPS", (BACKWARD_THREADS / 32).to_string()),
            ("M_TILES", "1".into()),
            ("DKDV_STREAM", STREAM.to_string()),
            ("DQ_STREAM", STREAM.to_string()),
            ("LIST_N", crate::cuda::TILE_K.to_string()),
        ];
        assert_eq!(STREAM, crate::cuda::TILE_Q);
        for (name, value) in backward {
            assert_eq!(
                defined(MASKED_AMPERE_BACKWARD_CU, name),
                [value.as_str()],
                "kernels/masked_ampere_backward.cu's {name}"
            );
        }
    }

    #[test]
    fn only_compute_capability_9_0_runs_the_hopper_kernels() {
        assert_eq!(Kernels::for_capability(9, 0), Kernels::Hopper);
        for (major, minor) in [(8, 0), (8, 6), (8, 9), (10, 0), (12, 0)] {
            assert_eq!(Kernels::for_capability(major, minor), Kernels::Ampere);
        }
    }

    #[test]
    fn kernels_are_named_by_their_flag() {
        for k in [Kernels::Hopper, Kernels::Ampere] {
            assert_eq!(k.name().parse::<Kernels>(), Ok(k));
        }
        let e = "volta".parse::<Kernels>().unwrap_err();
        assert!(e.contains("hopper") && e.contains("ampere"), "{e}");
    }
}
