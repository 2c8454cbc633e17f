//! Reading and writing NumPy's `.npy` files, for the `float32` arrays the `attend` command
//! exchanges with other frameworks.
//!
//! The format itself (NumPy's `numpy.lib.format`: a magic string, a version, a header that
//! is a Python dict literal such as `{'descr': '<f4', 'fortran_order': False, 'shape': (1,
//! 12, 1024, 64), }`, then the data) is the `ndarray-npy` crate's business. What this
//! module adds is the errors: each names the file, says what was wrong with it and what we
//! accept, and, where NumPy can fix it, how.
//!
//! We read only what the attention methods take: `float32` (`'<f4'`; a big-endian `'>f4'`
//! is converted as it is read) in C order. We write little-endian `float32` in C order,
//! whatever the memory layout of the array we are given.
//!
//! ## Layout
//!
//! - [`read_f32`]: any number of dimensions; [`read_f32_4d`]: exactly `[batch, heads,
//!   tokens, head_dim]`.
//! - [`write_f32`]: an array of any dimension, in C order.
//! - [`NpyError`]: the file and what was wrong with it.

use std::fmt;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read};
use std::path::{Path, PathBuf};

use ndarray::{Array4, ArrayD, ArrayView, Dimension};
use ndarray_npy::{ReadNpyError, ReadNpyExt, WriteNpyExt};

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

/// Reads a `float32` C-order array of any number of dimensions.
pub fn read_f32(path: &Path) -> Result<ArrayD<f32>, NpyError> {
    let file = File::open(path).map_err(|e| {
        error(
            path,
            format!("cannot read it ({e}); expected a float32 .npy file"),
        )
    })?;
    parse_f32(BufReader::new(file)).map_err(|what| error(path, what))
}

/// Reads a `float32` C-order array of shape `[batch, heads, tokens, head_dim]`.
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

/// Reads a whole `.npy` file holding `float32` data, and says in words what was wrong if it
/// cannot.
fn parse_f32(reader: impl Read) -> Result<ArrayD<f32>, String> {
    let array = ArrayD::<f32>::read_npy(reader).map_err(|e| explain(&e))?;
    // ndarray-npy reads a Fortran-order file into an array of Fortran layout; the methods
    // take C order. (Where the two orders coincide, as for one dimension, the layout is
    // standard either way and the file is as good as C order.)
    if !array.is_standard_layout() {
        return Err(format!(
            "the data of shape {} is in Fortran (column-major) order; expected C order: \
             save np.ascontiguousarray(x)",
            python_shape(array.shape())
        ));
    }
    Ok(array)
}

/// ndarray-npy's error as a sentence that says what was wrong and what we accept.
fn explain(e: &ReadNpyError) -> String {
    use ndarray_npy::ReadNpyError::*;
    match e {
        // the header is read with read_exact: a file that ends inside it is an
        // UnexpectedEof
        Io(io) if io.kind() == io::ErrorKind::UnexpectedEof => {
            "the file ends inside its .npy header; expected a float32 .npy file".into()
        }
        Io(io) => format!("cannot read it ({io}); expected a float32 .npy file"),
        ParseHeader(header) => {
            let header = header.to_string();
            if header.contains("magic") {
                "not a .npy file: it does not start with the magic \\x93NUMPY".into()
            } else if let Some(version) = header.strip_prefix("unknown version number: ") {
                format!(
                    ".npy format version {version} is not one we read; expected 1.0, 2.0 or 3.0"
                )
            } else {
                format!(
                    "its .npy header is malformed ({header}); expected one numpy.save writes"
                )
            }
        }
        WrongDescriptor(descr) => {
            let descr = descr.to_string();
            let name = dtype_name(descr.trim_matches(['\'', '"']))
                .map(|n| format!(" ({n})"))
                .unwrap_or_default();
            format!(
                "dtype is {descr}{name}; expected float32 ('<f4'): save x.astype(np.float32)"
            )
        }
        MissingData => {
            "the data ends before the number of float32 values its shape needs; \
                        the file is cut short"
                .into()
        }
        ExtraBytes(n) => format!(
            "{n} bytes follow the float32 values its shape needs; expected the file to end there"
        ),
        LengthOverflow => "the shape's element count overflows".into(),
        ParseData(data) => format!("cannot parse its data ({data}); expected float32"),
        // we read into ArrayD, which takes any number of dimensions
        WrongNdim(_, ndim) => format!("unexpected number of dimensions {ndim}"),
    }
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

/// Writes an array as a `.npy` file of little-endian `float32` in C order.
pub fn write_f32<D: Dimension>(
    path: &Path,
    array: ArrayView<f32, D>,
) -> Result<(), NpyError> {
    // ndarray-npy writes a transposed array in Fortran order to save a copy; we read only C
    // order, so copy such an array into C order first (a C-order one is borrowed as it is)
    let array = array.as_standard_layout();
    let write = || -> Result<(), ndarray_npy::WriteNpyError> {
        array.write_npy(BufWriter::new(File::create(path)?))
    };
    write().map_err(|e| error(path, format!("cannot write it: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array, Array4};
    use std::fs;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("npy-{name}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A hand-made file: version, descr, order and shape as given, `data` raw.
    fn npy_bytes(
        version: u8,
        descr: &str,
        fortran: &str,
        shape: &str,
        data: &[u8],
    ) -> Vec<u8> {
        let header = format!(
            "{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}\n"
        );
        let mut b = b"\x93NUMPY".to_vec();
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

    fn le_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn reads_a_file_as_numpy_writes_it() {
        // np.save(f, np.arange(6, dtype=np.float32).reshape(2, 3) / 4), byte for byte:
        // NumPy sorts the keys, leaves 20 spaces of room for the first axis to grow, pads
        // the header so the data starts at byte 128 (a multiple of 64) and ends it with a
        // newline
        let dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
        let header = format!("{dict}{}\n", " ".repeat(58));
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend((header.len() as u16).to_le_bytes());
        bytes.extend(header.as_bytes());
        assert_eq!(bytes.len(), 128);
        bytes.extend(le_bytes(&[0.0, 0.25, 0.5, 0.75, 1.0, 1.25]));

        let a = parse_f32(&bytes[..]).unwrap();
        assert_eq!(a.shape(), &[2, 3]);
        assert_eq!(
            a[[1, 0]],
            0.75,
            "row-major: the second row starts at the fourth value"
        );
        assert_eq!(a.as_slice().unwrap(), &[0.0, 0.25, 0.5, 0.75, 1.0, 1.25]);
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

        // a transposed view is written in logical (C) order, not memory order, so it reads
        // back
        let t = a.view().permuted_axes([3, 2, 1, 0]);
        write_f32(&path, t).unwrap();
        let header = String::from_utf8_lossy(&fs::read(&path).unwrap()[..128]).into_owned();
        assert!(header.contains("'fortran_order': False"), "{header}");
        let back = read_f32(&path).unwrap();
        assert_eq!(back.shape(), &[7, 5, 3, 2]);
        assert!(back.iter().zip(t.iter()).all(|(x, y)| x == y));
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn reads_versions_two_and_three_one_dim_shapes_and_big_endian() {
        let data = le_bytes(&[1.5, -2.0]);
        for version in [2, 3] {
            let a =
                parse_f32(&npy_bytes(version, "<f4", "False", "(2,)", &data)[..]).unwrap();
            assert_eq!(a.as_slice().unwrap(), &[1.5, -2.0]);
        }
        // '>f4' is converted as it is read, not refused
        let big: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_be_bytes())
            .collect();
        let a = parse_f32(&npy_bytes(1, ">f4", "False", "(2,)", &big)[..]).unwrap();
        assert_eq!(a.as_slice().unwrap(), &[1.5, -2.0]);
        // in one dimension Fortran and C order are the same bytes
        let a = parse_f32(&npy_bytes(1, "<f4", "True", "(2,)", &data)[..]).unwrap();
        assert_eq!(a.as_slice().unwrap(), &[1.5, -2.0]);
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
                npy_bytes(1, "<i4", "False", "(4,)", &four),
                "np.float32",
                "int32",
            ),
            (
                npy_bytes(1, "<f4", "True", "(2, 2)", &four),
                "C order",
                "Fortran",
            ),
            (
                npy_bytes(1, "<f4", "False", "(2, 3)", &four),
                "float32 values its shape needs",
                "cut short",
            ),
            (
                npy_bytes(1, "<f4", "False", "(3,)", &four),
                "expected the file to end",
                "4 bytes follow",
            ),
            (b"PK\x03\x04 a zip file".to_vec(), "magic", "not a .npy"),
            (b"\x93NUM".to_vec(), "float32 .npy", "ends inside"),
            (
                npy_bytes(9, "<f4", "False", "(4,)", &four),
                "version 9.0",
                "1.0",
            ),
        ];
        for (bytes, expected, found) in cases {
            let err = parse_f32(&bytes[..]).unwrap_err();
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
            err.contains("two_d.npy")
                && err.contains("(2, 3)")
                && err.contains("expected 4"),
            "{err}"
        );

        // what the reader refuses is reported against the file, too
        for (name, bytes, says) in [
            (
                "fortran.npy",
                npy_bytes(1, "<f4", "True", "(2, 2)", &[0; 16]),
                "Fortran",
            ),
            (
                "float64.npy",
                npy_bytes(1, "<f8", "False", "(2,)", &[0; 16]),
                "float64",
            ),
        ] {
            let path = dir.join(name);
            fs::write(&path, bytes).unwrap();
            let err = read_f32(&path).unwrap_err();
            assert_eq!(err.path, path);
            let err = err.to_string();
            assert!(
                err.starts_with(&*path.to_string_lossy()) && err.contains(says),
                "{err}"
            );
        }
        fs::remove_dir_all(dir).unwrap();
    }
}
