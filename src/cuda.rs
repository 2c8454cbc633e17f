//! Step 03's GPU methods behind the registry's device hooks: inputs made once on the device,
//! each timed run bracketed by CUDA events on the stream, peak memory from the stream-ordered
//! pool's high-water mark.

use ndarray::ArrayView4;
use step01_naive::inputs::{random_normal, random_qkv};
use step01_naive::{Attention, AttnError, check_qkv};
use step03_cuda_forward::cudarc::driver::sys::CUevent_flags;
use step03_cuda_forward::{DeviceAttention, DeviceTensor, Dtype as GpuDtype, ForwardConfig, Gpu};

use crate::methods::{DeviceHooks, DeviceRun, DeviceRunSpec, Dtype, Grads};

fn gpu_dtype(dtype: Dtype) -> Result<GpuDtype, AttnError> {
    match dtype {
        Dtype::Bf16 => Ok(GpuDtype::Bf16),
        Dtype::F16 => Ok(GpuDtype::F16),
        Dtype::F32 => Err(AttnError::Unsupported {
            what: "the CUDA methods compute in bf16 or f16, not f32: pass --dtype bf16 or f16"
                .into(),
        }),
    }
}

fn describe() -> Result<String, AttnError> {
    Ok(Gpu::shared()?.describe())
}

/// The kernel on host arrays, in bf16: `out` and the log-sum-exp, nothing of size T².
pub fn flash_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    // bad shapes are refused the same way with or without a GPU
    check_qkv(&q, &k, &v)?;
    Gpu::shared()?.attention(q, k, v, GpuDtype::Bf16)
}

/// Attention by hand on the GPU on host arrays, in bf16: cuBLAS, the whole table, a softmax
/// kernel.
pub fn naive_forward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
) -> Result<Attention, AttnError> {
    check_qkv(&q, &k, &v)?;
    Gpu::shared()?.attention_by_hand(q, k, v, GpuDtype::Bf16)
}

/// The backward kernels on host arrays, in bf16, after a forward that returned `fwd`.
pub fn flash_backward(
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    fwd: &Attention,
    dout: ArrayView4<f32>,
) -> Result<Grads, AttnError> {
    let shape = step04_backward::check_backward(&q, &k, &v, fwd, &dout)?;
    let gpu = Gpu::shared()?;
    if shape.is_empty() {
        let z = || ndarray::Array4::zeros(shape.dims());
        return Ok(Grads {
            dq: z(),
            dk: z(),
            dv: z(),
        });
    }
    let up = |x: ArrayView4<f32>| gpu.upload(x, GpuDtype::Bf16);
    let (q, k, v, dout) = (up(q)?, up(k)?, up(v)?, up(dout)?);
    let lse_host = fwd.lse.as_standard_layout();
    let lse = gpu
        .stream()
        .clone_htod(lse_host.as_slice().expect("standard layout"))
        .map_err(step03_cuda_forward::device_error("copying to the GPU"))?;
    let fwd = DeviceAttention {
        out: up(fwd.out.view())?,
        lse,
    };
    let g = step04_backward::cuda::backward(gpu, &q, &k, &v, &fwd, &dout)?;
    Ok(Grads {
        dq: gpu.download(&g.dq)?,
        dk: gpu.download(&g.dk)?,
        dv: gpu.download(&g.dv)?,
    })
}

pub fn flash_implementation() -> String {
    let c = ForwardConfig::for_head_dim(64);
    format!(
        "flash_forward.cu: {} (head dim 64), mma.sync m16n8k16, cp.async two stages, NVRTC; backward (flash_backward.cu): {}",
        c.describe(),
        step04_backward::cuda::BackwardConfig::default().describe()
    )
}

#[derive(Clone, Copy)]
enum Which {
    Flash,
    ByHand,
}

struct Prepared {
    gpu: &'static Gpu,
    which: Which,
    q: DeviceTensor,
    k: DeviceTensor,
    v: DeviceTensor,
    /// The kernel's output buffers, allocated once so that a timed run is the kernel alone.
    out: Option<DeviceAttention>,
    /// The output's gradient, for a forward and backward run.
    dout: Option<DeviceTensor>,
}

fn prepare(which: Which, spec: &DeviceRunSpec) -> Result<Box<dyn DeviceRun>, AttnError> {
    if spec.backward && matches!(which, Which::ByHand) {
        return Err(AttnError::Unsupported {
            what: "attention by hand on the GPU has no backward".into(),
        });
    }
    let gpu = Gpu::shared()?;
    let dtype = gpu_dtype(spec.dtype)?;
    let [q, k, v] = random_qkv(spec.shape, spec.seed);
    let (q, k, v) = (
        gpu.upload(q.view(), dtype)?,
        gpu.upload(k.view(), dtype)?,
        gpu.upload(v.view(), dtype)?,
    );
    let out = match which {
        Which::Flash => Some(gpu.alloc_output(spec.shape, dtype)?),
        Which::ByHand => None,
    };
    let dout = match spec.backward {
        true => Some(gpu.upload(random_normal(spec.shape, spec.seed + 3).view(), dtype)?),
        false => None,
    };
    Ok(Box::new(Prepared {
        gpu,
        which,
        q,
        k,
        v,
        out,
        dout,
    }))
}

impl Prepared {
    fn run_once(&mut self) -> Result<(), AttnError> {
        match (self.which, &mut self.out) {
            (Which::Flash, Some(out)) => {
                self.gpu.forward_into(&self.q, &self.k, &self.v, out)?;
                if let Some(dout) = &self.dout {
                    step04_backward::cuda::backward(
                        self.gpu, &self.q, &self.k, &self.v, out, dout,
                    )?;
                }
                Ok(())
            }
            _ => self.gpu.by_hand(&self.q, &self.k, &self.v).map(drop),
        }
    }
}

impl DeviceRun for Prepared {
    fn time_ms(&mut self) -> Result<f64, AttnError> {
        let ctx = self.gpu.context();
        let event = || {
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| AttnError::Device {
                    what: format!("creating an event: {e}"),
                })
        };
        let (start, end) = (event()?, event()?);
        let device = |e: step03_cuda_forward::cudarc::driver::DriverError| AttnError::Device {
            what: format!("timing: {e}"),
        };
        // the GPU stays busy while the host launches the call: the time is the call's kernels
        self.gpu.spin(500)?;
        start.record(self.gpu.stream()).map_err(device)?;
        self.run_once()?;
        end.record(self.gpu.stream()).map_err(device)?;
        end.synchronize().map_err(device)?;
        Ok(start.elapsed_ms(&end).map_err(device)? as f64)
    }

    fn peak_bytes(&mut self) -> Result<u64, AttnError> {
        // the whole call as a user makes it, output allocation included
        let (q, k, v) = (&self.q, &self.k, &self.v);
        let peak = match self.which {
            Which::Flash => {
                self.gpu
                    .peak_allocated(|| {
                        let fwd = self.gpu.forward(q, k, v)?;
                        match &self.dout {
                            Some(dout) => {
                                step04_backward::cuda::backward(self.gpu, q, k, v, &fwd, dout)
                                    .map(drop)
                            }
                            None => Ok(()),
                        }
                    })?
                    .1
            }
            Which::ByHand => self.gpu.peak_allocated(|| self.gpu.by_hand(q, k, v))?.1,
        };
        peak.ok_or_else(|| AttnError::Device {
            what: "this driver has no stream-ordered memory pool to read a peak from".into(),
        })
    }
}

pub const FLASH_HOOKS: DeviceHooks = DeviceHooks {
    describe,
    prepare: |spec| prepare(Which::Flash, spec),
};
pub const NAIVE_HOOKS: DeviceHooks = DeviceHooks {
    describe,
    prepare: |spec| prepare(Which::ByHand, spec),
};
