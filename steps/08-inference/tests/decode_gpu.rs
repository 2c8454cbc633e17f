//! The decoding kernel on a GPU, on a contiguous cache and on pages, against the `f64`
//! reference with FlashAttention's rule: its error at most twice that of attention by hand
//! in the same precision. Ignored where there is no GPU (`cargo test -- --include-ignored`
//! runs them on one); the checks of the page table and the split run everywhere.

use flash_core::inputs::random_normal;
use flash_core::reference::error;
use flash_core::{Attention, AttnError, Shape};
use ndarray::{Array3, Array4, ArrayView4};
use step03_cuda_forward::gpu::{Dtype, Gpu};
use step03_cuda_forward::host::round_array;
use step08_inference::DecodeShape;
use step08_inference::cuda::{
    CacheLayout, CacheSpec, DecodeOutput, DecodePlan, NewKv, Occupancy, PagedKvCache,
    attend_with_kvcache, cache_value, decode, decode_with_splits, fill_cache, fixed_splits,
    most_splits, plan_splits, read_bytes,
};
use step08_inference::pages::check_table;
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
/// `shape` decoded on the GPU, the split the plan's (`None`) or forced to `splits`, held
/// to the rule against the f64 reference.
fn check(
    gpu: &Gpu,
    shape: DecodeShape,
    dtype: Dtype,
    layout: CacheLayout,
    splits: Option<usize>,
) {
    let [q, k, v] = inputs(shape, shape.context as u64 + shape.q_rows as u64);
    let name = format!("{shape} {} {layout:?} splits {splits:?}", dtype.name());
    let (q, k, v) = (q.view(), k.view(), v.view());
    let got = match splits {
        None => decode(gpu, q, k, v, dtype, layout),
        Some(n) => decode_with_splits(gpu, q, k, v, dtype, layout, n),
    }
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
            check(gpu, shape, Dtype::Bf16, CacheLayout::Contiguous, splits);
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
            let layout = CacheLayout::Paged { page_size };
            check(gpu, shape, Dtype::Bf16, layout, None);
            check(gpu, shape, Dtype::Bf16, layout, Some(2));
        }
    }
}
// ANCHOR_END: gpu_tests

/// Each sequence's query rows in `got` against the reference over its own tokens so far:
/// sequence `b`'s first `lens[b]` keys and values of `k` and `v`.
fn check_each_sequence(
    gpu: &Gpu,
    name: &str,
    got: &DecodeOutput,
    q: &Array4<f32>,
    [k, v]: [&Array4<f32>; 2],
    lens: &[usize],
) {
    use ndarray::s;
    let out = gpu.download(&got.out).unwrap();
    let (b, h, n, _) = q.dim();
    let lse = gpu.stream().clone_dtoh(&got.lse).unwrap();
    let lse = Array3::from_shape_vec((b, h, n), lse).unwrap();
    for (b, &len) in lens.iter().enumerate() {
        let got = Attention {
            out: out.slice(s![b..b + 1, .., .., ..]).to_owned(),
            lse: lse.slice(s![b..b + 1, .., ..]).to_owned(),
        };
        assert_rule(
            &format!("{name}, sequence {b} of {len} tokens"),
            &got,
            q.slice(s![b..b + 1, .., .., ..]),
            k.slice(s![b..b + 1, .., ..len, ..]),
            v.slice(s![b..b + 1, .., ..len, ..]),
            Dtype::Bf16,
        );
    }
}

/// `rows` new tokens a sequence, `[batch, kv_heads, rows, head_dim]`: sequence `b`'s next
/// source tokens from position `lens[b]` on (zeros past the source's end, never written).
fn next_tokens(all: &Array4<f32>, lens: &[usize], rows: usize) -> Array4<f32> {
    let (batch, kv_heads, max_len, head_dim) = all.dim();
    Array4::from_shape_fn((batch, kv_heads, rows, head_dim), |(b, h, j, c)| {
        let t = lens[b] + j;
        if t < max_len { all[[b, h, t, c]] } else { 0.0 }
    })
}

// ANCHOR: append_test
/// A paged cache as a server's grows: three sequences sharing a pool too small for all of
/// them at their longest, its free pages shuffled. A prompt of its own length for each (one
/// reserve of a count a sequence, one write), then tokens appended one and four at a time
/// by `attend_with_kvcache`, and a sequence released and grown again from the pages the
/// others left. After every call, each sequence's rows against the reference over the
/// tokens appended to it, in order, whatever pages they landed in.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cache_that_grew_by_appends_decodes_as_the_reference() {
    let gpu = Gpu::shared().expect("a GPU");
    let (batch, q_heads, kv_heads, max_len) = (3, 8, 2, 300);
    for (head_dim, page_size) in [(64, 16), (128, 64), (32, 32)] {
        // the tokens each sequence is given, in order
        let source = Shape::new(batch, kv_heads, max_len, head_dim);
        let k_all = round_array(random_normal(source, 41).view(), Dtype::Bf16);
        let v_all = round_array(random_normal(source, 42).view(), Dtype::Bf16);
        let layout = CacheLayout::Paged { page_size };
        let spec = CacheSpec {
            pool: 2 * max_len.div_ceil(page_size),
            ..CacheSpec::new(batch, kv_heads, max_len, head_dim, Dtype::Bf16, layout)
        };
        let mut cache = PagedKvCache::new(gpu, spec).unwrap();
        cache.shuffle_free(9);
        let mut seed = 100;
        let mut query = |rows: usize| {
            seed += 1;
            let shape = Shape::new(batch, q_heads, rows, head_dim);
            round_array(random_normal(shape, seed).view(), Dtype::Bf16)
        };
        let upload = |x: &Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
        // a prompt each, of 37, 100 and 5 tokens
        let added = [37, 100, 5];
        let (k, v) = (
            upload(&next_tokens(&k_all, &[0; 3], 100)),
            upload(&next_tokens(&v_all, &[0; 3], 100)),
        );
        cache.reserve(gpu, &added).unwrap();
        cache
            .write(gpu, 0, &NewKv::from_heads(&k, &v).unwrap())
            .unwrap();
        let q = query(1);
        let got = attend_with_kvcache(gpu, &mut cache, &upload(&q), None).unwrap();
        let name = format!("d {head_dim}, pages of {page_size}, prompts");
        check_each_sequence(gpu, &name, &got, &q, [&k_all, &v_all], cache.lens());
        for step in 0..24 {
            if step == 12 {
                // sequence 1 finishes; a new one takes its place with a prompt of 150,
                // from pages the others left and its own old ones
                cache.release(gpu, 1).unwrap();
                assert_eq!(cache.lens()[1], 0);
                let (k, v) = (
                    upload(&next_tokens(&k_all, cache.lens(), 150)),
                    upload(&next_tokens(&v_all, cache.lens(), 150)),
                );
                cache.reserve(gpu, &[0, 150, 0]).unwrap();
                cache
                    .write(gpu, 0, &NewKv::from_heads(&k, &v).unwrap())
                    .unwrap();
            }
            // a token a sequence, and at every sixth step four (speculative decoding's
            // rows): the query rows are the new tokens'
            let rows = if step % 6 == 5 { 4 } else { 1 };
            let lens = cache.lens().to_vec();
            let (k, v) = (
                upload(&next_tokens(&k_all, &lens, rows)),
                upload(&next_tokens(&v_all, &lens, rows)),
            );
            let q = query(rows);
            let new = NewKv::from_heads(&k, &v).unwrap();
            let got =
                attend_with_kvcache(gpu, &mut cache, &upload(&q), Some(&new)).unwrap();
            let want: Vec<usize> = lens.iter().map(|n| n + rows).collect();
            assert_eq!(cache.lens(), want);
            let name = format!("d {head_dim}, pages of {page_size}, step {step}");
            check_each_sequence(gpu, &name, &got, &q, [&k_all, &v_all], cache.lens());
        }
        // the pages a sequence holds lie out of order in the pool
        let table = cache.pages().table();
        let row = cache.pages().max_pages();
        let used = cache.lens()[1].div_ceil(page_size);
        let pages = &table[row..row + used];
        assert!(
            pages.windows(2).any(|w| w[1] != w[0] + 1),
            "sequence 1's pages {pages:?} are in order"
        );
        // past the pool: refused, and nothing changes
        let before = cache.lens().to_vec();
        let e = cache
            .reserve(gpu, &[max_len - before[0], 0, max_len - before[2]])
            .unwrap_err()
            .to_string();
        assert!(e.contains("more pages of"), "{e}");
        assert_eq!(cache.lens(), before);
    }
}

/// A model's cache: two layers with the same lengths and pages and values of their own,
/// one reserve a step and a write for each layer, then the plan run on each layer, made
/// once for all of them.
#[test]
#[ignore = "needs a CUDA GPU"]
fn every_layer_of_a_model_cache_holds_its_own_values() {
    let gpu = Gpu::shared().expect("a GPU");
    let (batch, q_heads, kv_heads, max_len, head_dim) = (2, 4, 2, 200, 64);
    let layout = CacheLayout::Paged { page_size: 16 };
    let spec = CacheSpec {
        layers: 2,
        ..CacheSpec::new(batch, kv_heads, max_len, head_dim, Dtype::Bf16, layout)
    };
    let mut cache = PagedKvCache::new(gpu, spec).unwrap();
    cache.shuffle_free(4);
    let source = Shape::new(batch, kv_heads, max_len, head_dim);
    let layers: Vec<[Array4<f32>; 2]> = (0..2)
        .map(|l| {
            [
                round_array(random_normal(source, 50 + 2 * l).view(), Dtype::Bf16),
                round_array(random_normal(source, 51 + 2 * l).view(), Dtype::Bf16),
            ]
        })
        .collect();
    let plan = DecodePlan::new(gpu, &cache, q_heads, 1).unwrap();
    let mut out = plan.alloc_output(gpu).unwrap();
    let upload = |x: &Array4<f32>| gpu.upload(x.view(), Dtype::Bf16).unwrap();
    for (step, rows) in [60, 1, 1, 17, 1].into_iter().enumerate() {
        let lens = cache.lens().to_vec();
        cache.reserve(gpu, &[rows; 2]).unwrap();
        for (l, [k_all, v_all]) in layers.iter().enumerate() {
            let (k, v) = (
                upload(&next_tokens(k_all, &lens, rows)),
                upload(&next_tokens(v_all, &lens, rows)),
            );
            cache
                .write(gpu, l, &NewKv::from_heads(&k, &v).unwrap())
                .unwrap();
        }
        let q = round_array(
            random_normal(Shape::new(batch, q_heads, 1, head_dim), 60 + step as u64).view(),
            Dtype::Bf16,
        );
        let q_dev = upload(&q);
        for (l, [k_all, v_all]) in layers.iter().enumerate() {
            plan.run(gpu, &cache, l, &q_dev, &mut out).unwrap();
            let name = format!("layer {l}, step {step}");
            check_each_sequence(gpu, &name, &out, &q, [k_all, v_all], cache.lens());
        }
    }
}
// ANCHOR_END: append_test

// ANCHOR: lens_test
/// Sequences of one batch at lengths of their own (one reserve of a count a sequence, one
/// write of each sequence's first rows; the kernel reads the lengths from memory): each
/// sequence's rows against the reference over its own tokens only, the diagonal at its
/// own end, contiguous and paged, the plan's split and three.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sequences_of_different_lengths_each_decode_to_their_own_end() {
    use ndarray::s;
    let gpu = Gpu::shared().expect("a GPU");
    let shape = DecodeShape::new(3, 8, 2, 2, 700, 64);
    let lens = [700, 333, 2];
    let [q, k, v] = inputs(shape, 5);
    let (q, k, v) = (
        round_array(q.view(), Dtype::Bf16),
        round_array(k.view(), Dtype::Bf16),
        round_array(v.view(), Dtype::Bf16),
    );
    let paged = CacheLayout::Paged { page_size: 64 };
    for layout in [CacheLayout::Contiguous, paged] {
        let spec = CacheSpec::new(3, 2, 700, 64, Dtype::Bf16, layout);
        let mut cache = PagedKvCache::new(gpu, spec).unwrap();
        cache.shuffle_free(3);
        let (k_dev, v_dev) = (
            gpu.upload(k.view(), Dtype::Bf16).unwrap(),
            gpu.upload(v.view(), Dtype::Bf16).unwrap(),
        );
        cache.reserve(gpu, &lens).unwrap();
        let new = NewKv::from_heads(&k_dev, &v_dev).unwrap();
        cache.write(gpu, 0, &new).unwrap();
        assert_eq!(cache.lens(), lens);
        let plan = DecodePlan::new(gpu, &cache, 8, 2).unwrap();
        for plan in [plan.clone(), plan.with_splits(3)] {
            let q_dev = gpu.upload(q.view(), Dtype::Bf16).unwrap();
            let mut result = plan.alloc_output(gpu).unwrap();
            let split = plan.run(gpu, &cache, 0, &q_dev, &mut result).unwrap();
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
fn a_cache_refuses_what_would_make_its_lengths_and_values_disagree() {
    let gpu = Gpu::shared().expect("a GPU");
    let spec = CacheSpec::new(2, 1, 100, 64, Dtype::Bf16, CacheLayout::Contiguous);
    let mut cache = PagedKvCache::new(gpu, spec).unwrap();
    let e = cache.reserve(gpu, &[100, 101]).unwrap_err().to_string();
    assert!(e.contains("sequence 1 holds 0 tokens and 101 more"), "{e}");
    let e = cache.reserve(gpu, &[5]).unwrap_err().to_string();
    assert!(e.contains("one count a sequence"), "{e}");
    // nothing was taken from the refused counts
    assert_eq!(cache.lens(), [0, 0]);
    // reserved but not written: the plan refuses to read it
    cache.reserve(gpu, &[7, 3]).unwrap();
    let plan = DecodePlan::new(gpu, &cache, 2, 1).unwrap();
    let mut out = plan.alloc_output(gpu).unwrap();
    let q = gpu
        .upload(Array4::zeros((2, 2, 1, 64)).view(), Dtype::Bf16)
        .unwrap();
    let e = plan
        .run(gpu, &cache, 0, &q, &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 0 has not written"), "{e}");
    // new keys and values of another shape, or for a layer the cache lacks
    let kv = |t| {
        gpu.upload(Array4::zeros((2, 1, t, 64)).view(), Dtype::Bf16)
            .unwrap()
    };
    let (short_k, short_v) = (kv(5), kv(5));
    let short = NewKv::from_heads(&short_k, &short_v).unwrap();
    let e = cache.write(gpu, 0, &short).unwrap_err().to_string();
    assert!(e.contains("up to 7 tokens a sequence"), "{e}");
    let (k7, v7) = (kv(7), kv(7));
    let new = NewKv::from_heads(&k7, &v7).unwrap();
    let e = cache.write(gpu, 1, &new).unwrap_err().to_string();
    assert!(e.contains("layer 1 of a cache of 1 layers"), "{e}");
    cache.write(gpu, 0, &new).unwrap();
    plan.run(gpu, &cache, 0, &q, &mut out).unwrap();
    // q of another shape, and a plan for another cache
    let q3 = gpu
        .upload(Array4::zeros((2, 2, 3, 64)).view(), Dtype::Bf16)
        .unwrap();
    let e = plan
        .run(gpu, &cache, 0, &q3, &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("the plan decodes"), "{e}");
    let paged = CacheSpec::new(
        2,
        1,
        100,
        64,
        Dtype::Bf16,
        CacheLayout::Paged { page_size: 16 },
    );
    let other = PagedKvCache::new(gpu, paged).unwrap();
    let e = plan
        .run(gpu, &other, 0, &q, &mut out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("make the plan for the cache"), "{e}");
    // a sequence shorter than q's rows
    let plan3 = DecodePlan::new(gpu, &cache, 2, 3).unwrap();
    let mut out3 = plan3.alloc_output(gpu).unwrap();
    cache.release(gpu, 1).unwrap();
    let e = plan3
        .run(gpu, &cache, 0, &q3, &mut out3)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sequence 1 holds 0 tokens and q has 3 rows"),
        "{e}"
    );
    // attend_with_kvcache checks q before it appends: the cache stays as it was
    let narrow = gpu
        .upload(Array4::zeros((2, 2, 1, 32)).view(), Dtype::Bf16)
        .unwrap();
    let Err(e) = attend_with_kvcache(gpu, &mut cache, &narrow, Some(&new)) else {
        panic!("q of head dim 32 against a cache of 64 was taken");
    };
    assert!(e.to_string().contains("the plan decodes"), "{e}");
    assert_eq!(cache.lens(), [7, 0]);
    // a cache of several layers reserves once and writes each layer
    let two = CacheSpec { layers: 2, ..spec };
    let mut model = PagedKvCache::new(gpu, two).unwrap();
    let e = model.append(gpu, &new).unwrap_err().to_string();
    assert!(e.contains("reserves once a step"), "{e}");
    assert_eq!(model.lens(), [0, 0]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn f16_caches_decode_too() {
    let gpu = Gpu::shared().expect("a GPU");
    for (b, h, kv, n, t, d) in [(1, 32, 8, 1, 1000, 128), (2, 8, 2, 4, 333, 64)] {
        let shape = DecodeShape::new(b, h, kv, n, t, d);
        check(gpu, shape, Dtype::F16, CacheLayout::Contiguous, None);
        check(
            gpu,
            shape,
            Dtype::F16,
            CacheLayout::Paged { page_size: 32 },
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
    let run = |layout| decode(gpu, q.view(), k.view(), v.view(), Dtype::Bf16, layout);
    let a = run(CacheLayout::Contiguous).unwrap();
    let b = run(CacheLayout::Paged { page_size: 64 }).unwrap();
    assert_eq!(a.out, b.out);
    assert_eq!(a.lse, b.lse);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_benchmark_fill_is_what_the_host_computes() {
    // decode-bench checks its results against caches it makes again on the host
    let gpu = Gpu::shared().expect("a GPU");
    let full = |layout| {
        let spec = CacheSpec::new(2, 3, 100, 64, Dtype::Bf16, layout);
        let mut cache = PagedKvCache::new(gpu, spec).unwrap();
        cache.shuffle_free(5);
        cache.reserve(gpu, &[100, 100]).unwrap();
        fill_cache(gpu, &mut cache, 11).unwrap();
        cache
    };
    let flat = full(CacheLayout::Contiguous);
    let paged = full(CacheLayout::Paged { page_size: 64 });
    let table = paged.pages().table().to_vec();
    let bits = |x| gpu.stream().clone_dtoh(x).unwrap();
    let (k, v, pk) = (
        bits(flat.pools().0),
        bits(flat.pools().1),
        bits(paged.pools().0),
    );
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
    read_bytes(gpu, flat.pools().0, flat.pools().1, &mut sums).unwrap();
    let sums = gpu.stream().clone_dtoh(&sums).unwrap();
    let words = |x: &[u16]| {
        x.chunks(2)
            .fold(0u32, |a, w| a ^ (w[0] as u32 | (w[1] as u32) << 16))
    };
    assert_eq!(sums.iter().fold(0, |a, s| a ^ s), words(&k) ^ words(&v));
}

// ANCHOR: page_table_test
#[test]
fn a_page_table_that_points_past_the_pool_is_refused() {
    // 2 sequences of 100 tokens in pages of 16: 7 pages each, 14 in the pool
    let lens = [100, 100];
    let mut table: Vec<i32> = (0..14).rev().collect();
    assert!(check_table(&table, &lens, 7, 14, 16).is_ok());
    table[7 + 3] = 14;
    let e = check_table(&table, &lens, 7, 14, 16)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("entry 3 of sequence 1 (tokens 48 to 63) is page 14")
            && e.contains("the pool holds 14 pages"),
        "{e}"
    );
    table[7 + 3] = -1;
    assert!(check_table(&table, &lens, 7, 14, 16).is_err());
    // one page for two sequences: each would write over the other's tokens
    table[7 + 3] = table[0];
    let e = check_table(&table, &lens, 7, 14, 16)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("page 13 is entry 0 of sequence 0 and entry 3 of sequence 1"),
        "{e}"
    );
    // an entry past the pages a sequence uses is never read: 40 tokens use 3 pages
    table[7 + 3] = 99;
    assert!(check_table(&table, &[100, 40], 7, 14, 16).is_ok());
    // a row too short for the tokens
    let e = check_table(&table, &[100, 113], 7, 14, 16)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("8 pages of 16, and the table's rows have 7"),
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
    use flash_core::Describe;
    use step08_inference::methods::{Decoder, FLASH_DECODE, FLASH_DECODE_PAGED};
    let gpu = Gpu::shared().expect("a GPU");
    let shape = DecodeShape::new(2, 8, 2, 1, 777, 64);
    let [q, k, v] = inputs(shape, 11);
    let (q, k, v) = (q.view(), k.view(), v.view());
    let paged = CacheLayout::Paged { page_size: 64 };
    for (decoder, layout) in [
        (&FLASH_DECODE, CacheLayout::Contiguous),
        (&FLASH_DECODE_PAGED, paged),
    ] {
        let got = decoder.decode(q, k, v, Dtype::Bf16).unwrap();
        let host = decode(gpu, q, k, v, Dtype::Bf16, layout).unwrap();
        assert_eq!(got.out, host.out, "{}", decoder.name());
        assert_eq!(got.lse, host.lse, "{}", decoder.name());
    }
}
