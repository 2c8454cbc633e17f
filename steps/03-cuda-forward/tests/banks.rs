//! The bank exercise's checker can tell right from wrong: it accepts the step's own `turns`
//! and refuses the template as shipped (a `todo!()`), a count that forgets the broadcast,
//! one that counts threads a bank rather than words, and one with banks of a byte. The rule itself gives the chapter's
//! numbers: 1 turn for consecutive words and for a broadcast, 32 for a column of 128-byte
//! rows, 1 once the rows are padded, and rung 3's 8-way and 4-way conflicts.

use step03_cuda_forward::banks::{cases, check, turns};

#[test]
fn the_rule_gives_the_chapters_numbers() {
    let of = |name: &str| {
        let c = cases()
            .into_iter()
            .find(|c| c.name.starts_with(name))
            .unwrap();
        turns(&c.addresses)
    };
    assert_eq!(of("consecutive words"), 1);
    assert_eq!(of("one word for all"), 1);
    assert_eq!(of("a column of a tile with 128-byte rows"), 32);
    assert_eq!(of("a column of rows padded"), 1);
    assert_eq!(of("a column of 64-byte rows"), 16);
    assert_eq!(of("every other word"), 2);
    assert_eq!(of("rung 3's q"), 8);
    assert_eq!(of("rung 3's v"), 4);
}

#[test]
fn the_checker_accepts_the_solution() {
    assert_eq!(check(&turns), Ok(cases().len()));
}

#[test]
fn the_checker_refuses_the_template() {
    let e = check(&|_: &[u32; 32]| -> u32 { todo!() }).unwrap_err();
    assert!(e.why.contains("not yet implemented"), "{e}");
}

#[test]
fn the_checker_refuses_a_count_without_the_broadcast() {
    // threads a bank, every address counted: right wherever no two threads share a word
    let threads = |a: &[u32; 32]| {
        let mut n = [0u32; 32];
        a.iter().for_each(|&a| n[(a / 4 % 32) as usize] += 1);
        n.into_iter().max().unwrap_or(0)
    };
    let e = check(&threads).unwrap_err();
    assert_eq!(e.case, "one word for all 32 threads", "{e}");
    assert!(e.why.contains("broadcast"), "{e}");
}

#[test]
fn the_checker_refuses_banks_of_bytes() {
    // the bank of byte a as a % 32, where it is (a / 4) % 32: 32 banks of one byte
    let bytes = |a: &[u32; 32]| {
        let mut words = vec![Vec::new(); 32];
        for &a in a {
            let (word, bank) = (a / 4, (a % 32) as usize);
            if !words[bank].contains(&word) {
                words[bank].push(word);
            }
        }
        words.iter().map(|w| w.len() as u32).max().unwrap_or(0)
    };
    let e = check(&bytes).unwrap_err();
    assert_eq!(e.case, "consecutive words", "{e}");
}
