//! Opening NCCL: one communicator per GPU of the ring, with errors that say what is
//! missing.
//!
//! NCCL is opened at run time like the CUDA driver, so everything here compiles and the CPU
//! tests run without it; a run that needs it and finds none gets [`AttnError::Device`]
//! saying where to put it.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use cudarc::nccl::result::NcclError;
use cudarc::nccl::safe::Comm;
use flash_core::AttnError;
use step03_cuda_forward::gpu::Gpu;

/// Whether NCCL's library can be opened (cudarc looks for `libnccl.so` and, on the folders
/// of `LD_LIBRARY_PATH`, a few versioned names).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to open the shared library
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// An NCCL failure as an [`AttnError`], naming what was being done and NCCL's own code.
pub fn nccl_error(what: &str) -> impl Fn(NcclError) -> AttnError + '_ {
    move |e| AttnError::Device {
        what: format!("{what}: NCCL returned {:?}", e.0),
    }
}

/// One communicator for each stream's GPU, rank `i` on `streams[i]` (`ncclCommInitAll`):
/// the GPUs must be distinct, and NCCL must be there.
pub fn communicators(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Comm>, AttnError> {
    if !nccl_present() {
        return Err(AttnError::Device {
            what: "no NCCL library (libnccl.so) found: install NCCL 2.28 or newer (the \
                   nvidia-nccl-cu13 wheel has it as nvidia/nccl/lib/libnccl.so.2: link it as \
                   libnccl.so) and put its folder on LD_LIBRARY_PATH"
                .into(),
        });
    }
    let mut ordinals: Vec<usize> = streams.iter().map(|s| s.context().ordinal()).collect();
    ordinals.sort_unstable();
    ordinals.dedup();
    if ordinals.len() != streams.len() {
        return Err(AttnError::Unsupported {
            what: format!(
                "NCCL takes one rank per GPU; {} ranks were asked of {} GPUs",
                streams.len(),
                ordinals.len()
            ),
        });
    }
    Comm::from_devices(streams).map_err(nccl_error("opening NCCL's communicators"))
}

/// GPUs `0 .. n`, each opened once for the process, or an error saying how many there are.
pub fn gpus(n: usize) -> Result<Vec<&'static Gpu>, AttnError> {
    let there = Gpu::count();
    if n == 0 || n > there {
        return Err(AttnError::Unsupported {
            what: format!("{n} GPUs asked for; this machine has {there}"),
        });
    }
    (0..n).map(Gpu::shared_on).collect()
}
