//! This step's part of the registry: it gives the methods of earlier steps their backward, by
//! name, without touching their lines: `naive` the backward by hand, `online` the blockwise
//! backward, `cuda_flash` the backward kernels (on host arrays, and prepared on the device
//! with its forward for the benchmark).

use flash_core::inputs::random_normal;
use flash_core::method::{DeviceHooks, DeviceRun, DeviceRunSpec};
use flash_core::{Attention, AttnError, Dtype, Method};
use ndarray::ArrayView4;
use step03_cuda_forward::methods::{describe, prepare_inputs};
use step03_cuda_forward::{DeviceAttention, DeviceTensor, Gpu, device_error};

use crate::{BackwardFn, Grads, check_backward, cuda};
use flash_core::method::BackwardDtypeFn;

/// A method's backward: on host arrays, in the element type asked for where it takes one,
/// and prepared on the device for the benchmark.
type Backwards = (
    &'static str,
    BackwardFn,
    Option<BackwardDtypeFn>,
    Option<DeviceHooks>,
);

/// Which backward goes with which method of the earlier steps.
const BACKWARDS: &[Backwards] = &[
    // the tables P and dP, [b, h, T, T] each
    ("naive", crate::backward_by_hand, None, None),
    // P rebuilt from the log-sum-exp a block at a time
    ("online", crate::backward, None, None),
    // δ, then dK and dV per block of keys, then dQ per block of queries
    (
        "cuda_flash",
        flash_backward,
        Some(flash_backward_dtype),
        Some(FLASH_HOOKS),
    ),
];

/// Gives each method of `methods` that has a backward in this step its backward.
pub fn add_backwards(methods: &mut [Method]) {
    for m in methods.iter_mut() {
        if let Some(&(_, host, dtype, gpu)) = BACKWARDS.iter().find(|(name, ..)| *name == m.name) {
            m.backward = Some(host);
            m.backward_dtype = dtype;
            m.gpu_backward = gpu;
        }
    }
}

/// The backward kernels on host arrays, in bf16, after a forward that returned `fwd`.
pub fn flash_backward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
) -> Result<Grads, AttnError> {
    flash_backward_dtype(q, k, v, fwd, dout, Dtype::Bf16)
}

/// [`flash_backward`] in bf16 or f16.
pub fn flash_backward_dtype(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
    dtype: Dtype,
) -> Result<Grads, AttnError> {
    let shape = check_backward(&q, &k, &v, fwd, &dout)?;
    let dtype = step03_cuda_forward::half_dtype(dtype)?;
    let gpu = Gpu::shared()?;
    if shape.is_empty() {
        return Ok(Grads::zeros(shape));
    }
    let up = |x: ArrayView4<f32>| gpu.upload(x, dtype);
    let (q, k, v, dout) = (up(q)?, up(k)?, up(v)?, up(dout)?);
    let lse_host = fwd.lse.as_standard_layout();
    let lse = gpu
        .stream()
        .clone_htod(lse_host.as_slice().expect("standard layout"))
        .map_err(device_error("copying to the GPU"))?;
    let fwd = DeviceAttention {
        out: up(fwd.out.view())?,
        lse,
    };
    let g = cuda::backward(gpu, &q, &k, &v, &fwd, &dout)?;
    download_grads(gpu, &g)
}

fn download_grads(gpu: &Gpu, g: &cuda::DeviceGrads) -> Result<Grads, AttnError> {
    Ok(Grads {
        dq: gpu.download(&g.dq)?,
        dk: gpu.download(&g.dk)?,
        dv: gpu.download(&g.dv)?,
    })
}

/// The forward kernel of step 03 and the backward kernels, prepared together on the device.
struct Prepared {
    gpu: &'static Gpu,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    dout: DeviceTensor,
    /// The forward's output buffers, allocated once so that a timed run is the kernels alone.
    out: DeviceAttention,
}

fn prepare(spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
    let gpu = Gpu::shared()?;
    let [q, k, v] = prepare_inputs(spec)?;
    let dout = gpu.upload(random_normal(spec.shape, spec.seed + 3).view(), q.dtype)?;
    let out = gpu.alloc_output(spec.shape, q.dtype)?;
    Ok(Box::new(Prepared {
        gpu,
        q,
        k,
        v,
        dout,
        out,
    }))
}

impl DeviceRun for Prepared {
    fn time_ms(&mut self) -> Result<f64, AttnError> {
        let (gpu, q, k, v, dout, out) = (
            self.gpu,
            &self.q,
            &self.k,
            &self.v,
            &self.dout,
            &mut self.out,
        );
        gpu.time_ms(|| {
            gpu.forward_into(q, k, v, out)?;
            cuda::backward(gpu, q, k, v, out, dout)
        })
    }

    fn peak_bytes(&mut self) -> Result<u64, AttnError> {
        // the whole call as a user makes it, output allocation included
        let (gpu, q, k, v, dout) = (self.gpu, &self.q, &self.k, &self.v, &self.dout);
        let peak = gpu
            .peak_allocated(|| {
                let fwd = gpu.forward(q, k, v)?;
                cuda::backward(gpu, q, k, v, &fwd, dout).map(drop)
            })?
            .1;
        peak.ok_or_else(|| AttnError::Device {
            what: "this driver has no stream-ordered memory pool to read a peak from".into(),
        })
    }

    fn result(&mut self) -> Result<Attention, AttnError> {
        let fwd = self.gpu.forward(&self.q, &self.k, &self.v)?;
        self.gpu.download_attention(&fwd)
    }

    fn grads(&mut self) -> Result<Option<Grads>, AttnError> {
        let (gpu, q, k, v, dout) = (self.gpu, &self.q, &self.k, &self.v, &self.dout);
        let fwd = gpu.forward(q, k, v)?;
        let g = cuda::backward(gpu, q, k, v, &fwd, dout)?;
        download_grads(gpu, &g).map(Some)
    }
}

/// `cuda_flash`'s forward and backward, for the benchmark.
pub const FLASH_HOOKS: DeviceHooks = DeviceHooks { describe, prepare };
