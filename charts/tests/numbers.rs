//! The book's measured numbers cannot drift from the measurements: every claim of
//! `book/numbers.toml` names a chapter, the words of its prose that hold a number, and where
//! that number is in `charts/data/*.json`; this test formats the JSON's value as the claim
//! says and fails unless the claim's words hold it and the chapter holds the words.
//!
//! A claim's keys (the file's header says the same for its writers):
//!
//! - `chapter`: the chapter's file under `book/src/`;
//! - `text`: the chapter's words, exactly, that hold the number (line breaks and runs of
//!   spaces count as one space, as they do in the rendered page);
//! - `data`: the JSON file under `charts/data/`;
//! - `row`: in a file that is a list, the values that pick the row (`{ method = "online",
//!   tokens = 1024, pass = "fwd" }`); left out for a file that is one object;
//! - `field`: the value's path in the row, dot-separated, a negative index counting from the
//!   end (`ms`, `evals.-1.loss`);
//! - `decimals`: the digits after the point the prose shows;
//! - `scale` (optional): a factor from the field's unit to the prose's (`1e-3`: ms to s);
//! - `over` (optional): a second value `{ data, row, field }` (`data` defaults to the
//!   claim's) that the first is divided by: a ratio;
//! - `pick` (optional): `"min"` or `"max"` of the rows `row` matches, for a range's ends.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use toml::{Table, Value as Toml};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the charts crate sits in the workspace's root")
        .to_path_buf()
}

/// Runs of whitespace as one space: the prose wraps its lines anywhere.
fn squash(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `value` with `decimals` digits after the point, and the same with the integer part's
/// thousands separated by commas (the prose writes 1,224 and 1224 alike).
fn formats(value: f64, decimals: usize) -> [String; 2] {
    let plain = format!("{value:.decimals$}");
    let (sign, digits) = plain.split_at(usize::from(plain.starts_with('-')));
    let (int, frac) = digits.split_at(digits.find('.').unwrap_or(digits.len()));
    let mut grouped = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    [plain.clone(), format!("{sign}{grouped}{frac}")]
}

/// Whether `number` stands in `text` as a whole number: not the tail of a longer one
/// (`13.4` holds `3.4`) nor its head (`3.41` holds `3.4`).
fn holds_number(text: &str, number: &str) -> bool {
    let bytes = text.as_bytes();
    text.match_indices(number).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let digit_before = before.is_some_and(|c| c.is_ascii_digit() || c == '.')
            || (before == Some(',') && at >= 2 && bytes[at - 2].is_ascii_digit());
        let mut after = text[at + number.len()..].chars();
        let next = after.next();
        let digit_after = next.is_some_and(|c| c.is_ascii_digit())
            || (matches!(next, Some('.') | Some(','))
                && after.next().is_some_and(|c| c.is_ascii_digit()));
        !digit_before && !digit_after
    })
}

fn get<'a>(claim: &'a Table, key: &str) -> Result<&'a Toml, String> {
    claim.get(key).ok_or_else(|| format!("has no `{key}`"))
}

fn get_str<'a>(claim: &'a Table, key: &str) -> Result<&'a str, String> {
    get(claim, key)?
        .as_str()
        .ok_or_else(|| format!("`{key}` is not a string"))
}

/// Whether a TOML value of a `row` selector equals the JSON's.
fn same(want: &Toml, have: &Json) -> bool {
    match (want, have) {
        (Toml::String(w), Json::String(h)) => w == h,
        (Toml::Integer(w), Json::Number(h)) => h.as_i64() == Some(*w),
        (Toml::Float(w), Json::Number(h)) => h.as_f64() == Some(*w),
        (Toml::Boolean(w), Json::Bool(h)) => w == h,
        _ => false,
    }
}

/// The value at `path` (dot-separated keys and indices) in `json`.
fn at_path<'a>(json: &'a Json, path: &str) -> Result<&'a Json, String> {
    let mut here = json;
    for part in path.split('.') {
        here = match here {
            Json::Array(items) => {
                let i: i64 = part.parse().map_err(|_| {
                    format!("`{part}` of `{path}` indexes a list: give a number")
                })?;
                let i = if i < 0 { items.len() as i64 + i } else { i };
                usize::try_from(i)
                    .ok()
                    .and_then(|i| items.get(i))
                    .ok_or_else(|| {
                        format!("`{path}`: the list has {} items", items.len())
                    })?
            }
            Json::Object(map) => map
                .get(part)
                .ok_or_else(|| format!("`{path}`: no key `{part}`"))?,
            _ => return Err(format!("`{path}`: `{part}` goes into a number or a string")),
        };
    }
    Ok(here)
}

/// The value a claim (or its `over`) names: its file, its row, its field.
fn value(spec: &Table, data: &str, pick: Option<&str>) -> Result<f64, String> {
    let path = root().join("charts/data").join(data);
    let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let json: Json =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let field = get_str(spec, "field")?;
    let rows: Vec<&Json> = match (spec.get("row"), &json) {
        (None, _) => vec![&json],
        (Some(Toml::Table(want)), Json::Array(rows)) => rows
            .iter()
            .filter(|row| {
                want.iter()
                    .all(|(k, w)| row.get(k).is_some_and(|h| same(w, h)))
            })
            .collect(),
        (Some(Toml::Table(_)), _) => return Err(format!("{data} is not a list of rows")),
        (Some(_), _) => return Err("`row` is not a table".into()),
    };
    let numbers = rows
        .iter()
        .map(|row| {
            at_path(row, field)?
                .as_f64()
                .ok_or_else(|| format!("{data}: `{field}` is not a number"))
        })
        .collect::<Result<Vec<f64>, String>>()?;
    let described = || match spec.get("row").and_then(Toml::as_table) {
        Some(row) => {
            let keys: Vec<String> =
                row.iter().map(|(k, v)| format!("{k} = {v:?}")).collect();
            format!("{data} with {}", keys.join(", "))
        }
        None => data.to_string(),
    };
    match (pick, numbers.as_slice()) {
        (_, []) => Err(format!("no row of {} matches", described())),
        (None, [one]) => Ok(*one),
        (None, many) => Err(format!(
            "{} rows of {} match: name more keys, or `pick` \"min\" or \"max\"",
            many.len(),
            described()
        )),
        (Some("min"), all) => Ok(all.iter().copied().fold(f64::INFINITY, f64::min)),
        (Some("max"), all) => Ok(all.iter().copied().fold(f64::NEG_INFINITY, f64::max)),
        (Some(other), _) => Err(format!("`pick` is \"min\" or \"max\", not {other:?}")),
    }
}

/// Checks one claim against its JSON and its chapter; `Err` says what disagrees.
fn check(claim: &Table) -> Result<(), String> {
    let chapter = get_str(claim, "chapter")?;
    let text = get_str(claim, "text")?;
    let data = get_str(claim, "data")?;
    let pick = claim
        .get("pick")
        .map(|p| p.as_str().ok_or("`pick` is not a string"));
    let pick = pick.transpose()?;
    let decimals = get(claim, "decimals")?
        .as_integer()
        .and_then(|d| usize::try_from(d).ok())
        .ok_or("`decimals` is not a count of digits")?;
    let scale = match claim.get("scale") {
        None => 1.0,
        Some(s) => s
            .as_float()
            .or_else(|| s.as_integer().map(|i| i as f64))
            .ok_or("`scale` is not a number")?,
    };
    let mut number = value(claim, data, pick)? * scale;
    if let Some(over) = claim.get("over") {
        let over = over.as_table().ok_or("`over` is not a table")?;
        let over_data = over.get("data").and_then(Toml::as_str).unwrap_or(data);
        number /= value(over, over_data, None).map_err(|e| format!("its `over`: {e}"))?;
    }
    let shown = formats(number, decimals);
    let text = squash(text);
    if !shown.iter().any(|s| holds_number(&text, s)) {
        return Err(format!(
            "the JSON gives {} ({number}), which \"{text}\" does not hold",
            shown[0]
        ));
    }
    let path = root().join("book/src").join(chapter);
    let prose =
        fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !squash(&prose).contains(&text) {
        return Err(format!("book/src/{chapter} does not hold \"{text}\""));
    }
    Ok(())
}

fn claims() -> Vec<Table> {
    let path = root().join("book/numbers.toml");
    let text =
        fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file: Table = text
        .parse()
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    match file.get("claim") {
        None => Vec::new(),
        Some(Toml::Array(claims)) => claims
            .iter()
            .map(|c| {
                c.as_table()
                    .cloned()
                    .unwrap_or_else(|| panic!("{}: a claim is not a table", path.display()))
            })
            .collect(),
        Some(_) => panic!(
            "{}: `claim` is not a list of [[claim]] tables",
            path.display()
        ),
    }
}

#[test]
fn every_number_the_prose_quotes_is_the_json_s() {
    let claims = claims();
    let data = fs::read_dir(root().join("charts/data")).map_or(0, |d| d.count());
    // a book with measurements quotes some of them; none checked would pass unseen
    assert!(
        !claims.is_empty() || data == 0,
        "book/numbers.toml has no claim, and charts/data holds {data} files the book can quote"
    );
    let failures: Vec<String> = claims
        .iter()
        .filter_map(|claim| {
            check(claim).err().map(|why| {
                let chapter = claim.get("chapter").and_then(Toml::as_str).unwrap_or("?");
                let text = claim.get("text").and_then(Toml::as_str).unwrap_or("?");
                format!("{chapter}, \"{}\": {why}", squash(text))
            })
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} claims of book/numbers.toml disagree with charts/data:\n{}",
        failures.len(),
        claims.len(),
        failures.join("\n")
    );
}

#[test]
fn a_number_is_found_whole_and_in_either_grouping() {
    assert_eq!(formats(1224.6032, 0), ["1225".to_string(), "1,225".into()]);
    assert_eq!(formats(9.182937, 1)[0], "9.2");
    assert!(holds_number("takes 9.2 ms", "9.2"));
    assert!(!holds_number("takes 19.2 ms", "9.2"));
    assert!(!holds_number("takes 9.25 ms", "9.2"));
    assert!(holds_number("3.4, 6.6, 13.0 and 25.8 MB", "6.6"));
    assert!(!holds_number("1,224 tokens", "224"));
    assert!(holds_number("2.06× as fast", "2.06"));
}
