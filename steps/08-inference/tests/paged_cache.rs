//! The host's half of the paged cache and of the decoding plan, on any machine: the free
//! list, the page table's growth and its checks, and the plan's choices and refusals. The
//! same cache on the GPU is `tests/decode_gpu.rs`'s.

use flash_core::AttnError;
use proptest::prelude::*;
use step03_cuda_forward::gpu::Dtype;
use step08_inference::cuda::{
    CacheLayout, CacheSpec, DecodePlan, Occupancy, most_splits, plan_splits,
};
use step08_inference::kernel::KEY_GROUP;
use step08_inference::pages::{PAGE_SIZE, PageTable};

/// Sequence `b`'s row of the table, its pages only.
fn pages_of(t: &PageTable, b: usize) -> Vec<i32> {
    let row = &t.table()[b * t.max_pages()..(b + 1) * t.max_pages()];
    row.iter().copied().take_while(|&p| p >= 0).collect()
}

// ANCHOR: free_list_test
#[test]
fn sequences_take_pages_from_the_free_list_as_they_grow_and_give_them_back() {
    // 3 sequences of up to 100 tokens in pages of 16 (7 a sequence), a pool of 10 pages
    let mut t = PageTable::new(3, 100, 16, 10).unwrap();
    assert_eq!((t.max_pages(), t.free_pages()), (7, 10));
    // a prompt each: 20 tokens take 2 pages, 16 one, 1 one; pages in the pool's order
    assert!(t.grow(&[20, 16, 1]).unwrap());
    assert_eq!(
        (pages_of(&t, 0), pages_of(&t, 1), pages_of(&t, 2)),
        (vec![0, 1], vec![2], vec![3])
    );
    assert_eq!(t.lens(), [20, 16, 1]);
    // a token each: sequence 1's page is full, so it takes a new one; the others have room
    assert!(t.grow(&[1, 1, 1]).unwrap());
    assert_eq!(pages_of(&t, 1), vec![2, 4]);
    assert_eq!(t.free_pages(), 5);
    // within the last pages: the table does not change
    assert!(!t.grow(&[2, 0, 3]).unwrap());
    // sequence 0 finishes; its pages are the next taken, the last given back first
    assert!(t.release(0).unwrap());
    assert_eq!(
        (t.lens()[0], pages_of(&t, 0), t.free_pages()),
        (0, vec![], 7)
    );
    t.grow(&[0, 0, 30]).unwrap();
    assert_eq!(pages_of(&t, 2), vec![3, 0, 1]);
    t.check().unwrap();
}
// ANCHOR_END: free_list_test

#[test]
fn a_growth_that_does_not_fit_changes_nothing() {
    let mut t = PageTable::new(2, 100, 16, 8).unwrap();
    t.grow(&[50, 10]).unwrap();
    let before = t.clone();
    // past max_len
    let e = t.grow(&[51, 0]).unwrap_err().to_string();
    assert!(
        e.contains(
            "sequence 0 holds 50 tokens and 51 more would make 101, past the cache's 100"
        ),
        "{e}"
    );
    // past the pool: 4 + 1 pages held, 3 free; 100 tokens for sequence 1 need 6 more
    let e = t.grow(&[0, 90]).unwrap_err().to_string();
    assert!(
        e.contains("6 more pages of 16 tokens") && e.contains("3 of the pool's 8 are free"),
        "{e}"
    );
    // one count a sequence
    let e = t.grow(&[1]).unwrap_err().to_string();
    assert!(
        e.contains("new tokens for 1 sequences; the cache holds 2"),
        "{e}"
    );
    assert_eq!(t, before);
    let e = t.release(2).unwrap_err().to_string();
    assert!(e.contains("sequences 0 to 1"), "{e}");
}

#[test]
fn shuffled_free_pages_are_still_each_page_once() {
    let mut t = PageTable::new(2, 256, 64, 8).unwrap();
    t.shuffle_free(3);
    t.grow(&[256, 256]).unwrap();
    let mut all: Vec<i32> = t.table().to_vec();
    assert_ne!(
        all,
        (0..8).collect::<Vec<_>>(),
        "the free list was not shuffled"
    );
    all.sort();
    assert_eq!(all, (0..8).collect::<Vec<_>>());
    assert_eq!(t.free_pages(), 0);
    t.check().unwrap();
}

#[test]
fn a_contiguous_table_is_one_page_a_sequence_from_the_start() {
    let mut t = PageTable::contiguous(3, 77).unwrap();
    assert_eq!(
        (t.table(), t.page_size(), t.max_pages()),
        (&[0, 1, 2][..], 77, 1)
    );
    assert!(!t.grow(&[77, 5, 0]).unwrap());
    // a released sequence keeps its page
    assert!(!t.release(0).unwrap());
    assert_eq!(t.table(), [0, 1, 2]);
    assert_eq!(t.lens(), [0, 5, 0]);
    t.check().unwrap();
}

#[test]
fn tables_the_kernels_cannot_read_are_refused_when_made() {
    // pages of a group and a half: a group of 16 keys a warp copies would span two pages
    let e = PageTable::new(2, 100, KEY_GROUP * 3 / 2, 14)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("a multiple of {KEY_GROUP} tokens")),
        "{e}"
    );
    for (batch, max_len, pool) in [(0, 100, 7), (1, 0, 7), (1, 100, 0)] {
        assert!(
            PageTable::new(batch, max_len, 16, pool).is_err(),
            "{batch} {max_len} {pool}"
        );
    }
    // a contiguous cache has one page a sequence
    let spec = CacheSpec {
        pool: 5,
        ..CacheSpec::new(4, 2, 100, 64, Dtype::Bf16, CacheLayout::Contiguous)
    };
    let e = spec.page_table().unwrap_err().to_string();
    assert!(e.contains("a pool of 4"), "{e}");
    // CacheSpec::new gives every sequence room for max_len
    let paged = CacheLayout::Paged {
        page_size: PAGE_SIZE,
    };
    assert_eq!(CacheSpec::new(3, 2, 130, 64, Dtype::Bf16, paged).pool, 9);
}

proptest! {
    /// Any sequence of growths and releases, fitting or not, leaves a table that passes
    /// its check: each sequence holds the pages its length needs, no page held twice or
    /// both held and free.
    #[test]
    fn any_growth_and_release_keeps_the_table_whole(
        ops in prop::collection::vec((0usize..3, 0usize..70, any::<bool>()), 1..40),
        seed in any::<u64>(),
    ) {
        let mut t = PageTable::new(3, 200, 16, 20).unwrap();
        t.shuffle_free(seed);
        for (b, n, release) in ops {
            if release {
                t.release(b).unwrap();
            } else {
                let mut added = [0; 3];
                added[b] = n;
                let before = t.clone();
                if t.grow(&added).is_err() {
                    prop_assert_eq!(&t, &before);
                }
            }
            prop_assert!(t.check().is_ok(), "{:?}", t.check());
            let held: usize = t.lens().iter().map(|n| n.div_ceil(16)).sum();
            prop_assert_eq!(held + t.free_pages(), 20);
        }
    }
}

/// The H200's 132 multiprocessors, two blocks each, one streams; 64 keys a block's step.
const H200_D128: Occupancy = Occupancy {
    sms: 132,
    blocks_per_sm: 2,
    streaming: 1,
    block_keys: 64,
};

// ANCHOR: plan_test
#[test]
fn a_plan_chooses_the_split_for_the_longest_sequence_or_a_full_cache_for_a_graph() {
    let paged = CacheLayout::Paged { page_size: 64 };
    let spec = CacheSpec::new(1, 8, 131_072, 128, Dtype::Bf16, paged);
    let plan = DecodePlan::with_occupancy(spec, 32, 1, H200_D128).unwrap();
    assert_eq!(plan.shape().rows_per_kv_head(), 4);
    // the split at each length is plan_splits' for the 8 (sequence, kv head) pairs
    for keys in [1, 1000, 8192, 131_072] {
        assert_eq!(plan.split(keys), plan_splits(8, keys, H200_D128), "{keys}");
    }
    // an output has room for the most splits of any length
    assert_eq!(plan.most_splits(), most_splits(8, 131_072, H200_D128));
    // a graph's plan keeps a full cache's split at every length
    let graph = plan.clone().for_graph();
    for keys in [1, 1000, 131_072] {
        assert_eq!(graph.split(keys), plan.split(131_072), "{keys}");
    }
    assert_eq!(graph.most_splits(), plan.split(131_072).splits);
    // a forced count (the tests' way through the merge) covers a full cache at every length
    let fixed = plan.clone().with_splits(3);
    let split = fixed.split(10);
    assert_eq!(split, fixed.split(131_072));
    assert!(split.splits == 3 && split.splits * split.split_keys >= 131_072);
    assert!(split.split_keys.is_multiple_of(plan.kernel().block_keys()));
    assert_eq!(fixed.most_splits(), 3);
}
// ANCHOR_END: plan_test

#[test]
fn a_plan_refuses_shapes_the_kernel_does_not_take() {
    let spec = CacheSpec::new(2, 4, 1000, 64, Dtype::Bf16, CacheLayout::Contiguous);
    let plan = |spec: CacheSpec, q_heads, q_rows| {
        DecodePlan::with_occupancy(spec, q_heads, q_rows, H200_D128).map(|_| ())
    };
    plan(spec, 8, 1).unwrap();
    // kv heads that do not divide the query heads
    let e = plan(spec, 6, 1).unwrap_err().to_string();
    assert!(
        e.contains("the kv heads must divide the query heads"),
        "{e}"
    );
    // more rows on a kv head than the kernel computes together (2 × 20 > 32)
    let e = plan(spec, 8, 20).unwrap_err().to_string();
    assert!(e.contains("40 query rows share a kv head"), "{e}");
    // more rows than the cache holds tokens
    let short = CacheSpec { max_len: 3, ..spec };
    let e = plan(short, 8, 4).unwrap_err().to_string();
    assert!(e.contains("the context must be at least q_rows"), "{e}");
    // a head dim without a build, and f32
    let e = plan(
        CacheSpec {
            head_dim: 80,
            ..spec
        },
        8,
        1,
    )
    .unwrap_err();
    assert!(matches!(e, AttnError::UnsupportedHeadDim { .. }), "{e}");
    let e = plan(
        CacheSpec {
            dtype: Dtype::F32,
            ..spec
        },
        8,
        1,
    )
    .unwrap_err();
    assert!(e.to_string().contains("f32"), "{e}");
    // no query row
    let e = plan(spec, 8, 0).unwrap_err().to_string();
    assert!(e.contains("at least one query row"), "{e}");
    // pages the paged kernel cannot read
    let odd = CacheSpec::new(
        2,
        4,
        1000,
        64,
        Dtype::Bf16,
        CacheLayout::Paged { page_size: 24 },
    );
    let e = plan(odd, 8, 1).unwrap_err().to_string();
    assert!(
        e.contains(&format!("a multiple of {KEY_GROUP} tokens")),
        "{e}"
    );
}
