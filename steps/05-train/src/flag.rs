//! Numbers from the command line, checked where they enter: each parser is a clap value
//! parser, so a refused value is reported with the flag that carried it (`invalid value
//! 'NaN' for '--lr <LR>': ...`) before anything loads. The flags that take them also take
//! `allow_hyphen_values`, so that `--lr -1` and `--lr -inf` reach the parser (and its
//! message) rather than reading as an unknown flag `-1`. A NaN or an infinity is refused by
//! every one: it would otherwise reach the model and be reported, steps later, as the
//! attention's non-finite input.

/// A finite number, or why not.
fn finite(text: &str) -> Result<f64, String> {
    let x: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    if !x.is_finite() {
        return Err(format!("{text} is not a finite number"));
    }
    Ok(x)
}

/// A finite number that fits in an `f32`.
fn finite_f32(text: &str) -> Result<f32, String> {
    let x = finite(text)?;
    if x.abs() > f32::MAX as f64 {
        return Err(format!("{text} is larger than an f32 holds"));
    }
    Ok(x as f32)
}

/// The largest `--lr` accepted. AdamW moves each weight by about the learning rate a step
/// whatever the gradient's size, and the weights start near 0.02 (GPT-2's initialisation):
/// a rate above 1 throws every weight far past where it started on the first step.
pub const MAX_LR: f32 = 1.0;

/// `--lr`: in (0, [`MAX_LR`]].
pub fn learning_rate(text: &str) -> Result<f32, String> {
    let x = finite_f32(text)?;
    if x <= 0.0 || x > MAX_LR {
        return Err(format!(
            "a learning rate of {text}: it takes a number above 0 and at most {MAX_LR} (AdamW \
             moves each weight by about this much a step; 3e-3 and 6e-4 are usual)"
        ));
    }
    Ok(x)
}

/// A fraction, in [0, 1]: `--min-lr-frac`, `--weight-decay`.
pub fn fraction(text: &str) -> Result<f32, String> {
    let x = finite_f32(text)?;
    if !(0.0..=1.0).contains(&x) {
        return Err(format!("{text}: it takes a number from 0 to 1"));
    }
    Ok(x)
}

/// A finite number above 0: `--clip`.
pub fn positive(text: &str) -> Result<f32, String> {
    let x = finite_f32(text)?;
    if x <= 0.0 {
        return Err(format!("{text}: it takes a number above 0"));
    }
    Ok(x)
}

/// Seconds, above 0: `--max-seconds`.
pub fn seconds(text: &str) -> Result<f64, String> {
    let x = finite(text)?;
    if x <= 0.0 {
        return Err(format!(
            "{text} seconds: it takes a number of seconds above 0"
        ));
    }
    Ok(x)
}

/// `--temperature`: finite, 0 or more (0 always takes the likeliest byte).
pub fn temperature(text: &str) -> Result<f32, String> {
    let x = finite_f32(text)?;
    if x < 0.0 {
        return Err(format!(
            "a temperature of {text}: it takes a number of 0 or more (0 always takes the \
             likeliest byte; below 1 sharper, above 1 flatter)"
        ));
    }
    Ok(x)
}

/// A count of 1 or more (`generate --runs`): the one parser every program uses.
pub use flash_core::check::at_least_one;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_parser_refuses_nan_and_infinities() {
        for bad in ["NaN", "nan", "inf", "-inf", "infinity", "1e39", "x", ""] {
            assert!(learning_rate(bad).is_err(), "{bad}");
            assert!(fraction(bad).is_err(), "{bad}");
            assert!(positive(bad).is_err(), "{bad}");
            assert!(temperature(bad).is_err(), "{bad}");
        }
        for bad in ["NaN", "inf", "-inf", "1e400", "0", "-1"] {
            assert!(seconds(bad).is_err(), "{bad}");
        }
        assert_eq!(learning_rate("3e-3"), Ok(3e-3));
        assert!(learning_rate("0").is_err() && learning_rate("1e30").is_err());
        assert_eq!(fraction("0"), Ok(0.0));
        assert!(fraction("-5").is_err() && fraction("1.5").is_err());
        assert_eq!(temperature("0"), Ok(0.0));
        assert!(temperature("-1").is_err());
        assert_eq!(at_least_one("3"), Ok(3));
        assert!(at_least_one("0").is_err() && at_least_one("-1").is_err());
    }
}
