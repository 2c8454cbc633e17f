//! One trait for every method, so one test table and one benchmark run them all.
//!
//! Each method is a small type in the crate of the step that introduces it
//! (`step01_naive::Naive` is the first) that implements [`Describe`], what the help says
//! about it in one [`Descriptor`] (name, step, device, one line, element types), and
//! [`Method`], its forward pass on host arrays in the element type it is given. What a
//! later step adds to the trait comes with a default that says the method lacks it, so that
//! the methods of earlier steps need not change. Each step exports its methods (its
//! `methods()`); the root crate's registry lists them, one line per step, so that a reader
//! follows a call from the benchmark to the method's type, and from there to the code that
//! computes it. Step 08's decoders share [`Describe`], so the registry resolves a name to
//! either.

use std::any::Any;
use std::fmt;

use ndarray::ArrayView4;
use serde::{Deserialize, Serialize};
// [step 04]
use ndarray::Array4;
// [/step 04]

use crate::{Attention, AttnError};
// [step 03]
use crate::Shape;
// [/step 03]

/// Where a method runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    Cpu,
    // [step 03]
    Cuda,
    // [/step 03]
}

impl Device {
    /// Every device, in the order the help lists them.
    pub const ALL: &[Device] = &[
        Device::Cpu,
        // [step 03]
        Device::Cuda,
        // [/step 03]
    ];

    /// The name the benchmark's `--device` takes and the JSON rows carry as `device_kind`.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            // [step 03]
            Device::Cuda => "cuda",
            // [/step 03]
        }
    }

    /// The element types the methods of this device compute in, the default first: the
    /// CPU's in f32, the GPU's in bf16 or f16.
    pub const fn dtypes(self) -> &'static [Dtype] {
        match self {
            Device::Cpu => &[Dtype::F32],
            // [step 03]
            Device::Cuda => &[Dtype::Bf16, Dtype::F16],
            // [/step 03]
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The element type a run computes in. CPU methods take `f32` ([`check_f32`]); GPU methods
/// say which they take ([`Describe::dtypes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    // [step 03]
    Bf16,
    F16,
    // [/step 03]
}

impl Dtype {
    /// Every dtype, in the order the help lists them.
    pub const ALL: &[Dtype] = &[
        Dtype::F32,
        // [step 03]
        Dtype::Bf16,
        Dtype::F16,
        // [/step 03]
    ];

    /// The name the benchmark's `--dtype` takes and the JSON rows carry.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            // [step 03]
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            // [/step 03]
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            // [step 03]
            Dtype::Bf16 | Dtype::F16 => 2,
            // [/step 03]
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `Ok` for `f32`, the one element type the CPU methods compute in; an error naming it for
/// any other, so that a CPU method never computes in a type other than the one it was asked
/// for.
pub fn check_f32(dtype: Dtype) -> Result<(), AttnError> {
    if dtype == Dtype::F32 {
        return Ok(());
    }
    Err(AttnError::Unsupported {
        what: format!("the CPU methods compute in f32, not {dtype}"),
    })
}

// [step 04]
/// The gradients of a scalar loss with respect to q, k and v, each `[batch, heads, tokens,
/// head_dim]` like the input it belongs to.
#[derive(Clone, Debug, PartialEq)]
pub struct Grads {
    pub dq: Array4<f32>,
    pub dk: Array4<f32>,
    pub dv: Array4<f32>,
}

impl Grads {
    /// Zero gradients of the given shape (also the gradients of an empty call).
    pub fn zeros(shape: crate::Shape) -> Self {
        Grads {
            dq: Array4::zeros(shape.dims()),
            dk: Array4::zeros(shape.dims()),
            dv: Array4::zeros(shape.dims()),
        }
    }
}
// [/step 04]

// [step 03]
/// What the benchmark asks a GPU method to prepare: one shape, one dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRunSpec {
    pub shape: Shape,
    pub dtype: Dtype,
    /// Seed of the random inputs (and of the output's gradient, for a backward).
    pub seed: u64,
    // [step 07]
    /// GPUs to spread one call over (`--gpus`): 1 for every method but those of step 07.
    pub gpus: usize,
    // [/step 07]
}

/// A GPU method with its inputs already on the device, ready to be timed.
///
/// Preparing (compiling kernels, allocating and copying the inputs) happens once, before
/// any timing; each call below then covers the pass alone.
pub trait DeviceRun {
    /// Runs the pass once and returns its time in milliseconds, measured by events recorded
    /// on the stream just before and just after the pass's kernels.
    fn time_ms(&mut self) -> Result<f64, AttnError>;
    /// Runs the pass once and returns the device memory it allocated at its high-water
    /// mark, above what was allocated before it (the inputs): the stream-ordered pool's
    /// `USED_MEM_HIGH` (reset, run, read), or an exact count of the method's allocations.
    fn peak_bytes(&mut self) -> Result<u64, AttnError>;
    /// Runs the pass once and returns what it computed, copied to the host, so the
    /// benchmark can check it before it times it.
    fn result(&mut self) -> Result<Attention, AttnError>;
    // [step 04]
    /// For a forward and backward run: runs both once and returns the gradients, copied to
    /// the host; `None` for a forward alone.
    fn grads(&mut self) -> Result<Option<Grads>, AttnError> {
        Ok(None)
    }
    // [/step 04]
}

/// What a CPU method answers when it is asked about a device or to prepare a run on one.
pub fn not_on_a_device(method: &str) -> AttnError {
    AttnError::Device {
        what: format!("{method} runs on the CPU, not on a GPU"),
    }
}
// [/step 03]

/// What the help says of an entry of the registry, a method or a decoder: one value that
/// its type gives whole, rather than five getters each type restates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Descriptor {
    /// The name `--methods` and `attend --method` take; the registry holds one entry of
    /// each name.
    pub name: &'static str,
    /// The step that introduces it.
    pub step: &'static str,
    pub device: Device,
    /// One line: what it does and what it keeps in memory.
    pub about: &'static str,
    /// The element types it computes in, its default first.
    pub dtypes: &'static [Dtype],
}

impl Descriptor {
    /// `name`, introduced by `step`, on `device`, computing in the device's element types
    /// ([`Device::dtypes`]).
    pub const fn new(
        name: &'static str,
        step: &'static str,
        device: Device,
        about: &'static str,
    ) -> Self {
        Descriptor {
            name,
            step,
            device,
            about,
            dtypes: device.dtypes(),
        }
    }
}

/// What every entry of the registry has, a method or (from step 08) a decoder: its
/// [`Descriptor`]. The getters read it; a type implements [`Describe::descriptor`] alone.
pub trait Describe {
    fn descriptor(&self) -> Descriptor;
    fn name(&self) -> &'static str {
        self.descriptor().name
    }
    fn step(&self) -> &'static str {
        self.descriptor().step
    }
    fn device(&self) -> Device {
        self.descriptor().device
    }
    fn about(&self) -> &'static str {
        self.descriptor().about
    }
    fn dtypes(&self) -> &'static [Dtype] {
        self.descriptor().dtypes
    }
}

/// An attention method: what a reader needs to know to pick it ([`Describe`]), and its
/// passes.
///
/// It is `Any` so that the registry can find a method by its type and put a later step's
/// extension of it in its place: that is how step 04 gives methods of earlier steps a
/// backward.
pub trait Method: Describe + Any + Send + Sync {
    /// What runs on this machine, when that is decided at run time: the SIMD path, the
    /// thread count, the kernel and its tiles. The benchmark prints it next to the name.
    fn implementation(&self) -> String {
        self.about().to_string()
    }
    /// The forward pass on `f32` host arrays `[batch, heads, tokens, head_dim]`, computed
    /// in `dtype` (a GPU method rounds the inputs to it and widens its output back): the
    /// output and each row's log-sum-exp. What the tests and `attend` call.
    fn forward(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError>;
    // [step 03]
    /// For a GPU method: one line about the device (name, compute capability, driver and
    /// NVRTC versions) for the benchmark's header; `AttnError::Device` when there is no
    /// usable device.
    fn describe_device(&self) -> Result<String, AttnError> {
        Err(not_on_a_device(self.name()))
    }
    /// For a GPU method: random inputs of `spec` made on the device, and the forward on
    /// them ready to be timed (what the benchmark measures on a GPU).
    fn prepare_forward(
        &self,
        _spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        Err(not_on_a_device(self.name()))
    }
    // [/step 03]
    // [step 04]
    /// Whether it has a backward pass: what `--backward` and `attend --dout` choose by. A
    /// method that has one overrides this and [`Method::backward`] (and, on a GPU,
    /// [`Method::prepare_backward`]).
    fn has_backward(&self) -> bool {
        false
    }
    /// The backward pass on host arrays, computed in `dtype`: q, k, v, what the forward
    /// returned for them (its log-sum-exp lets the backward rebuild the probabilities
    /// without a stored table), and the gradient of the output `dout` in; dq, dk and dv
    /// out. [`AttnError::NoBackward`] for a method without one.
    fn backward(
        &self,
        _q: ArrayView4<f32>,
        _k: ArrayView4<f32>,
        _v: ArrayView4<f32>,
        _fwd: &Attention,
        _dout: ArrayView4<f32>,
        _dtype: Dtype,
    ) -> Result<Grads, AttnError> {
        Err(AttnError::NoBackward {
            method: self.name().into(),
        })
    }
    /// For a GPU method with a backward: the forward and the backward prepared together on
    /// the device, as [`Method::prepare_forward`] prepares the forward.
    fn prepare_backward(
        &self,
        _spec: &DeviceRunSpec,
    ) -> Result<Box<dyn DeviceRun>, AttnError> {
        Err(AttnError::NoBackward {
            method: self.name().into(),
        })
    }
    // [/step 04]
    // [step 07]
    /// Whether its runs prepared on the device spread one call over [`DeviceRunSpec::gpus`]
    /// GPUs (`--gpus`).
    fn multi_gpu(&self) -> bool {
        false
    }
    // [/step 07]
}

/// A method prints as its name: the registry holds one method of each name.
impl fmt::Debug for dyn Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
