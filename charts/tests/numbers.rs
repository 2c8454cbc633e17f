//! The book's measured numbers cannot drift from the measurements: every claim of
//! `book/numbers.toml` names a chapter, the words of its prose that hold a number, and where
//! that number is in `charts/data/*.json` (or in another committed record: a lab's JSON, a
//! profiler's output); this test formats the record's value as the claim says and fails
//! unless the claim's words hold it and the chapter holds the words.
//!
//! A claim's keys (the file's header says the same for its writers):
//!
//! - `chapter`: the chapter's file under `book/src/`;
//! - `text`: the chapter's words, exactly, that hold the number (line breaks and runs of
//!   spaces count as one space, as they do in the rendered page);
//! - `data`: the JSON file under `charts/data/`, or a path from the repository's root;
//!   with `after`, a text file from the repository's root (a lab log, a profiler's output);
//! - `after` (optional, instead of `row`, `rows` and `field`): the strings that lead to the
//!   number in a text file, each found after the one before it (a kernel's section, then a
//!   metric's name); the number is the first one after the last string, on its line; a
//!   list of such lists takes one number each (for `pick = "sum"`);
//! - `nth` (optional, with `after`): the number's place on its line, from 1 (a table's
//!   column);
//! - `row`: in a file that is a list, the values that pick the row (`{ method = "online",
//!   tokens = 1024, pass = "fwd" }`), a list for any of its values (`mask = ["causal",
//!   "full"]`); left out for a file that is one object;
//! - `rows` (optional): the key of the list `row` picks from, in a file that is an object;
//! - `field`: the value's path in the row, dot-separated: a negative index counts from the
//!   end, `*` takes every item of a list and `N:M` items N to M - 1, like Python's slice
//!   (`ms`, `evals.-1.loss`, `steps.*.loss`, `steps.50:.loss`);
//! - `decimals`: the digits after the point the prose shows;
//! - `reciprocal` (optional): `true` takes one over the value, a rate as the time of one;
//! - `scale` (optional): a factor from the field's unit to the prose's (`1e-3`: ms to s;
//!   100: a fraction to %);
//! - `over` (optional): a second value `{ data, row, field }` (`data` defaults to the
//!   claim's) that the first is divided by, a ratio; or, with `difference = true`, the
//!   relative difference `|a - b| / |b|`; item by item where both are lists;
//! - `pick` (optional): `"min"`, `"max"`, `"mean"`, `"median"` or `"sum"` of what `row` and
//!   `field` (or `after`'s lists) take, for a range's ends, a worst case, an average or a
//!   total of a profile's lines (rows whose value is null, shapes that did not run, left
//!   out).

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

/// Whether a TOML value of a `row` selector equals the JSON's; a list matches any of its
/// values (`mask = ["causal", "full"]`).
fn same(want: &Toml, have: &Json) -> bool {
    match (want, have) {
        (Toml::Array(any), _) => any.iter().any(|w| same(w, have)),
        (Toml::String(w), Json::String(h)) => w == h,
        (Toml::Integer(w), Json::Number(h)) => h.as_i64() == Some(*w),
        (Toml::Float(w), Json::Number(h)) => h.as_f64() == Some(*w),
        (Toml::Boolean(w), Json::Bool(h)) => w == h,
        _ => false,
    }
}

/// The numbers at `path` (dot-separated keys and indices) in `json`: one, or one for each
/// item a `*` (every item) or `N:M` (items N to M - 1, either end left out for the list's)
/// takes from a list. With `skip_null`, nulls are left out rather than refused.
fn at_path(json: &Json, path: &str, skip_null: bool) -> Result<Vec<f64>, String> {
    let mut here = vec![json];
    for part in path.split('.') {
        let mut next = Vec::new();
        for value in here {
            match value {
                Json::Array(items) if part == "*" => next.extend(items),
                Json::Array(items) if part.contains(':') => {
                    let (from, to) = part.split_once(':').unwrap_or_default();
                    let bound = |b: &str, default: usize| {
                        if b.is_empty() {
                            return Ok(default);
                        }
                        b.parse::<usize>().map_err(|_| {
                            format!("`{part}` of `{path}`: give `N:`, `:M` or `N:M`")
                        })
                    };
                    let (from, to) = (bound(from, 0)?, bound(to, items.len())?);
                    next.extend(items.iter().take(to).skip(from));
                }
                Json::Array(items) => {
                    let i: i64 = part.parse().map_err(|_| {
                        format!("`{part}` of `{path}` indexes a list: give a number, `*` or `N:M`")
                    })?;
                    let i = if i < 0 { items.len() as i64 + i } else { i };
                    let item = usize::try_from(i).ok().and_then(|i| items.get(i));
                    next.push(item.ok_or_else(|| {
                        format!("`{path}`: the list has {} items", items.len())
                    })?);
                }
                Json::Object(map) => next.push(
                    map.get(part)
                        .ok_or_else(|| format!("`{path}`: no key `{part}`"))?,
                ),
                _ => {
                    return Err(format!(
                        "`{path}`: `{part}` goes into a number or a string"
                    ));
                }
            }
        }
        here = next;
    }
    here.iter()
        // a row that measured nothing (an error row's null) has no number to range over
        .filter(|v| !(skip_null && v.is_null()))
        .map(|v| {
            v.as_f64()
                .ok_or_else(|| format!("`{path}` is {v}, not a number"))
        })
        .collect()
}

/// The `nth` number (from 1) that follows the strings of `after` in `text`: each string
/// found after the one before it, then the numbers after the last one, on the same line
/// (digits, thousands commas between digits, a point and more digits). A number the line
/// does not hold is refused rather than taken from the next line, where another metric's
/// value is.
fn number_after(text: &str, after: &[&str], nth: usize) -> Result<f64, String> {
    let mut at = 0;
    for (i, s) in after.iter().enumerate() {
        let found = text[at..].find(s).ok_or_else(|| match i {
            0 => format!("no {s:?} in the file"),
            _ => format!("no {s:?} after {:?}", after[i - 1]),
        })?;
        at += found + s.len();
    }
    let rest = &text[at..];
    let mut line = &rest[..rest.find('\n').unwrap_or(rest.len())];
    for count in 1.. {
        let start = line.find(|c: char| c.is_ascii_digit()).ok_or_else(|| {
            format!("no number {count} on the line after {:?}", after.last())
        })?;
        let bytes = line.as_bytes();
        let mut end = start;
        let mut point = false;
        while end < bytes.len() {
            let c = bytes[end];
            let digit_next = bytes.get(end + 1).is_some_and(u8::is_ascii_digit);
            if c.is_ascii_digit() || (c == b',' && !point && digit_next) {
                end += 1;
            } else if c == b'.' && !point && digit_next {
                point = true;
                end += 1;
            } else {
                break;
            }
        }
        if count == nth.max(1) {
            let digits: String = line[start..end].chars().filter(|&c| c != ',').collect();
            return digits.parse().map_err(|e| {
                format!("{:?} after {:?}: {e}", &line[start..end], after.last())
            });
        }
        line = &line[end..];
    }
    unreachable!("the loop returns or fails at the line's end")
}

/// `after`'s lists of strings, one a number: a string, a list of strings, or a list of
/// such lists.
fn after_lists(after: &Toml) -> Result<Vec<Vec<&str>>, String> {
    fn strings(t: &Toml) -> Option<Vec<&str>> {
        match t {
            Toml::String(s) => Some(vec![s.as_str()]),
            Toml::Array(items) if !items.is_empty() => {
                items.iter().map(Toml::as_str).collect()
            }
            _ => None,
        }
    }
    let lists = match after {
        Toml::Array(items) if items.first().is_some_and(Toml::is_array) => {
            items.iter().map(strings).collect()
        }
        _ => strings(after).map(|s| vec![s]),
    };
    lists.ok_or_else(|| {
        "`after` is a string, a list of strings or a list of such lists".into()
    })
}

/// Every number a claim (or its `over`) names: in its file, of the rows it picks, at its
/// field; or in a text file, after the strings of `after`.
fn values(spec: &Table, data: &str) -> Result<Vec<f64>, String> {
    // a bare name is a measurement of charts/data; a path names another committed record
    let path = if data.contains('/') {
        root().join(data)
    } else {
        root().join("charts/data").join(data)
    };
    let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if let Some(after) = spec.get("after") {
        if let Some(key) = ["row", "rows", "field"]
            .iter()
            .find(|k| spec.contains_key(**k))
        {
            return Err(format!(
                "`after` reads a text file: give no `{key}`, which picks from JSON"
            ));
        }
        let nth = match spec.get("nth") {
            None => 1,
            Some(n) => n
                .as_integer()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n >= 1)
                .ok_or("`nth` is a count from 1")?,
        };
        return after_lists(after)?
            .iter()
            .map(|strings| {
                number_after(&text, strings, nth).map_err(|e| format!("{data}: {e}"))
            })
            .collect();
    }
    let json: Json =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let field = get_str(spec, "field")?;
    // the list `row` picks from: the file, or a list inside it
    let list = match spec.get("rows") {
        None => &json,
        Some(Toml::String(key)) => json
            .get(key)
            .ok_or_else(|| format!("{data} has no `{key}`"))?,
        Some(_) => return Err("`rows` is not a key".into()),
    };
    let rows: Vec<&Json> = match (spec.get("row"), list) {
        (None, Json::Array(_)) => return Err(format!("{data} is a list: give `row`")),
        (None, _) => vec![list],
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
    if rows.is_empty() {
        let row = spec.get("row").and_then(Toml::as_table);
        let keys: Vec<String> = row
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k} = {v:?}"))
            .collect();
        return Err(format!("no row of {data} has {}", keys.join(", ")));
    }
    let skip_null = spec.contains_key("pick");
    let mut numbers = Vec::new();
    for row in rows {
        numbers.extend(at_path(row, field, skip_null).map_err(|e| format!("{data}: {e}"))?);
    }
    if numbers.is_empty() {
        return Err(format!("{data}: every `{field}` it picks is null"));
    }
    Ok(numbers)
}

/// The number a claim says its text holds: its values, each divided by `over`'s (or its
/// relative difference from it, with `difference`), scaled, and `pick`ed down to one.
fn number(claim: &Table) -> Result<f64, String> {
    let data = get_str(claim, "data")?;
    let mut numbers = values(claim, data)?;
    if claim
        .get("reciprocal")
        .is_some_and(|r| r.as_bool() == Some(true))
    {
        // a rate quoted as the time of one (tokens a second as milliseconds a token)
        numbers.iter_mut().for_each(|n| *n = 1.0 / *n);
    }
    if let Some(over) = claim.get("over") {
        let over = over.as_table().ok_or("`over` is not a table")?;
        let over_data = over.get("data").and_then(Toml::as_str).unwrap_or(data);
        let by = values(over, over_data).map_err(|e| format!("its `over`: {e}"))?;
        if by.len() != 1 && by.len() != numbers.len() {
            return Err(format!(
                "{} values over {} of `over`: give one, or as many",
                numbers.len(),
                by.len()
            ));
        }
        let difference = claim
            .get("difference")
            .is_some_and(|d| d.as_bool() == Some(true));
        for (i, n) in numbers.iter_mut().enumerate() {
            let b = by[if by.len() == 1 { 0 } else { i }];
            *n = if difference {
                (*n - b).abs() / b.abs()
            } else {
                *n / b
            };
        }
    }
    let scale = match claim.get("scale") {
        None => 1.0,
        Some(s) => s
            .as_float()
            .or_else(|| s.as_integer().map(|i| i as f64))
            .ok_or("`scale` is not a number")?,
    };
    let pick = claim
        .get("pick")
        .map(|p| p.as_str().ok_or("`pick` is not a string"));
    let all = numbers.iter().map(|n| n * scale);
    match (pick.transpose()?, numbers.len()) {
        (None, 1) => Ok(numbers[0] * scale),
        (None, n) => Err(format!(
            "{n} values match: name more of the row, or `pick` \"min\", \"max\", \"mean\", \"median\" or \"sum\""
        )),
        (Some("min"), _) => Ok(all.fold(f64::INFINITY, f64::min)),
        (Some("max"), _) => Ok(all.fold(f64::NEG_INFINITY, f64::max)),
        (Some("mean"), n) => Ok(all.sum::<f64>() / n as f64),
        (Some("sum"), _) => Ok(all.sum()),
        (Some("median"), n) => {
            let mut sorted: Vec<f64> = all.collect();
            sorted.sort_by(f64::total_cmp);
            Ok((sorted[(n - 1) / 2] + sorted[n / 2]) / 2.0)
        }
        (Some(other), _) => Err(format!(
            "`pick` is \"min\", \"max\", \"mean\", \"median\" or \"sum\", not {other:?}"
        )),
    }
}

/// The keys a claim may have, and those of its `over`: a misspelt key would otherwise be
/// left out unseen (a `scal` that scales nothing).
const KEYS: &[&str] = &[
    "chapter",
    "text",
    "data",
    "row",
    "rows",
    "field",
    "decimals",
    "reciprocal",
    "scale",
    "over",
    "difference",
    "pick",
    "after",
    "nth",
];
const OVER_KEYS: &[&str] = &["data", "row", "rows", "field", "after", "nth"];

/// Checks one claim against its JSON and its chapter; `Err` says what disagrees.
fn check(claim: &Table) -> Result<(), String> {
    let over = claim.get("over").and_then(Toml::as_table);
    let unknown = claim.keys().filter(|k| !KEYS.contains(&k.as_str()));
    let unknown_over = over
        .into_iter()
        .flat_map(|o| o.keys())
        .filter(|k| !OVER_KEYS.contains(&k.as_str()));
    if let Some(key) = unknown.chain(unknown_over).next() {
        return Err(format!(
            "`{key}` is no key of a claim (book/numbers.toml's header lists them)"
        ));
    }
    let chapter = get_str(claim, "chapter")?;
    let text = get_str(claim, "text")?;
    let decimals = get(claim, "decimals")?
        .as_integer()
        .and_then(|d| usize::try_from(d).ok())
        .ok_or("`decimals` is not a count of digits")?;
    let number = number(claim)?;
    let shown = formats(number, decimals);
    let text = squash(text);
    if !shown.iter().any(|s| holds_number(&text, s)) {
        return Err(format!(
            "the record gives {} ({number}), which \"{text}\" does not hold",
            shown[0]
        ));
    }
    let path = root().join("book/src").join(chapter);
    let prose =
        fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !squash(&prose).contains(&text) {
        return Err(format!(
            "book/src/{chapter} does not hold \"{text}\" (the record gives {})",
            shown[0]
        ));
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
        "{} of {} claims of book/numbers.toml disagree with the records they quote:\n{}",
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

#[test]
fn a_number_in_a_text_file_is_read_after_its_strings_on_their_line() {
    let log = "$ ncu --metrics a.sum,b.sum run\n  rung_3 (96, 1, 1)\n    a.sum   inst   42,172,416\n    \
               b.sum   %   12.34\n  rung_4 (96, 1, 1)\n    a.sum   inst   0\n    b.sum\n    c   9\n";
    // the command line names the metrics too: the kernel's line comes first
    assert_eq!(
        number_after(log, &["rung_3 (", "a.sum"], 1),
        Ok(42_172_416.0)
    );
    assert_eq!(number_after(log, &["rung_3 (", "b.sum"], 1), Ok(12.34));
    assert_eq!(number_after(log, &["rung_4 (", "a.sum"], 1), Ok(0.0));
    // b.sum of rung 4 has no value on its line: c's 9 is not taken for it
    assert!(number_after(log, &["rung_4 (", "b.sum"], 1).is_err());
    assert!(
        number_after(log, &["rung_5 ("], 1)
            .unwrap_err()
            .contains("rung_5")
    );
    // a sentence's full stop and a list's comma end the number
    assert_eq!(number_after("took 47 ms. Then 3,0", &["took"], 1), Ok(47.0));
    assert_eq!(number_after("x: 1.5, 2", &["x:"], 1), Ok(1.5));
    // a table's columns: the nth number on the line, and none past its end
    let table = "   T   fwd ms  dq ms\n 16384   5.183   7.020   forward 318.2\n";
    assert_eq!(number_after(table, &["\n 16384"], 2), Ok(7.02));
    assert_eq!(number_after(table, &["\n 16384"], 3), Ok(318.2));
    assert!(number_after(table, &["\n 16384"], 4).is_err());
    // a list of lists takes a number a list, which `pick = "sum"` adds
    let profile: Table = "after = [[\"rung_3 (\", \"a.sum\"], [\"rung_3 (\", \"b.sum\"]]"
        .parse()
        .unwrap();
    let lists = after_lists(&profile["after"]).unwrap();
    let sum: f64 = lists.iter().map(|l| number_after(log, l, 1).unwrap()).sum();
    assert_eq!(sum, 42_172_416.0 + 12.34);
    assert!(after_lists(&Toml::Integer(3)).is_err());
}

#[test]
fn a_list_in_a_row_picks_any_of_its_values() {
    let rows: Json = serde_json::from_str(
        r#"[{"mask": "causal", "ms": 1.0}, {"mask": "full", "ms": 2.0}, {"mask": "documents", "ms": 4.0}]"#,
    )
    .unwrap();
    let want: Toml =
        "m = [\"causal\", \"documents\"]".parse::<Table>().unwrap()["m"].clone();
    let picked: Vec<f64> = rows
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| same(&want, &r["mask"]))
        .map(|r| r["ms"].as_f64().unwrap())
        .collect();
    assert_eq!(picked, [1.0, 4.0]);
    assert!(!same(&Toml::Array(Vec::new()), &rows[0]["mask"]));
}

#[test]
fn a_misspelt_key_is_refused() {
    let mut claim: Table = "chapter = \"01-naive.md\"\nscal = 1e-6".parse().unwrap();
    assert!(check(&claim).unwrap_err().contains("`scal`"));
    claim.remove("scal");
    claim.insert(
        "over".into(),
        "x = 1".parse::<Table>().map(Toml::Table).unwrap(),
    );
    assert!(check(&claim).unwrap_err().contains("`x`"));
}
