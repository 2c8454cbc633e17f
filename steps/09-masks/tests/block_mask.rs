//! The block mask: its tiles against the mask asked pair by pair, its lists, and the CPU's
//! passes over it: any block size gives the same answer, and skipped tiles are really
//! skipped.

mod common;

use common::{error_with_infinities, inputs, mask_with_empty_rows, masks, score_mods};
use flash_core::reference::error;
use proptest::prelude::*;
use step09_masks::{
    BlockMask, BlockSizes, CustomMask, Documents, Mask, ScoreMod, Tile, Varies,
    backward_with, forward_with,
};

const SHAPE: (usize, usize, usize, usize, usize, usize) = (2, 4, 2, 45, 77, 16);

/// The same mask as a custom one, so that the block mask asks it about every pair rather
/// than counting its rows' intervals.
fn pair_by_pair(mask: &Mask) -> Mask {
    let m = mask.clone();
    Mask::Custom(CustomMask::new("pair by pair", move |b, h, q, k| {
        m.allows(b, h, q, k)
    }))
}

/// Every tile's class and the visible count, from the mask asked about every pair.
fn check_tiles(mask: &Mask, dims: (usize, usize, usize, usize), blocks: BlockSizes) {
    let (batch, heads, tq, tk) = dims;
    let bm = BlockMask::new(mask, dims, blocks).unwrap();
    let brute = BlockMask::new(&pair_by_pair(mask), dims, blocks).unwrap();
    let offset = tk - tq;
    let mut visible = 0u64;
    for b in 0..batch {
        for h in 0..heads {
            let (t, tb) = (bm.table(b, h), brute.table(b, h));
            for i in 0..bm.q_blocks() {
                for j in 0..bm.kv_blocks() {
                    let rows = i * blocks.queries..((i + 1) * blocks.queries).min(tq);
                    let keys = j * blocks.keys..((j + 1) * blocks.keys).min(tk);
                    let seen = rows
                        .clone()
                        .flat_map(|r| keys.clone().map(move |k| (r + offset, k)))
                        .filter(|&(qp, k)| mask.allows(b, h, qp, k))
                        .count();
                    visible += seen as u64;
                    let want = if seen == 0 {
                        Tile::Empty
                    } else if seen == rows.len() * keys.len() {
                        Tile::Full
                    } else {
                        Tile::Partial
                    };
                    let what = format!(
                        "{} {blocks:?}: b {b}, h {h}, tile ({i}, {j})",
                        mask.name()
                    );
                    assert_eq!(bm.tile(t, i, j), want, "{what}");
                    assert_eq!(brute.tile(tb, i, j), want, "{what}, pair by pair");
                }
            }
        }
    }
    assert_eq!(bm.visible(), visible, "{}", mask.name());
    assert_eq!(brute.visible(), visible, "{}, pair by pair", mask.name());
}

#[test]
fn every_tile_is_classified_as_the_mask_says() {
    for mask in masks(77).iter().chain([&mask_with_empty_rows()]) {
        for blocks in [(16, 16), (5, 7), (64, 64), (1, 1), (45, 77)] {
            let blocks = BlockSizes {
                queries: blocks.0,
                keys: blocks.1,
            };
            check_tiles(mask, (2, 4, 45, 77), blocks);
        }
    }
}

#[test]
fn the_lists_are_the_tiles_in_order_and_their_transpose() {
    for mask in masks(77) {
        let bm = BlockMask::new(
            &mask,
            (2, 4, 45, 77),
            BlockSizes {
                queries: 8,
                keys: 16,
            },
        )
        .unwrap();
        let (m, n) = (bm.q_blocks(), bm.kv_blocks());
        assert_eq!(bm.tiles().len(), bm.tables() * m * n);
        assert_eq!(bm.kv_count().len(), bm.tables() * m);
        assert_eq!(bm.q_count().len(), bm.tables() * n);
        for t in 0..bm.tables() {
            for i in 0..m {
                let want: Vec<(usize, bool)> = (0..n)
                    .filter(|&j| bm.tile(t, i, j) != Tile::Empty)
                    .map(|j| (j, bm.tile(t, i, j) == Tile::Full))
                    .collect();
                assert_eq!(bm.kv_blocks_of(t, i).collect::<Vec<_>>(), want);
                // the places after kv_count are −1
                let row = &bm.kv_index()[(t * m + i) * n..][..n];
                assert!(row[want.len()..].iter().all(|&x| x == -1));
            }
            for j in 0..n {
                let want: Vec<(usize, bool)> = (0..m)
                    .filter(|&i| bm.tile(t, i, j) != Tile::Empty)
                    .map(|i| (i, bm.tile(t, i, j) == Tile::Full))
                    .collect();
                assert_eq!(bm.q_blocks_of(t, j).collect::<Vec<_>>(), want);
            }
        }
    }
}

#[test]
fn a_mask_keeps_one_table_for_what_it_does_not_vary_with() {
    let dims = (3, 4, 40, 40);
    let blocks = BlockSizes::default();
    let tables = |mask: &Mask| BlockMask::new(mask, dims, blocks).unwrap().tables();
    assert_eq!(tables(&Mask::Causal), 1);
    assert_eq!(tables(&Mask::Sliding { window: 4 }), 1);
    let shared = Documents::from_lengths(&[10, 30]).unwrap();
    assert_eq!(tables(&Mask::Documents(shared)), 1);
    let per_sequence =
        Documents::from_cu_seqlens(40, &[vec![0, 40], vec![0, 1, 40], vec![0, 39, 40]])
            .unwrap();
    assert_eq!(tables(&Mask::Documents(per_sequence)), 3);
    let custom = CustomMask::new("c", |_, _, q, k| k <= q);
    assert_eq!(tables(&Mask::Custom(custom.clone())), 12);
    let per_head = custom.varying(Varies {
        batch: false,
        head: true,
    });
    assert_eq!(tables(&Mask::Custom(per_head)), 4);
}

#[test]
fn density_counts_the_scores_and_tiles_the_mask_lets_through() {
    let dims = (1, 1, 128, 128);
    let blocks = BlockSizes::default();
    let causal = BlockMask::new(&Mask::Causal, dims, blocks).unwrap();
    // 128·129/2 of 128² scores; tiles: 2 diagonal (partial) and 1 full of 4
    assert_eq!(causal.visible(), 128 * 129 / 2);
    assert!((causal.density() - 129.0 / 256.0).abs() < 1e-12);
    assert_eq!(causal.computed_tiles(), (3, 2));
    assert!((causal.tile_density() - 0.75).abs() < 1e-12);
    let full = BlockMask::new(&Mask::Full, dims, blocks).unwrap();
    assert_eq!(full.density(), 1.0);
    assert_eq!(full.computed_tiles(), (4, 0));
}

#[test]
fn the_picture_of_a_document_mask() {
    let docs = Documents::from_lengths(&[100, 60, 96]).unwrap();
    let bm = BlockMask::new(
        &Mask::Documents(docs),
        (1, 1, 256, 256),
        BlockSizes {
            queries: 32,
            keys: 32,
        },
    )
    .unwrap();
    let picture = bm.picture(0);
    println!("{picture}");
    let rows: Vec<&str> = picture.lines().take(8).collect();
    // each row of tiles, from the tiles themselves
    for (i, row) in rows.iter().enumerate() {
        let want: String = (0..8)
            .map(|j| match bm.tile(0, i, j) {
                Tile::Full => '#',
                Tile::Partial => '+',
                Tile::Empty => '.',
            })
            .collect();
        assert_eq!(*row, want);
    }
    // the first document's first tile is a diagonal one, and the last row sees nothing of
    // the first document
    assert_eq!(&rows[0][..2], "+.");
    assert!(rows[7].starts_with("...."));
    assert!(
        picture
            .lines()
            .nth(8)
            .unwrap()
            .starts_with("documents(3): 8 × 8 tiles")
    );
}

// ANCHOR: skipping
#[test]
fn skipping_really_skips() {
    let x = inputs(SHAPE, 3);
    let (b, h, _, tq, tk, _) = SHAPE;
    for mask in masks(tk).iter().chain([&mask_with_empty_rows()]) {
        for blocks in [(16, 16), (8, 32)] {
            let blocks = BlockSizes {
                queries: blocks.0,
                keys: blocks.1,
            };
            let bm = BlockMask::new(mask, (b, h, tq, tk), blocks).unwrap();
            let score = ScoreMod::SoftCap { cap: 5.0 };
            let (fwd, work) =
                forward_with(x.q.view(), x.k.view(), x.v.view(), &bm, &score).unwrap();
            let (all, partial) = bm.computed_scores();
            let what = format!("{} {blocks:?}", mask.name());
            // every score of every non-empty tile, and the mask asked in the partial ones
            assert_eq!(work.scores, all, "{what}: scores");
            assert_eq!(work.mask_calls, partial, "{what}: mask calls");
            // and exactly the scores the mask lets through reach the softmax
            assert_eq!(work.kept, bm.visible(), "{what}: scores kept");
            let (_, work) = backward_with(
                x.q.view(),
                x.k.view(),
                x.v.view(),
                &fwd,
                x.dout.view(),
                &bm,
                &score,
            )
            .unwrap();
            assert_eq!(work.scores, all, "{what}: backward scores");
            assert_eq!(work.mask_calls, partial, "{what}: backward mask calls");
            assert_eq!(work.kept, bm.visible(), "{what}: backward scores kept");
        }
    }
    // a sliding window of 10 over 77 keys computes far fewer than all 45 × 77 scores a head
    let window = Mask::Sliding { window: 10 };
    let bm = BlockMask::new(
        &window,
        (1, 1, tq, tk),
        BlockSizes {
            queries: 8,
            keys: 8,
        },
    )
    .unwrap();
    let (all, _) = bm.computed_scores();
    assert!(all < (tq * tk / 3) as u64, "{all} scores of {}", tq * tk);
}
// ANCHOR_END: skipping

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn any_block_size_gives_the_same_answer(
        which in 0usize..8,
        score in 0usize..4,
        queries in 1usize..50,
        keys in 1usize..80,
        tq in 1usize..40,
        extra in 0usize..30,
        seed in 0u64..1000,
    ) {
        let tk = (tq + extra).max(6);
        let shape = (2, 2, 1, tq, tk, 8);
        let x = inputs(shape, seed);
        let mut all = masks(tk);
        all.push(mask_with_empty_rows());
        let mask = all.swap_remove(which);
        let score = score_mods(2).into_iter().nth(score).unwrap();
        let run = |blocks: BlockSizes| {
            let bm = BlockMask::new(&mask, (2, 2, tq, tk), blocks).unwrap();
            let (q, k, v) = (x.q.view(), x.k.view(), x.v.view());
            let (fwd, _) = forward_with(q, k, v, &bm, &score).unwrap();
            let (g, _) = backward_with(q, k, v, &fwd, x.dout.view(), &bm, &score).unwrap();
            (fwd, g)
        };
        let (fwd, g) = run(BlockSizes { queries, keys });
        let (fwd0, g0) = run(BlockSizes::default());
        let e = error_with_infinities(&fwd.lse, &fwd0.lse.mapv(f64::from));
        prop_assert!(e.max_abs < 1e-5, "lse {}", e);
        prop_assert!(error(&fwd.out, &fwd0.out.mapv(f64::from)).max_abs < 1e-5);
        for (a, b) in [(&g.dq, &g0.dq), (&g.dk, &g0.dk), (&g.dv, &g0.dv)] {
            let e = error(a, &b.mapv(f64::from));
            prop_assert!(e.max_abs < 1e-4, "{} {}", mask.name(), e);
        }
    }

    #[test]
    fn the_block_mask_of_any_shape_matches_the_mask_pair_by_pair(
        which in 0usize..8,
        queries in 1usize..20,
        keys in 1usize..20,
        tq in 0usize..30,
        extra in 0usize..20,
    ) {
        let tk = (tq + extra).max(6);
        let mut all = masks(tk);
        all.push(mask_with_empty_rows());
        let mask = all.swap_remove(which);
        check_tiles(&mask, (2, 2, tq, tk), BlockSizes { queries, keys });
    }
}

#[test]
fn a_block_mask_for_another_shape_or_of_empty_blocks_is_refused() {
    let x = inputs(SHAPE, 8);
    let (q, k, v) = (x.q.view(), x.k.view(), x.v.view());
    let other =
        BlockMask::new(&Mask::Causal, (2, 4, 45, 78), BlockSizes::default()).unwrap();
    let e = forward_with(q, k, v, &other, &ScoreMod::None).unwrap_err();
    assert!(e.to_string().contains("(2, 4, 45, 78)"), "{e}");
    let zero = BlockSizes {
        queries: 0,
        keys: 64,
    };
    let e = BlockMask::new(&Mask::Causal, (2, 4, 45, 77), zero).unwrap_err();
    assert!(e.to_string().contains("both must be at least 1"), "{e}");
    let e =
        BlockMask::new(&Mask::Causal, (2, 4, 78, 77), BlockSizes::default()).unwrap_err();
    assert!(e.to_string().contains("78 queries on 77 keys"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// What a query cannot see cannot change it: keys and values its mask hides, changed by
    /// any amount, leave its output, log-sum-exp and dq exactly as they were, whatever the
    /// tiles (a hidden key in a partial tile is computed, then masked before the softmax).
    #[test]
    fn a_query_does_not_depend_on_the_keys_it_cannot_see(
        which in 0usize..8,
        score in 0usize..4,
        queries in 1usize..40,
        keys in 1usize..40,
        row in 0usize..45,
        head in 0usize..4,
        seed in 0u64..1000,
    ) {
        let (b, h, kvh, tq, tk, d) = SHAPE;
        let x = inputs(SHAPE, seed);
        let mut all = masks(tk);
        all.push(mask_with_empty_rows());
        let mask = all.swap_remove(which);
        let score = score_mods(h).swap_remove(score);
        let blocks = BlockSizes { queries, keys };
        let bm = BlockMask::new(&mask, (b, h, tq, tk), blocks).unwrap();
        let run = |k: &ndarray::Array4<f32>, v: &ndarray::Array4<f32>| {
            let (q, k, v, dout) = (x.q.view(), k.view(), v.view(), x.dout.view());
            let (fwd, _) = forward_with(q, k, v, &bm, &score).unwrap();
            let (g, _) = backward_with(q, k, v, &fwd, dout, &bm, &score).unwrap();
            (fwd, g)
        };
        let (fwd, g) = run(&x.k, &x.v);
        let (mut k, mut v) = (x.k.clone(), x.v.clone());
        let (seq, g_head, qp) = (1, head / (h / kvh), row + tk - tq);
        for j in (0..tk).filter(|&j| !mask.allows(seq, head, qp, j)) {
            for c in 0..d {
                k[[seq, g_head, j, c]] += 100.0;
                v[[seq, g_head, j, c]] -= 100.0;
            }
        }
        let (fwd2, g2) = run(&k, &v);
        let at = ndarray::s![seq, head, row, ..];
        prop_assert_eq!(fwd.out.slice(at), fwd2.out.slice(at));
        let (a, z) = (fwd.lse[[seq, head, row]], fwd2.lse[[seq, head, row]]);
        prop_assert_eq!(a.to_bits(), z.to_bits());
        prop_assert_eq!(g.dq.slice(at), g2.dq.slice(at));
    }
}
