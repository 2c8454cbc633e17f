//! Chapter 3's first CPU exercise: how many turns shared memory's 32 banks take to serve a
//! warp's 32 four-byte loads, written by the reader in `exercises/banks.rs`. The checker
//! asks it about the accesses the chapter draws and the ladder's rungs make, then about
//! seeded random ones, and holds each answer to [`turns`], the rule as the primer states
//! it. The `exercise` binary runs it on the reader's file.

use flash_core::exercise::{NotYet, attempt};
use flash_core::inputs::SplitMix64;

/// The template the reader fills in.
pub const TEMPLATE: &str = "steps/03-cuda-forward/exercises/banks.rs";

/// Where the solution is.
pub const SOLUTION: &str = "turns in steps/03-cuda-forward/src/banks.rs \
     (chapter 3, Exercises, under Solution)";

/// The signature of the exercise: a warp's 32 byte addresses to the banks' turns.
pub type Turns<'a> = dyn Fn(&[u32; 32]) -> u32 + 'a;

// ANCHOR: turns
/// The turns shared memory takes to serve thread `i`'s 4-byte load at byte `addresses[i]`:
/// each bank (the word at byte `a` is in bank `(a / 4) % 32`) serves one word a turn, to
/// every thread that asked for that word, so the busiest bank's count of different words
/// is the number of turns.
pub fn turns(addresses: &[u32; 32]) -> u32 {
    let mut words: Vec<Vec<u32>> = vec![Vec::new(); 32];
    for &a in addresses {
        let (word, bank) = (a / 4, (a / 4 % 32) as usize);
        if !words[bank].contains(&word) {
            words[bank].push(word);
        }
    }
    words.iter().map(|w| w.len() as u32).max().unwrap_or(0)
}
// ANCHOR_END: turns

/// One case: a name, the 32 addresses, and a hint for an answer that is too many turns or
/// too few.
pub struct Case {
    pub name: String,
    pub addresses: [u32; 32],
    pub hint: &'static str,
}

fn case(name: &str, hint: &'static str, address: impl Fn(u32) -> u32) -> Case {
    Case {
        name: name.into(),
        addresses: std::array::from_fn(|i| address(i as u32)),
        hint,
    }
}

/// The three accesses of the chapter's figure; a column of rows padded by one word, and of
/// 64-byte rows; every other word; rung 3's loads of q and of v at head dim 64 (lane `4g +
/// t` reads row `g`, column `2t`, of 128-byte rows; and rows `2t` and `2t + 1` of column
/// `g`, as 16-bit values); then 32 seeded warps of random words in 2 KB.
pub fn cases() -> Vec<Case> {
    let same_word = "two threads that read one word are served in one turn (a broadcast)";
    let words =
        "a bank serves one word a turn: count the different words of the busiest bank";
    let mut all = vec![
        case("consecutive words", words, |i| 4 * i),
        case("one word for all 32 threads", same_word, |_| 256),
        case("a column of a tile with 128-byte rows", words, |i| 128 * i),
        case("a column of rows padded to 132 bytes", words, |i| 132 * i),
        case("a column of 64-byte rows", words, |i| 64 * i),
        case("every other word", words, |i| 8 * i),
        case(
            "rung 3's q: row lane / 4, column 2·(lane % 4), 128-byte rows",
            words,
            |l| 128 * (l / 4) + 4 * (l % 4),
        ),
        case(
            "rung 3's v: rows 2·(lane % 4), column lane / 4",
            same_word,
            |l| 128 * (2 * (l % 4)) + 2 * (l / 4) / 4 * 4,
        ),
    ];
    let mut rng = SplitMix64::new(3300);
    for n in 0..32 {
        let addresses = std::array::from_fn(|_| 4 * (rng.next_u64() % 512) as u32);
        all.push(Case {
            name: format!("random words in 2 KB, warp {n}"),
            addresses,
            hint: words,
        });
    }
    all
}

/// Checks `turns_of` (the reader's) on every case against [`turns`]. The number of cases, or
/// the first that fails, with the right count and a hint.
pub fn check(turns_of: &Turns) -> Result<usize, NotYet> {
    let all = cases();
    for c in &all {
        let got = attempt(&c.name, || turns_of(&c.addresses))?;
        let expected = turns(&c.addresses);
        if got != expected {
            return Err(NotYet::new(
                &c.name,
                format!("{got} turns, where the banks take {expected}: {}", c.hint),
            ));
        }
    }
    Ok(all.len())
}
