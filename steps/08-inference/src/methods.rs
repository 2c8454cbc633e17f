//! Step 08's methods for the registry: decoders, query rows against a cache. They take
//! inputs the other methods do not, `q` `[batch, q_heads, q_rows, head_dim]` against `k`
//! and `v` `[batch, kv_heads, context, head_dim]` (the causal diagonal at the cache's end,
//! `q_heads` a multiple of `kv_heads`), so they are a list of their own beside the
//! forward methods of [`flash_core::method::Method`]: `attend` runs either.

use flash_core::method::{Device, Dtype, check_f32};
use flash_core::{Attention, AttnError};
use ndarray::ArrayView4;
use step03_cuda_forward::gpu::Gpu;

use crate::cuda::CacheLayout;
use crate::pages::PAGE_SIZE;

/// The chunk of keys [`DecodeSplit`] merges: a split of the GPU kernel at batch 1 and 128k
/// tokens (16 splits of 8,192).
pub const SPLIT_CHUNK: usize = 8192;

// ANCHOR: decoder
/// A decoding method: what the help says about it, and the attention of `q`'s rows against
/// the cache `k`, `v`, computed in `dtype`.
pub trait Decoder: Send + Sync {
    /// The name `attend --method` takes.
    fn name(&self) -> &'static str;
    fn device(&self) -> Device;
    /// One line: what it does.
    fn about(&self) -> &'static str;
    /// The element types it computes in, its default first.
    fn dtypes(&self) -> &'static [Dtype] {
        &[Dtype::F32]
    }
    /// Each query row's output and log-sum-exp.
    fn decode(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError>;
}
// ANCHOR_END: decoder

/// [`crate::decode()`]: step 02's loop, a query row at a time.
pub struct Decode;
/// [`crate::decode_split`]: the keys in chunks of [`SPLIT_CHUNK`], merged through their
/// log-sum-exps.
pub struct DecodeSplit;
/// [`crate::cuda::decode`] on a cache laid out as `layout`, the split
/// [`plan_splits`](crate::cuda::plan_splits) chooses.
pub struct FlashDecode {
    name: &'static str,
    about: &'static str,
    pub layout: CacheLayout,
}

/// The decoding kernel on a contiguous cache.
pub static FLASH_DECODE: FlashDecode = FlashDecode {
    name: "flash_decode",
    about: "flash-decoding: the keys split over thread blocks, merged by the last to finish",
    layout: CacheLayout::Contiguous,
};

/// The decoding kernel on a cache in pages of [`PAGE_SIZE`] tokens.
pub static FLASH_DECODE_PAGED: FlashDecode = FlashDecode {
    name: "flash_decode_paged",
    about: "flash_decode on a cache in pages of 64 tokens (PAGE_SIZE), read through a page table",
    layout: CacheLayout::Paged {
        page_size: PAGE_SIZE,
    },
};

impl Decoder for Decode {
    fn name(&self) -> &'static str {
        "decode"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn about(&self) -> &'static str {
        "query rows against a cache, step 02's loop a row; grouped-query heads"
    }
    fn decode(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_f32(dtype)?;
        crate::decode(q, k, v)
    }
}

impl Decoder for DecodeSplit {
    fn name(&self) -> &'static str {
        "decode_split"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn about(&self) -> &'static str {
        "decode with the keys in chunks of 8,192, merged through their log-sum-exps"
    }
    fn decode(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        check_f32(dtype)?;
        crate::decode_split(q, k, v, SPLIT_CHUNK)
    }
}

impl Decoder for FlashDecode {
    fn name(&self) -> &'static str {
        self.name
    }
    fn device(&self) -> Device {
        Device::Cuda
    }
    fn about(&self) -> &'static str {
        self.about
    }
    fn dtypes(&self) -> &'static [Dtype] {
        &[Dtype::Bf16, Dtype::F16]
    }
    fn decode(
        &self,
        q: ArrayView4<f32>,
        k: ArrayView4<f32>,
        v: ArrayView4<f32>,
        dtype: Dtype,
    ) -> Result<Attention, AttnError> {
        let gpu = Gpu::shared()?;
        crate::cuda::decode(gpu, q, k, v, dtype, self.layout, None)
    }
}

/// Step 08's decoders, CPU first.
pub fn decoders() -> Vec<&'static dyn Decoder> {
    vec![&Decode, &DecodeSplit, &FLASH_DECODE, &FLASH_DECODE_PAGED]
}
