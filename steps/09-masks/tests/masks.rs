//! The masks and score functions themselves: each built-in's definition, its CUDA text, the
//! `--mask` flag's parsing, and every bad input refused with a message that names it.

use std::path::PathBuf;

use flash_core::AttnError;
use ndarray::Array4;
use step09_masks::mask::alibi_slope;
use step09_masks::{
    CustomMask, CustomScore, Documents, Mask, MaskSpec, ScoreMod, forward, kernel_source,
};

fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("step09-masks-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

fn parse_err(text: &str) -> String {
    MaskSpec::parse(text).unwrap_err().to_string()
}

#[test]
fn each_built_in_is_its_definition() {
    let docs = Documents::from_cu_seqlens(6, &[vec![0, 2, 6], vec![0, 6]]).unwrap();
    let documents = Mask::Documents(docs);
    for q in 0..6 {
        for k in 0..6 {
            assert_eq!(Mask::Causal.allows(0, 0, q, k), k <= q);
            assert!(Mask::Full.allows(0, 0, q, k));
            let window = Mask::Sliding { window: 2 };
            assert_eq!(window.allows(0, 0, q, k), k <= q && q - k < 2);
            let prefix = Mask::PrefixLm { prefix: 3 };
            assert_eq!(prefix.allows(0, 0, q, k), k < 3 || k <= q);
            // sequence 0: documents 0..2 and 2..6; sequence 1: one document
            assert_eq!(documents.allows(0, 0, q, k), k <= q && (k < 2) == (q < 2));
            assert_eq!(documents.allows(1, 0, q, k), k <= q);
        }
    }
    let cap = ScoreMod::SoftCap { cap: 2.0 };
    assert!((cap.apply(100.0, 0, 0, 0, 0) - 2.0).abs() < 1e-12);
    assert!((cap.apply(0.5, 0, 0, 0, 0) - 2.0 * (0.25f64).tanh()).abs() < 1e-15);
    let alibi = ScoreMod::Alibi { heads: 8 };
    // head 0 of 8: slope 2^-1; head 7: 2^-8
    assert_eq!(alibi.apply(1.0, 0, 0, 10, 4), 1.0 - 0.5 * 6.0);
    assert_eq!(alibi_slope(7, 8), 1.0 / 256.0);
    // the derivatives, against central differences
    let custom = ScoreMod::Custom(CustomScore::new(
        "cube",
        |s, _, _, _, _| s * s * s,
        |s, _, _, _, _| 3.0 * s * s,
    ));
    for score in [cap, alibi, custom, ScoreMod::None] {
        for s in [-3.0, -0.1, 0.7, 4.0] {
            let h = 1e-6;
            let numeric = (score.apply(s + h, 0, 3, 9, 2) - score.apply(s - h, 0, 3, 9, 2))
                / (2.0 * h);
            let analytic = score.grad(s, 0, 3, 9, 2);
            assert!((numeric - analytic).abs() < 1e-6, "{} at {s}", score.name());
        }
    }
}

#[test]
fn documents_from_ids_cu_seqlens_and_lengths_agree() {
    let ids = Documents::from_ids(1, 7, vec![0, 0, 0, 1, 1, 2, 2]).unwrap();
    let cu = Documents::from_cu_seqlens(7, &[vec![0, 3, 5, 7]]).unwrap();
    let lengths = Documents::from_lengths(&[3, 2, 2]).unwrap();
    assert_eq!(ids, cu);
    assert_eq!(cu, lengths);
    let file = temp_file("docs.txt", "3 2\n2\n");
    assert_eq!(Documents::read(&file).unwrap(), ids);
    assert_eq!(Mask::Documents(ids).name(), "documents(3)");
}

#[test]
fn the_flag_parses_a_mask_and_a_score_function() {
    let (m, s) = MaskSpec::parse("causal")
        .unwrap()
        .resolve(1, 4, 10)
        .unwrap();
    assert!(m.is_causal() && s.is_identity());
    let (m, s) = MaskSpec::parse("sliding:1024, softcap:30")
        .unwrap()
        .resolve(1, 4, 10)
        .unwrap();
    assert_eq!(
        (m.name(), s.name()),
        ("sliding:1024".into(), "softcap:30".into())
    );
    let (m, s) = MaskSpec::parse("alibi")
        .unwrap()
        .resolve(1, 12, 10)
        .unwrap();
    assert!(m.is_causal(), "the default mask is causal");
    assert!(matches!(s, ScoreMod::Alibi { heads: 12 }));
    let (m, _) = MaskSpec::parse("prefix:256,alibi")
        .unwrap()
        .resolve(1, 2, 300)
        .unwrap();
    assert_eq!(m.name(), "prefix:256");
    assert_eq!(
        MaskSpec::parse("full")
            .unwrap()
            .resolve(1, 1, 1)
            .unwrap()
            .0
            .name(),
        "full"
    );
    let file = temp_file("ok-docs.txt", "4 6");
    let spec: MaskSpec = format!("documents:{}", file.display()).parse().unwrap();
    let (m, _) = spec.resolve(3, 2, 10).unwrap();
    assert_eq!(m.data(), Some(&[0, 0, 0, 0, 1, 1, 1, 1, 1, 1][..]));
}

#[test]
fn a_cuda_file_is_a_mask_a_score_function_or_both() {
    let mask = temp_file(
        "mask.cu",
        "// score_mod( in a comment is no definition\n\
         __device__ __forceinline__ bool mask_mod(int b, int h, int q, int k, \
         const int* __restrict__ data) { return k <= q && (q - k) % 2 == 0; }\n",
    );
    let spec = MaskSpec::parse(&format!("cuda:{}", mask.display())).unwrap();
    let (m, s) = spec.resolve(1, 1, 4).unwrap();
    assert!(m.cuda().unwrap().contains("(q - k) % 2"));
    assert!(s.is_identity());
    // a .cu mask has no Rust function: the CPU refuses it, naming it
    let x = Array4::<f32>::zeros((1, 1, 4, 8));
    let e = forward(x.view(), x.view(), x.view(), &m, &s).unwrap_err();
    assert!(e.to_string().contains("CUDA source only"), "{e}");
    let score = temp_file(
        "score.cu",
        "__device__ __forceinline__ float score_mod(float s, int b, int h, int q, int k) \
         { return 2.0f * s; }\n__device__ __forceinline__ float score_mod_grad(float s, \
         int b, int h, int q, int k) { return 2.0f; }\n",
    );
    let text = format!("sliding:4,cuda:{}", score.display());
    let (m, s) = MaskSpec::parse(&text).unwrap().resolve(1, 1, 4).unwrap();
    assert_eq!(m.name(), "sliding:4");
    assert_eq!(s.name(), format!("cuda:{}", score.display()));
    // one file for both is included once
    let both = temp_file(
        "both.cu",
        &format!(
            "{}\n{}",
            std::fs::read_to_string(&mask).unwrap(),
            std::fs::read_to_string(&score).unwrap()
        ),
    );
    let (m, s) = MaskSpec::parse(&format!("cuda:{}", both.display()))
        .unwrap()
        .resolve(1, 1, 4)
        .unwrap();
    let source = kernel_source(&m, &s).unwrap();
    assert_eq!(source.matches("bool mask_mod").count(), 1);
    assert_eq!(source.matches("float score_mod(").count(), 1);
}

#[test]
fn the_cuda_text_writes_the_parameters_in() {
    let text = Mask::Sliding { window: 1024 }.cuda().unwrap();
    assert!(text.contains(
        "bool mask_mod(int b, int h, int q, int k, const int* __restrict__ data)"
    ));
    assert!(text.contains("q - k < 1024"));
    assert!(
        Mask::PrefixLm { prefix: 256 }
            .cuda()
            .unwrap()
            .contains("k < 256")
    );
    let per_sequence = Documents::from_cu_seqlens(5, &[vec![0, 5], vec![0, 2, 5]]).unwrap();
    assert!(
        Mask::Documents(per_sequence)
            .cuda()
            .unwrap()
            .contains("(long long)b * 5")
    );
    let shared = Documents::from_lengths(&[2, 3]).unwrap();
    assert!(
        Mask::Documents(shared)
            .cuda()
            .unwrap()
            .contains("(long long)b * 0")
    );
    let none = ScoreMod::None.cuda().unwrap();
    assert!(none.contains("#define SCORE_MOD_IDENTITY 1"));
    assert!(none.contains("float score_mod(float s, int b, int h, int q, int k)"));
    assert!(none.contains("float score_mod_grad(float s, int b, int h, int q, int k)"));
    let cap = ScoreMod::SoftCap { cap: 30.0 }.cuda().unwrap();
    // the cap and its inverse, tanh in one instruction
    assert!(
        cap.contains("return 30.0f * t")
            && cap.contains("s * 0.033333335f")
            && cap.contains("tanh.approx.f32")
            && !cap.contains("IDENTITY"),
        "{cap}"
    );
    assert!(
        ScoreMod::Alibi { heads: 12 }
            .cuda()
            .unwrap()
            .contains("/ 12.0f")
    );
    // a Rust closure alone has no CUDA: an error that says how to give it
    let closure = Mask::Custom(CustomMask::new("mine", |_, _, q, k| k <= q));
    assert!(
        closure
            .cuda()
            .unwrap_err()
            .to_string()
            .contains("no CUDA source")
    );
    let with = CustomMask::new("mine", |_, _, q, k| k <= q).with_cuda("bool mask_mod(...)");
    assert_eq!(Mask::Custom(with).cuda().unwrap(), "bool mask_mod(...)");
}

/// A mask text the parser cannot take names the value and lists what is accepted.
#[test]
fn a_bad_mask_text_is_refused_naming_the_value_and_what_is_accepted() {
    let accepted = "accepted:";
    for (text, names) in [
        ("sliding:0", "sliding:0"),
        ("sliding:-3", "\"-3\""),
        ("softcap:0", "softcap:0"),
        ("softcap:-1", "softcap:-1"),
        ("softcap:inf", "softcap:inf"),
        ("softcap:NaN", "softcap:NaN"),
        ("softcap:abc", "\"abc\""),
        ("windowed:3", "\"windowed:3\""),
        ("causal,full", "two masks"),
        ("softcap:3,alibi", "two score functions"),
        ("", "unknown term \"\""),
        ("prefix", "\"\" is not a whole number"),
    ] {
        let e = parse_err(text);
        assert!(e.contains(names) && e.contains(accepted), "{text}: {e}");
    }
}

/// Documents that cannot be a sequence's (ids, cu_seqlens, lengths, a file) say why.
#[test]
fn bad_documents_are_refused_naming_what_is_wrong() {
    // documents: ids going down, cu_seqlens that do not add up, lengths of 0, a file that
    // does not match the tokens, a file that is not lengths
    let e = Documents::from_ids(1, 4, vec![0, 1, 0, 2])
        .unwrap_err()
        .to_string();
    assert!(e.contains("token 2 has id 0 after id 1"), "{e}");
    let e = Documents::from_cu_seqlens(8, &[vec![0, 3, 7]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("[0, 3, 7]") && e.contains("add up"), "{e}");
    let e = Documents::from_cu_seqlens(8, &[vec![0, 3, 3, 8]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("strictly increase"), "{e}");
    let e = Documents::from_cu_seqlens(8, &[vec![1, 8]])
        .unwrap_err()
        .to_string();
    assert!(e.contains("start at 0"), "{e}");
    assert!(
        Documents::from_lengths(&[3, 0])
            .unwrap_err()
            .to_string()
            .contains("length 0")
    );
    let file = temp_file("short.txt", "3 4");
    let spec = MaskSpec::parse(&format!("documents:{}", file.display())).unwrap();
    let e = spec.resolve(1, 1, 8).unwrap_err().to_string();
    assert!(e.contains("add up to 7 tokens, but k and v hold 8"), "{e}");
    let bad = temp_file("bad.txt", "3 x 4");
    assert!(
        parse_err(&format!("documents:{}", bad.display()))
            .contains("\"x\" is not a length")
    );
    let e = parse_err("documents:/no/such/file.txt");
    assert!(
        e.contains("/no/such/file.txt") && e.contains("cannot read"),
        "{e}"
    );
}

/// A user's `.cu` file must define mask_mod or score_mod, and score_mod with its derivative.
#[test]
fn a_cuda_file_without_its_functions_is_refused() {
    // a .cu file that defines neither function, or a score function without its derivative
    let neither = temp_file("neither.cu", "__device__ int f(int x) { return x; }");
    let e = parse_err(&format!("cuda:{}", neither.display()));
    assert!(e.contains("defines neither mask_mod nor score_mod"), "{e}");
    // a name inside a longer name, or in a block comment, is no definition
    let lookalike = temp_file(
        "lookalike.cu",
        "__device__ bool my_mask_mod(int q, int k) { return true; }\n\
         /* float score_mod(float s) */",
    );
    let e = parse_err(&format!("cuda:{}", lookalike.display()));
    assert!(e.contains("defines neither mask_mod nor score_mod"), "{e}");
    let commented = temp_file(
        "commented.cu",
        "__device__ float score_mod(float s, int b, int h, int q, int k) { return s; }\n\
         /* __device__ float score_mod_grad(float s, int b, int h, int q, int k) */",
    );
    let e = parse_err(&format!("cuda:{}", commented.display()));
    assert!(e.contains("defines no score_mod_grad"), "{e}");
    let half = temp_file(
        "half.cu",
        "__device__ float score_mod(float s, int b, int h, int q, int k) { return s; }",
    );
    let e = parse_err(&format!("cuda:{}", half.display()));
    assert!(e.contains("defines no score_mod_grad"), "{e}");
}

/// The CPU forward refuses a mask or score function that does not fit q, k and v.
#[test]
fn a_forward_refuses_a_bad_mask_or_shape_naming_the_cause() {
    // through a forward: the error is an AttnError that names the cause
    let x = Array4::<f32>::zeros((1, 2, 4, 8));
    let run =
        |m: &Mask, s: &ScoreMod| forward(x.view(), x.view(), x.view(), m, s).unwrap_err();
    let e = run(&Mask::Sliding { window: 0 }, &ScoreMod::None);
    assert!(
        matches!(&e, AttnError::Unsupported { what } if what.contains("sliding:0")),
        "{e}"
    );
    let e = run(&Mask::Causal, &ScoreMod::SoftCap { cap: f64::NAN });
    assert!(e.to_string().contains("softcap:NaN"), "{e}");
    let e = run(&Mask::Causal, &ScoreMod::Alibi { heads: 3 });
    assert!(
        e.to_string().contains("built for 3 heads but q has 2"),
        "{e}"
    );
    let docs = Documents::from_lengths(&[2, 3]).unwrap();
    let e = run(&Mask::Documents(docs), &ScoreMod::None);
    assert!(
        e.to_string()
            .contains("add up to 5 tokens, but k and v hold 4"),
        "{e}"
    );
    let two = Documents::from_cu_seqlens(4, &[vec![0, 4], vec![0, 4]]).unwrap();
    let e = run(&Mask::Documents(two), &ScoreMod::None);
    assert!(
        e.to_string()
            .contains("for 2 sequences, but the batch has 1"),
        "{e}"
    );
    // shapes: more queries than keys, kv heads that do not divide the heads
    let (q, kv) = (
        Array4::<f32>::zeros((1, 2, 5, 8)),
        Array4::<f32>::zeros((1, 2, 4, 8)),
    );
    let e = forward(
        q.view(),
        kv.view(),
        kv.view(),
        &Mask::Causal,
        &ScoreMod::None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("more queries than keys"), "{e}");
    let (q, kv) = (
        Array4::<f32>::zeros((1, 3, 4, 8)),
        Array4::<f32>::zeros((1, 2, 4, 8)),
    );
    let e = forward(
        q.view(),
        kv.view(),
        kv.view(),
        &Mask::Causal,
        &ScoreMod::None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("do not divide"), "{e}");
}

/// Every built-in mask tells the kernels its rows' interval of keys, and a document mask's
/// data holds each token's document's first token after the ids; a user's mask has none.
#[test]
fn built_in_masks_give_their_rows_interval() {
    for (mask, lo, hi) in [
        (Mask::Causal, "lo = 0;", "hi = q;"),
        (Mask::Full, "lo = 0;", "hi = tk - 1;"),
        (Mask::Sliding { window: 7 }, "lo = q - 7 + 1;", "hi = q;"),
        (
            Mask::PrefixLm { prefix: 5 },
            "lo = 0;",
            "hi = max(q, min(5, tk) - 1);",
        ),
    ] {
        let text = mask.cuda().unwrap();
        assert!(text.contains("#define MASK_INTERVAL 1"), "{text}");
        assert!(text.contains(lo) && text.contains(hi), "{text}");
    }
    let docs = Documents::from_cu_seqlens(5, &[vec![0, 2, 5], vec![0, 3, 5]]).unwrap();
    assert_eq!(docs.starts(), vec![0, 0, 2, 2, 2, 0, 0, 0, 3, 3]);
    let mask = Mask::Documents(docs);
    assert!(
        mask.cuda()
            .unwrap()
            .contains("lo = data[10 + (long long)b * 5 + q];")
    );
    assert_eq!(
        mask.gpu_data().unwrap(),
        vec![0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 2, 2, 2, 0, 0, 0, 3, 3]
    );
    let custom =
        CustomMask::new("mine", |_, _, q, k| k <= q).with_cuda("bool mask_mod(...)");
    assert!(
        !Mask::Custom(custom)
            .cuda()
            .unwrap()
            .contains("MASK_INTERVAL")
    );
}
