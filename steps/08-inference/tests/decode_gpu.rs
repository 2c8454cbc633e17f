//! The decoding kernel on a GPU, on a contiguous cache and on pages, against the `f64`
//! reference with FlashAttention's rule: its error at most twice that of attention by hand
//! in the same precision. Ignored where there is no GPU (`cargo test -- --include-ignored`
//! runs them on one); the checks of the page table and the split run everywhere.

use flash_core::inputs::random_normal;
use flash_core::reference::error;
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array3, Array4, ArrayView4};
use step03_cuda_forward::host::round_array;
use step03_cuda_forward::{Dtype, Gpu};
use step08_inference::DecodeShape;
use step08_inference::cuda::{
    HostLayout, KvCache, Layout, Occupancy, cache_value, check_table, decode, fill_cache,
    fixed_splits, most_splits, plan_splits, read_bytes, shuffled_table,
};
use step08_inference::kernel::KEY_GROUP;
use step08_inference::reference::{by_hand_rows_low_precision, decode_f64};

/// FlashAttention's rule: our max error ≤ 2 × by-hand's max error in the same precision,
/// plus a margin for the case where both are (nearly) zero.
const MARGIN: f64 = 1e-5;
/// The kernel's log-sum-exp is summed in f32 from the 16-bit inputs' exact products.
const KERNEL_LSE: f64 = 1e-3;

fn inputs(shape: DecodeShape, seed: u64) -> [Array4<f32>; 3] {
    let [b, h, n, d] = shape.q_dims();
    let kv = Shape::new(b, shape.kv_heads, shape.context, d);
    [
        random_normal(Shape::new(b, h, n, d), 3 * seed),
        random_normal(kv, 3 * seed + 1),
        random_normal(kv, 3 * seed + 2),
    ]
}

// ANCHOR: check_decode_gpu
fn check(
    gpu: &Gpu,
    shape: DecodeShape,
    dtype: Dtype,
    layout: HostLayout,
    splits: Option<usize>,
) {
    let [q, k, v] = inputs(shape, shape.context as u64 + shape.q_rows as u64);
    let name = format!("{shape} {} {layout:?} splits {splits:?}", dtype.name());
    let got = decode(gpu, q.view(), k.view(), v.view(), dtype, layout, splits)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    // the reference sees exactly the values the GPU saw
    let (q, k, v) = (
        round_array(q.view(), dtype),
        round_array(k.view(), dtype),
        round_array(v.view(), dtype),
    );
    assert_rule(&name, &got, q.view(), k.view(), v.view(), dtype);
}

/// The rule for `got`, decoded from q, k and v as rounded to `dtype`.
fn assert_rule(
    name: &str,
    got: &Attention,
    q: ArrayView4<f32>,
    k: ArrayView4<f32>,
    v: ArrayView4<f32>,
    dtype: Dtype,
) {
    let reference = decode_f64(q, k, v).unwrap();
    let by_hand = by_hand_rows_low_precision(q, k, v, dtype).unwrap();
    let ours = error(&got.out, &reference.out);
    let by_hand = error(&by_hand, &reference.out);
    let lse = error(&got.lse, &reference.lse);
    println!("{name}: ours {ours}; by hand {by_hand}; lse {lse}");
    assert!(
        ours.max_abs <= 2.0 * by_hand.max_abs + MARGIN,
        "{name}: out max abs error {:.3e} > 2 × by hand's {:.3e} (+{MARGIN:e})",
        ours.max_abs,
        by_hand.max_abs
    );
    assert!(lse.max_abs < KERNEL_LSE, "{name}: lse {lse}");
}
// ANCHOR_END: check_decode_gpu

/// (batch, q heads, kv heads, q rows, context, head dim): with and without GQA, one and
/// four query rows, contexts that are no multiple of a block's step (64 to 256 keys) or a
/// page, 16 and 32 query rows on one kv head, the context equal to the rows.
const SHAPES: [(usize, usize, usize, usize, usize, usize); 9] = [
    (1, 32, 8, 1, 1000, 128),
    (2, 8, 8, 1, 777, 64),
    (3, 16, 4, 4, 2049, 128),
    (1, 8, 1, 4, 3001, 64),
    (2, 4, 2, 1, 1, 64),
    (1, 4, 4, 4, 4, 128),
    (4, 32, 8, 4, 517, 64),
    (1, 16, 2, 4, 1500, 128),
    (2, 12, 12, 1, 300, 32),
];

// ANCHOR: gpu_tests
#[test]
#[ignore = "needs a CUDA GPU"]
fn decoding_matches_the_reference_within_twice_by_hand_error() {
    let gpu = Gpu::shared().expect("a GPU");
    println!("{}", gpu.describe());
    for &(b, h, kv, n, t, d) in &SHAPES {
        let shape = DecodeShape::new(b, h, kv, n, t, d);
        // the split the plan chooses (many at batch 1), none, and an odd count
        for splits in [None, Some(1), Some(3)] {
            check(gpu, shape, Dtype::Bf16, HostLayout::Contiguous, splits);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_decoding_matches_the_reference() {
    let gpu = Gpu::shared().expect("a GPU");
    for &(b, h, kv, n, t, d) in &SHAPES {
        let shape = DecodeShape::new(b, h, kv, n, t, d);
        for page_size in [16, 64] {
            let layout = HostLayout::Paged { page_size };
            check(gpu, shape, Dtype::Bf16, layout, None);
            check(gpu, shape, Dtype::Bf16, layout, Some(2));
        }
    }
}
// ANCHOR_END: gpu_tests

// ANCHOR: lens_test
/// Sequences of one batch at lengths of their own (`KvCache::set_lens`, read by the kernel
/// from memory): each sequence's rows against the reference over its own tokens only, the
/// diagonal at its own end, contiguous and paged, the plan's split and three.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sequences_of_different_lengths_each_decode_to_their_own_end() {
    use ndarray::s;
    use step08_inference::cuda::{alloc_output, decode_into, plan};
    let gpu = Gpu::shared().expect("a GPU");
    let shape = DecodeShape::new(3, 8, 2, 2, 700, 64);
    let lens = [700, 333, 2];
    let [q, k, v] = inputs(shape, 5);
    let (q, k, v) = (
        round_array(q.view(), Dtype::Bf16),
        round_array(k.view(), Dtype::Bf16),
        round_array(v.view(), Dtype::Bf16),
    );
    for layout in [HostLayout::Contiguous, HostLayout::Paged { page_size: 64 }] {
        let mut cache = match layout {
            HostLayout::Contiguous => KvCache::upload(gpu, k.view(), v.view(), Dtype::Bf16),
            HostLayout::Paged { page_size } => {
                KvCache::upload_paged(gpu, k.view(), v.view(), Dtype::Bf16, page_size, 3)
            }
        }
        .unwrap();
        cache.set_lens(gpu, &lens).unwrap();
        let page_size = cache.page_size();
        for split in [
            plan(gpu, shape, Dtype::Bf16, page_size).unwrap(),
            fixed_splits(700, 3, 128),
        ] {
            let q_dev = gpu.upload(q.view(), Dtype::Bf16).unwrap();
            let mut result = alloc_output(gpu, shape, Dtype::Bf16, split.splits).unwrap();
            decode_into(gpu, &q_dev, &cache, split, &mut result).unwrap();
            let out = gpu.download(&result.out).unwrap();
            let lse = gpu.stream().clone_dtoh(&result.lse).unwrap();
            let lse = Array3::from_shape_vec((3, 8, 2), lse).unwrap();
            for (b, &n) in lens.iter().enumerate() {
                // sequence b's rows, against its own first n keys and values only
                let got = Attention {
                    out: out.slice(s![b..b + 1, .., .., ..]).to_owned(),
                    lse: lse.slice(s![b..b + 1, .., ..]).to_owned(),
                };
                let name = format!("{layout:?} {split:?}, sequence {b} of {n} tokens");
                let [qb, kb, vb] = [
                    q.slice(s![b..b + 1, .., .., ..]),
                    k.slice(s![b..b + 1, .., ..n, ..]),
                    v.slice(s![b..b + 1, .., ..n, ..]),
                ];
                assert_rule(&name, &got, qb, kb, vb, Dtype::Bf16);
            }
        }
    }
}
// ANCHOR_END: lens_test

#[test]
#[ignore = "needs a CUDA GPU"]
fn lengths_past_the_cache_are_refused() {
    let gpu = Gpu::shared().expect("a GPU");
    let mut cache = KvCache::alloc(gpu, [2, 1, 100, 64], Dtype::Bf16).unwrap();
    let e = cache.set_lens(gpu, &[100, 101]).unwrap_err().to_string();
    assert!(e.contains("each 0 to 100"), "{e}");
    let e = cache.set_lens(gpu, &[5]).unwrap_err().to_string();
    assert!(e.contains("one length a sequence"), "{e}");
    // nothing was taken from the refused lengths
    assert_eq!(cache.keys, 100);
    cache.set_lens(gpu, &[7, 0]).unwrap();
    assert_eq!(cache.keys, 7);
    cache.set_lens(gpu, &[100, 0]).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn f16_caches_decode_too() {
    let gpu = Gpu::shared().expect("a GPU");
    for (b, h, kv, n, t, d) in [(1, 32, 8, 1, 1000, 128), (2, 8, 2, 4, 333, 64)] {
        let shape = DecodeShape::new(b, h, kv, n, t, d);
        check(gpu, shape, Dtype::F16, HostLayout::Contiguous, None);
        check(
            gpu,
            shape,
            Dtype::F16,
            HostLayout::Paged { page_size: 32 },
            None,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_and_contiguous_give_the_same_bits() {
    // the same keys in the same order through a table: the same sums, bit for bit
    let gpu = Gpu::shared().expect("a GPU");
    let shape = DecodeShape::new(2, 16, 4, 2, 1234, 128);
    let [q, k, v] = inputs(shape, 3);
    let run = |layout| decode(gpu, q.view(), k.view(), v.view(), Dtype::Bf16, layout, None);
    let a = run(HostLayout::Contiguous).unwrap();
    let b = run(HostLayout::Paged { page_size: 64 }).unwrap();
    assert_eq!(a.out, b.out);
    assert_eq!(a.lse, b.lse);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_benchmark_fill_is_what_the_host_computes() {
    // decode-bench checks its results against caches it makes again on the host
    let gpu = Gpu::shared().expect("a GPU");
    let dims = [2, 3, 100, 64];
    let mut flat = KvCache::alloc(gpu, dims, Dtype::Bf16).unwrap();
    fill_cache(gpu, &mut flat, 11).unwrap();
    let table = shuffled_table(2, 2, 5);
    let mut paged =
        KvCache::alloc_paged(gpu, dims, Dtype::Bf16, 64, 4, table.clone()).unwrap();
    fill_cache(gpu, &mut paged, 11).unwrap();
    let bits = |x| gpu.stream().clone_dtoh(x).unwrap();
    let (k, v, pk) = (bits(&flat.k), bits(&flat.v), bits(&paged.k));
    let widen = |b: u16| half::bf16::from_bits(b).to_f32();
    for e in 0..k.len() {
        assert_eq!(widen(k[e]), cache_value(11, e as u64), "k[{e}]");
        assert_eq!(widen(v[e]), cache_value(12, e as u64), "v[{e}]");
        let (d, j, bk) = (e % 64, e / 64 % 100, e / 6400);
        let (b, h) = (bk / 3, bk % 3);
        let page = table[b * 2 + j / 64] as usize;
        assert_eq!(
            pk[((page * 3 + h) * 64 + j % 64) * 64 + d],
            k[e],
            "paged k[{e}]"
        );
    }
    // and the read kernel reads every word of both
    let mut sums = gpu.stream().alloc_zeros::<u32>(4096).unwrap();
    read_bytes(gpu, &flat.k, &flat.v, &mut sums).unwrap();
    let sums = gpu.stream().clone_dtoh(&sums).unwrap();
    let words = |x: &[u16]| {
        x.chunks(2)
            .fold(0u32, |a, w| a ^ (w[0] as u32 | (w[1] as u32) << 16))
    };
    assert_eq!(sums.iter().fold(0, |a, s| a ^ s), words(&k) ^ words(&v));
    assert!(matches!(flat.layout, Layout::Contiguous));
}

// ANCHOR: page_table_test
#[test]
fn a_page_table_that_points_past_the_pool_is_refused() {
    // 2 sequences of 100 tokens in pages of 16: 7 pages each, 14 in the pool
    let mut table = shuffled_table(2, 7, 1);
    assert!(check_table(&table, 2, 7, 14, 16, 100).is_ok());
    table[7 + 3] = 14;
    let e = check_table(&table, 2, 7, 14, 16, 100)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("entry 3 of sequence 1 (tokens 48 to 63) is page 14")
            && e.contains("the pool holds 14 pages"),
        "{e}"
    );
    table[7 + 3] = -1;
    assert!(check_table(&table, 2, 7, 14, 16, 100).is_err());
    // an entry past the pages a sequence uses is never read
    let mut padded = shuffled_table(2, 8, 1);
    padded.iter_mut().for_each(|p| *p %= 14);
    padded[7] = -1;
    padded[15] = 99;
    assert!(check_table(&padded, 2, 8, 14, 16, 100).is_ok());
    let e = check_table(&table, 2, 6, 14, 16, 100)
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_pages at least 7"), "{e}");
    // pages of a group and a half (24 tokens): a group of keys would span two pages
    let e = check_table(&table, 2, 7, 14, KEY_GROUP * 3 / 2, 100)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("a multiple of {KEY_GROUP} tokens")),
        "{e}"
    );
}
// ANCHOR_END: page_table_test

// ANCHOR: split_test
#[test]
fn the_split_gives_each_multiprocessor_its_blocks_and_no_split_is_too_short() {
    // the H200's 132 multiprocessors: two blocks each, one streams; a block's step is 64
    // keys at head dim 128 and 128 keys at head dim 64 (4 warps × 4 KB of keys)
    let d128 = Occupancy {
        sms: 132,
        blocks_per_sm: 2,
        streaming: 1,
        block_keys: 64,
    };
    let d64 = Occupancy {
        block_keys: 128,
        ..d128
    };
    // batch 1 with 8 kv heads: 16 splits, 128 blocks, one a multiprocessor
    let p = plan_splits(8, 131_072, d128);
    assert_eq!((p.splits, p.split_keys), (16, 8192));
    assert_eq!(plan_splits(8, 131_072, d64), p);
    // 32 kv heads: 4 splits; 8 sequences × 8 kv heads: 2
    assert_eq!(plan_splits(32, 131_072, d128).splits, 4);
    assert_eq!(plan_splits(64, 131_072, d128).splits, 2);
    // more pairs than that: waves over the slots. 32 sequences × 8 kv heads fill 97% of
    // the 264 slots, one split; 64 sequences' 512 blocks fill 97% of two waves, one split
    assert_eq!(plan_splits(256, 131_072, d128).splits, 1);
    assert_eq!(plan_splits(512, 131_072, d64).splits, 1);
    // 160 pairs would leave 39% of the slots idle in one wave of 264 with one split; two
    // splits fill 61% of two waves, three 91% of two: three
    assert_eq!(plan_splits(160, 131_072, d128).splits, 3);
    // four waves and more: one split
    assert_eq!(plan_splits(2048, 131_072, d64).splits, 1);
    // a short cache is not cut into splits of fewer than two steps: 128 keys at head
    // dim 128, 256 at 64
    let p = plan_splits(8, 1000, d128);
    assert_eq!(p.splits, 8, "{p:?}");
    assert!(
        p.split_keys >= 128 && p.splits * p.split_keys >= 1000,
        "{p:?}"
    );
    let p = plan_splits(8, 1000, d64);
    assert_eq!((p.splits, p.split_keys), (4, 256));
    // every split a multiple of a block's step, covering the cache
    for step in [64, 128] {
        for (t, n) in [(1, 1), (77, 3), (4097, 7), (1000, 1000)] {
            let p = fixed_splits(t, n, step);
            assert!(
                p.split_keys.is_multiple_of(step) && p.splits * p.split_keys >= t,
                "{p:?}"
            );
            assert!(
                (p.splits - 1) * p.split_keys < t,
                "{t} {n}: {p:?} has an empty split"
            );
        }
    }
}
// ANCHOR_END: split_test

#[test]
fn a_shorter_cache_can_take_more_splits_than_a_full_one() {
    let d128 = Occupancy {
        sms: 132,
        blocks_per_sm: 2,
        streaming: 1,
        block_keys: 64,
    };
    // 24 kv heads: 5 splits would give each multiprocessor one block; a full cache of
    // 1,024 keys takes them in 4 splits of 256, while 600 keys take 5 of 128
    assert_eq!(plan_splits(24, 1024, d128).splits, 4);
    assert_eq!(plan_splits(24, 600, d128).splits, 5);
    assert_eq!(most_splits(24, 1024, d128), 5);
    // the most is never below a full cache's count, nor below any length's
    for (pairs, context) in [(12, 2048), (8, 4096), (24, 1024), (512, 1000), (1, 100)] {
        let most = most_splits(pairs, context, d128);
        for keys in 1..=context {
            assert!(
                plan_splits(pairs, keys, d128).splits <= most,
                "{pairs} {keys}"
            );
        }
    }
}

#[test]
fn without_a_gpu_the_error_says_what_is_missing() {
    // on a machine with a GPU this opens it; without, the error names what is missing
    match Gpu::shared() {
        Ok(_) => {}
        Err(AttnError::Device { what }) => assert!(
            what.contains("libcuda") || what.contains("NVRTC") || what.contains("GPU"),
            "{what}"
        ),
        Err(e) => panic!("{e}"),
    }
}

/// The registry's GPU decoders (`attend --method flash_decode`, `flash_decode_paged`) are
/// the host calls above, bit for bit: the same cache, the same plan.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_registrys_gpu_decoders_are_the_host_calls() {
    use step08_inference::methods::{Decoder, FLASH_DECODE, FLASH_DECODE_PAGED};
    let gpu = Gpu::shared().expect("a GPU");
    let shape = DecodeShape::new(2, 8, 2, 1, 777, 64);
    let [q, k, v] = inputs(shape, 11);
    let (q, k, v) = (q.view(), k.view(), v.view());
    let paged = HostLayout::Paged { page_size: 64 };
    for (decoder, layout) in [
        (&FLASH_DECODE, HostLayout::Contiguous),
        (&FLASH_DECODE_PAGED, paged),
    ] {
        let got = decoder.decode(q, k, v, Dtype::Bf16).unwrap();
        let host = decode(gpu, q, k, v, Dtype::Bf16, layout, None).unwrap();
        assert_eq!(got.out, host.out, "{}", decoder.name());
        assert_eq!(got.lse, host.lse, "{}", decoder.name());
    }
}
