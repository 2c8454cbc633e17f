//! A small reader and writer of NumPy's `.npy` format, for the `float32` arrays the `attend`
//! command exchanges with other frameworks.
//!
//! The format (NumPy's `numpy.lib.format`): the magic `\x93NUMPY`, a major and a minor version
//! byte, the header's length (two bytes little-endian in version 1, four in versions 2 and 3),
//! then the header, a Python dict literal such as
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (1, 12, 1024, 64), }` padded with spaces
//! to a multiple of 64 bytes and ended by a newline, then the data.
//!
//! We read only what the attention methods take, and say so when a file is anything else:
//! little-endian `float32` (`'<f4'`) in C order. We write version 1.0, which every NumPy reads.
//!
//! ## Layout
//!
//! - [`read_f32`]: any number of dimensions; [`read_f32_4d`]: exactly `[batch, heads, tokens,
//!   head_dim]`.
//! - [`write_f32`]: an array of any dimension, in C order.
//! - [`NpyError`]: the file and what was wrong with it.

use std::fmt;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use ndarray::{Array4, ArrayD, ArrayView, Dimension, IxDyn};

const MAGIC: &[u8] = b"\x93NUMPY";

/// What was wrong with one `.npy` file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NpyError {
    pub path: PathBuf,
    pub what: String,
}

impl fmt::Display for NpyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.what)
    }
}

impl std::error::Error for NpyError {}

fn error(path: &Path, what: impl Into<String>) -> NpyError {
    NpyError {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

/// Reads a little-endian `float32` C-order array of any number of dimensions.
pub fn read_f32(path: &Path) -> Result<ArrayD<f32>, NpyError> {
    let bytes = fs::read(path).map_err(|e| {
        error(
            path,
            format!("cannot read it ({e}); expected a float32 .npy file"),
        )
    })?;
    parse_f32(&bytes).map_err(|what| error(path, what))
}

/// Reads a little-endian `float32` C-order array of shape `[batch, heads, tokens, head_dim]`.
pub fn read_f32_4d(path: &Path) -> Result<Array4<f32>, NpyError> {
    let array = read_f32(path)?;
    let shape = array.shape().to_vec();
    array.into_dimensionality().map_err(|_| {
        error(
            path,
            format!(
                "shape {} has {} dimensions; expected 4: [batch, heads, tokens, head_dim]",
                python_shape(&shape),
                shape.len()
            ),
        )
    })
}

/// Parses the bytes of a whole `.npy` file holding `float32` data.
fn parse_f32(bytes: &[u8]) -> Result<ArrayD<f32>, String> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not a .npy file: it does not start with the magic \\x93NUMPY".into());
    }
    let major = bytes[6];
    let (header_len, header_start) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        _ => {
            return Err(format!(
                ".npy format version {major}.{} is not one we read; expected 1.0, 2.0 or 3.0",
                bytes[7]
            ));
        }
    };
    let data_start = header_start + header_len;
    let header = bytes
        .get(header_start..data_start)
        .ok_or("the file ends inside its header")?;
    let header = std::str::from_utf8(header).map_err(|_| "the header is not text")?;

    let descr = dict_value(header, "descr")?;
    let descr = descr.trim_matches(|c| c == '\'' || c == '"');
    match descr {
        "<f4" => {}
        ">f4" => {
            return Err(
                "dtype is big-endian float32 ('>f4'); expected little-endian float32 ('<f4'): \
                 save x.astype('<f4')"
                    .into(),
            );
        }
        other => {
            return Err(format!(
                "dtype is {other:?}{}; expected float32 ('<f4'): save x.astype(np.float32)",
                dtype_name(other)
                    .map(|n| format!(" ({n})"))
                    .unwrap_or_default()
            ));
        }
    }
    match dict_value(header, "fortran_order")? {
        "False" => {}
        "True" => {
            return Err(
                "the data is in Fortran (column-major) order; expected C order: \
                 save np.ascontiguousarray(x)"
                    .into(),
            );
        }
        other => return Err(format!("fortran_order is {other:?}; expected False")),
    }
    let shape = parse_shape(dict_value(header, "shape")?)?;

    let data = &bytes[data_start..];
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or("the shape's element count overflows")?;
    if data.len() != count * 4 {
        return Err(format!(
            "shape {} needs {} bytes of float32 data, the file holds {}",
            python_shape(&shape),
            count * 4,
            data.len()
        ));
    }
    let values: Vec<f32> = data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    ArrayD::from_shape_vec(IxDyn(&shape), values).map_err(|e| e.to_string())
}

/// The text of one value of the header dict, up to the next top-level comma.
fn dict_value<'h>(header: &'h str, key: &str) -> Result<&'h str, String> {
    let at = [format!("'{key}'"), format!("\"{key}\"")]
        .iter()
        .find_map(|k| header.find(k.as_str()).map(|i| i + k.len()))
        .ok_or_else(|| format!("the header has no {key:?}: {header:?}"))?;
    let rest = header[at..].trim_start();
    let rest = rest
        .strip_prefix(':')
        .ok_or_else(|| format!("malformed header near {key:?}: {header:?}"))?
        .trim_start();
    // a tuple runs to its closing parenthesis; anything else to the next comma or brace
    let end = if rest.starts_with('(') {
        rest.find(')').map(|i| i + 1)
    } else {
        rest.find([',', '}'])
    }
    .ok_or_else(|| format!("malformed header near {key:?}: {header:?}"))?;
    Ok(rest[..end].trim())
}

fn parse_shape(tuple: &str) -> Result<Vec<usize>, String> {
    let inner = tuple
        .strip_prefix('(')
        .and_then(|t| t.strip_suffix(')'))
        .ok_or_else(|| format!("shape {tuple:?} is not a tuple"))?;
    inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse()
                .map_err(|_| format!("shape {tuple:?} has a size {s:?} that is not a count"))
        })
        .collect()
}

fn dtype_name(descr: &str) -> Option<&'static str> {
    Some(match descr.trim_start_matches(['<', '>', '|', '=']) {
        "f8" => "float64",
        "f2" => "float16",
        "i8" => "int64",
        "i4" => "int32",
        "u1" => "uint8",
        "b1" => "bool",
        "V2" => "raw 2-byte values (bfloat16?)",
        _ => return None,
    })
}

/// A shape as NumPy prints it: `(1, 12, 1024, 64)`, `(5,)`.
fn python_shape(shape: &[usize]) -> String {
    match shape {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Writes an array as a version 1.0 `.npy` file of little-endian `float32` in C order.
pub fn write_f32<D: Dimension>(path: &Path, array: ArrayView<f32, D>) -> Result<(), NpyError> {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': {}, }}",
        python_shape(array.shape())
    );
    // magic (6) + version (2) + length (2) + header, a multiple of 64 ending in a newline
    let unpadded = MAGIC.len() + 4 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let len = u16::try_from(header.len()).expect("a header of a few dims fits in 64 KiB");

    let write = || -> std::io::Result<()> {
        let mut w = BufWriter::new(fs::File::create(path)?);
        w.write_all(MAGIC)?;
        w.write_all(&[1, 0])?;
        w.write_all(&len.to_le_bytes())?;
        w.write_all(header.as_bytes())?;
        // iter() walks the array in logical (C) order whatever its memory layout
        for x in array.iter() {
            w.write_all(&x.to_le_bytes())?;
        }
        w.flush()
    };
    write().map_err(|e| error(path, format!("cannot write it: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array, Array4};

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("npy-{name}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A hand-made file: version, descr, order and shape as given, `data` raw.
    fn npy_bytes(version: u8, descr: &str, fortran: &str, shape: &str, data: &[u8]) -> Vec<u8> {
        let header =
            format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}\n");
        let mut b = MAGIC.to_vec();
        b.extend([version, 0]);
        if version == 1 {
            b.extend((header.len() as u16).to_le_bytes());
        } else {
            b.extend((header.len() as u32).to_le_bytes());
        }
        b.extend(header.as_bytes());
        b.extend(data);
        b
    }

    #[test]
    fn round_trip_keeps_every_bit_and_the_shape() {
        let dir = temp_dir("round-trip");
        let a = Array::from_shape_fn((2, 3, 5, 7), |(i, j, k, l)| {
            (i as f32 - 0.5) * 1e-3 + j as f32 * 7.25 - k as f32 / 3.0 + (l as f32).exp()
        });
        let path = dir.join("a.npy");
        write_f32(&path, a.view()).unwrap();
        let bytes = fs::read(&path).unwrap();
        let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!(
            (10 + header_len) % 64,
            0,
            "data starts on a 64-byte boundary"
        );
        let b = read_f32_4d(&path).unwrap();
        assert_eq!(a.shape(), b.shape());
        assert!(
            a.iter()
                .zip(b.iter())
                .all(|(x, y)| x.to_bits() == y.to_bits())
        );

        // a transposed view is written in logical order, not memory order
        let t = a.view().permuted_axes([3, 2, 1, 0]);
        write_f32(&path, t).unwrap();
        let back = read_f32(&path).unwrap();
        assert_eq!(back.shape(), &[7, 5, 3, 2]);
        assert!(back.iter().zip(t.iter()).all(|(x, y)| x == y));
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn reads_versions_two_and_three_and_one_dim_shapes() {
        let data: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        for version in [2, 3] {
            let a = parse_f32(&npy_bytes(version, "<f4", "False", "(2,)", &data)).unwrap();
            assert_eq!(a.as_slice().unwrap(), &[1.5, -2.0]);
        }
    }

    #[test]
    fn rejects_what_it_cannot_take_and_says_what_it_expected() {
        let four = vec![0u8; 4 * 4];
        let cases = [
            (
                npy_bytes(1, "<f8", "False", "(2,)", &four),
                "'<f4'",
                "float64",
            ),
            (
                npy_bytes(1, ">f4", "False", "(4,)", &four),
                "little-endian",
                "'>f4'",
            ),
            (
                npy_bytes(1, "<f4", "True", "(2, 2)", &four),
                "C order",
                "Fortran",
            ),
            (
                npy_bytes(1, "<f4", "False", "(2, 3)", &four),
                "24 bytes",
                "holds 16",
            ),
            (b"PK\x03\x04 a zip file".to_vec(), "magic", "not a .npy"),
            (
                npy_bytes(9, "<f4", "False", "(4,)", &four),
                "version 9",
                "1.0",
            ),
        ];
        for (bytes, expected, found) in cases {
            let err = parse_f32(&bytes).unwrap_err();
            assert!(
                err.contains(expected) && err.contains(found),
                "{err:?} should mention {expected:?} and {found:?}"
            );
        }
    }

    #[test]
    fn errors_name_the_file() {
        let dir = temp_dir("errors");
        let missing = dir.join("missing.npy");
        let err = read_f32_4d(&missing).unwrap_err().to_string();
        assert!(
            err.contains("missing.npy") && err.contains("float32"),
            "{err}"
        );

        let two_d = dir.join("two_d.npy");
        write_f32(
            &two_d,
            Array4::<f32>::zeros((1, 1, 2, 3))
                .view()
                .into_shape_with_order((2, 3))
                .unwrap(),
        )
        .unwrap();
        let err = read_f32_4d(&two_d).unwrap_err().to_string();
        assert!(
            err.contains("two_d.npy") && err.contains("(2, 3)") && err.contains("expected 4"),
            "{err}"
        );
        fs::remove_dir_all(dir).unwrap();
    }
}
