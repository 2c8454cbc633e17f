//! One warpgroup, one tile: `S = Q·Kᵀ` from shared memory and `O = bf16(S)·V` with `P` from
//! registers (`kernels/wgmma_probe.cu`), checked against the same products on the host.

use std::borrow::Cow;

use cudarc::driver::sys::CUtensorMapDataType;
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use flash_core::AttnError;
use flash_core::inputs::SplitMix64;
use half::bf16;
use step03_cuda_forward::gpu::{Gpu, KernelSpec, device_error};

use step06_hopper::forward::{TensorMap, encode_tiled};

/// The probe kernel's source.
pub const WGMMA_PROBE_CU: &str = include_str!("../kernels/wgmma_probe.cu");
/// Rows and columns of every tile.
pub const N: usize = 64;
/// Dynamic shared memory: three 8 KiB tiles and room to align them on 1024 bytes.
const SMEM: u32 = 3 * 8192 + 1024;

/// The probe's build: no parameters, for `sm_90a`, the target with `wgmma`.
#[derive(Clone, Copy, Debug)]
pub struct WgmmaProbe;

impl KernelSpec for WgmmaProbe {
    fn name(&self) -> String {
        "wgmma_probe.cu".into()
    }

    fn source(&self) -> Cow<'_, str> {
        WGMMA_PROBE_CU.into()
    }

    fn arch(&self, _device: &'static str) -> &'static str {
        "sm_90a"
    }
}

/// The byte offsets a pair of descriptors is made with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offsets {
    pub leading: u32,
    pub stride: u32,
}

/// The largest differences of S and O from the host's products.
#[derive(Clone, Copy, Debug)]
pub struct ProbeError {
    pub s: f64,
    pub o: f64,
}

/// Random bf16 tiles: values as bits and as f64.
fn tile(seed: u64) -> (Vec<u16>, Vec<f64>) {
    let mut rng = SplitMix64::new(seed);
    let vals: Vec<bf16> = (0..N * N)
        .map(|_| bf16::from_f64(rng.next_unit() * 2.0 - 1.0))
        .collect();
    (
        vals.iter().map(|x| x.to_bits()).collect(),
        vals.iter().map(|x| x.to_f64()).collect(),
    )
}

/// The map of one 64×64 bf16 tile, row-major, read in one 64×64 box in the 128-byte
/// swizzle.
fn tile_map(gpu: &Gpu, tile: &CudaSlice<u16>) -> Result<TensorMap, AttnError> {
    let (ptr, _sync) = tile.device_ptr(gpu.stream());
    let n = N as u64;
    // SAFETY: ptr is a live allocation of 64×64 bf16 values, 256-byte aligned
    unsafe {
        encode_tiled(
            ptr,
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            &[n, n],
            &[2 * n],
            &[N as u32, N as u32],
        )
    }
    .map_err(|r| AttnError::Device {
        what: format!("cuTensorMapEncodeTiled: {r:?}"),
    })
}

/// How the probe brings its tiles into shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Load {
    /// Ordinary stores, swizzled by the threads.
    Threads,
    /// Bulk tensor copies (TMA), swizzled by the copy engine.
    Tma,
}

/// Runs the probe with the K-major descriptors' offsets `qk` and V's `v`; returns the
/// largest absolute errors of S and of O against the host.
pub fn run(
    gpu: &Gpu,
    load: Load,
    qk: Offsets,
    v: Offsets,
) -> Result<ProbeError, AttnError> {
    let entry = match load {
        Load::Threads => "wgmma_probe",
        Load::Tma => "wgmma_probe_tma",
    };
    let f = gpu.kernel(&WgmmaProbe, entry, SMEM)?;
    let (qb, qf) = tile(1);
    let (kb, kf) = tile(2);
    let (vb, vf) = tile(3);
    let stream = gpu.stream();
    let up = |x: &[u16]| {
        stream
            .clone_htod(x)
            .map_err(device_error("copying to the GPU"))
    };
    let (dq, dk, dv) = (up(&qb)?, up(&kb)?, up(&vb)?);
    let mut ds = stream
        .alloc_zeros::<f32>(N * N)
        .map_err(device_error("allocating S"))?;
    let mut d_o = stream
        .alloc_zeros::<f32>(N * N)
        .map_err(device_error("allocating O"))?;
    let config = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: SMEM,
    };
    let maps = match load {
        Load::Tma => Some([
            tile_map(gpu, &dq)?,
            tile_map(gpu, &dk)?,
            tile_map(gpu, &dv)?,
        ]),
        Load::Threads => None,
    };
    let mut launch = stream.launch_builder(&f);
    match &maps {
        Some([mq, mk, mv]) => launch.arg(mq).arg(mk).arg(mv),
        None => launch.arg(&dq).arg(&dk).arg(&dv),
    };
    launch
        .arg(&mut ds)
        .arg(&mut d_o)
        .arg(&qk.leading)
        .arg(&qk.stride)
        .arg(&v.leading)
        .arg(&v.stride);
    // SAFETY: every buffer holds 64×64 values; the kernel reads and writes exactly those
    unsafe { launch.launch(config) }.map_err(device_error("launching wgmma_probe"))?;
    let s = stream
        .clone_dtoh(&ds)
        .map_err(device_error("copying S back"))?;
    let o = stream
        .clone_dtoh(&d_o)
        .map_err(device_error("copying O back"))?;
    let mut err = ProbeError { s: 0.0, o: 0.0 };
    for i in 0..N {
        for j in 0..N {
            let want: f64 = (0..N).map(|d| qf[i * N + d] * kf[j * N + d]).sum();
            err.s = err.s.max((want - s[i * N + j] as f64).abs());
        }
        for d in 0..N {
            // P as the kernel rounds it, from the kernel's own S
            let want: f64 = (0..N)
                .map(|j| bf16::from_f32(s[i * N + j]).to_f64() * vf[j * N + d])
                .sum();
            err.o = err.o.max((want - o[i * N + d] as f64).abs());
        }
    }
    Ok(err)
}
