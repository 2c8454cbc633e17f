//! One compile for every kernel of the repository. A kernel is described by a value of a
//! type that implements [`KernelSpec`] (its source, its `-D` set, its name, its limits);
//! [`compile`] is the only place that calls NVRTC, with the one set of options every kernel
//! shares ([`OPTIONS`]), and [`Gpu::kernel`](crate::gpu::Gpu::kernel) the only cache of
//! what it compiled.

use std::borrow::Cow;

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use flash_core::AttnError;

/// What NVRTC is told for every kernel, beside the kernel's own `-D` set and its
/// architecture: the C++ dialect the kernels are written in. No include path: each source
/// carries the headers it uses in front of it ([`KernelSpec::source`]), so a kernel
/// compiles wherever NVRTC runs, the binaries carry their kernels, and nothing on the
/// machine can change what is compiled.
pub const OPTIONS: [&str; 1] = ["--std=c++17"];

/// One build of a kernel: everything NVRTC is given for it. Each step's kernels implement
/// it on a typed description (a dtype, a head dim, a tile shape…) that alone turns those
/// into the `-D` set, so that a `.cu` file holds no default that could disagree with Rust.
pub trait KernelSpec {
    /// The module's name: NVRTC's name for the source (what its errors say) and the key of
    /// the compile cache, so it names everything that [`KernelSpec::source`] and
    /// [`KernelSpec::defines`] depend on.
    fn name(&self) -> String;

    /// The source NVRTC compiles, with the headers it uses in front.
    fn source(&self) -> Cow<'_, str>;

    /// The `-D` options, one for each parameter of the source.
    fn defines(&self) -> Vec<String> {
        Vec::new()
    }

    /// That this build can be compiled and launched (the head dims, tile shapes and shared
    /// memory it takes), or an error that names the limit it passes. [`compile`] checks it
    /// before NVRTC runs, so a build is checked once, when its module is first made.
    fn check(&self) -> Result<(), AttnError> {
        Ok(())
    }

    /// The architecture to compile for on a GPU whose own is `device` (`sm_90` on an H100
    /// or H200): the device's, unless the kernel needs a target's features (step 06's
    /// `wgmma` needs `sm_90a`).
    fn arch(&self, device: &'static str) -> &'static str {
        device
    }

    /// The compile cache's key: [`KernelSpec::name`], unless the source can change under
    /// one name (a reader's file in an exercise), where it adds what tells sources apart.
    fn key(&self) -> String {
        self.name()
    }
}

/// Compiles a kernel to PTX for a GPU of architecture `arch`: checks its limits, then runs
/// NVRTC on its source with its `-D` set and [`OPTIONS`]. Errors: the limit the build
/// passes, no NVRTC on this machine, or NVRTC's log.
pub fn compile(spec: &impl KernelSpec, arch: &'static str) -> Result<Ptx, AttnError> {
    spec.check()?;
    require_nvrtc()?;
    let name = spec.name();
    let mut options = spec.defines();
    options.extend(OPTIONS.map(String::from));
    let options = CompileOptions {
        arch: Some(spec.arch(arch)),
        options,
        name: Some(name.clone()),
        ..Default::default()
    };
    compile_ptx_with_opts(spec.source(), options).map_err(|e| compile_error(&name, e))
}

/// A kernel with no parameters: its name and its source (the runtime's `spin`, step 08's
/// `read`).
#[derive(Clone, Copy, Debug)]
pub struct FixedKernel {
    pub name: &'static str,
    pub source: &'static str,
}

impl KernelSpec for FixedKernel {
    fn name(&self) -> String {
        self.name.into()
    }

    fn source(&self) -> Cow<'_, str> {
        self.source.into()
    }
}

/// An NVRTC failure as an [`AttnError`], with the compile log.
fn compile_error(kernel: &str, e: CompileError) -> AttnError {
    let what = match e {
        CompileError::CompileError { log, options, .. } => {
            format!(
                "NVRTC could not compile {kernel} with {options:?}:\n{}",
                log.to_string_lossy()
            )
        }
        other => format!("NVRTC failed on {kernel}: {other:?}"),
    };
    AttnError::Device { what }
}

/// Whether NVRTC's library can be opened on this machine.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the shared library; nothing is called through it
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// An error unless NVRTC can be loaded: a compile without it would panic inside cudarc.
pub fn require_nvrtc() -> Result<(), AttnError> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(missing_nvrtc())
    }
}

/// The error of [`require_nvrtc`] where NVRTC is missing, saying where to get it (a test
/// checks it on machines that have NVRTC too).
pub fn missing_nvrtc() -> AttnError {
    AttnError::Device {
        what: "no NVRTC (libnvrtc.so) found: install the CUDA toolkit (or the nvidia-cuda-nvrtc wheel) and put its lib folder on LD_LIBRARY_PATH".into(),
    }
}
