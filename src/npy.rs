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
//! whatever the memory layout of the array we are given, and whole or not at all
//! ([`flash_core::files`]).
//!
//! The header's shape is checked against the file's length before anything is allocated:
//! a header is a few bytes anyone can edit, and one that claims `(100000, 100000, 40000)`
//! of a 64-byte file must be an error, not 1.6 TB asked of the allocator.
//!
//! ## Layout
//!
//! - [`read_f32`]: any number of dimensions; [`read_f32_4d`]: exactly `[batch, heads,
//!   tokens, head_dim]`.
//! - [`write_f32`]: an array of any dimension, in C order; [`write_f32_to`] the same into
//!   any writer (a [`flash_core::files::Staged`] file).
//! - [`NpyError`]: the file and what was wrong with it.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use flash_core::files;

use ndarray::{Array4, ArrayD, ArrayView, Dimension};
use ndarray_npy::{ReadNpyError, ReadNpyExt, WriteNpyExt};

/// What was wrong with one `.npy` file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {what}", .path.display())]
pub struct NpyError {
    pub path: PathBuf,
    pub what: String,
}

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
fn parse_f32<R: Read + Seek>(mut reader: R) -> Result<ArrayD<f32>, String> {
    let len = reader
        .seek(SeekFrom::End(0))
        .map_err(|e| format!("cannot read it ({e}); expected a float32 .npy file"))?;
    reader
        .seek(SeekFrom::Start(0))
        .and_then(|_| check_size(&mut reader, len))
        .and_then(|_| reader.seek(SeekFrom::Start(0)).map(drop))
        .map_err(|e| match e.kind() {
            io::ErrorKind::InvalidData => e.to_string(),
            _ => format!("cannot read it ({e}); expected a float32 .npy file"),
        })?;
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

// ANCHOR: npy_size_check
/// Checks what the header of a `.npy` file of `len` bytes claims against those bytes, before
/// ndarray-npy allocates what it claims: the header's length against the file's, and, for a
/// `float32` file, the shape's values × 4 against the bytes after the header (overflow
/// counted as too many). A refusal is an `InvalidData` error whose text says what the header
/// claims and what the file holds. A header this cannot read (not a dict, no shape) is left
/// to ndarray-npy, which refuses it before it allocates anything for the data; so is every
/// other dtype, which it refuses by name.
fn check_size(reader: &mut impl Read, len: u64) -> io::Result<()> {
    let refuse = |what: String| Err(io::Error::new(io::ErrorKind::InvalidData, what));
    let mut start = [0u8; 10];
    let got = read_up_to(reader, &mut start)?;
    // magic (6 bytes), version (2), then the header's length: 2 bytes in version 1, else 4
    if got < 8 || &start[..6] != b"\x93NUMPY" || !matches!(start[6..8], [1..=3, 0]) {
        return Ok(());
    }
    let (header_len, prefix, complete) = if start[6] == 1 {
        (
            u64::from(u16::from_le_bytes([start[8], start[9]])),
            10,
            got == 10,
        )
    } else {
        let mut rest = [0u8; 2];
        let more = read_up_to(reader, &mut rest)?;
        let bytes = [start[8], start[9], rest[0], rest[1]];
        (
            u64::from(u32::from_le_bytes(bytes)),
            12,
            got == 10 && more == 2,
        )
    };
    let data_start = prefix + header_len;
    if !complete {
        return refuse(format!(
            "the file ends inside its .npy header (it holds {len} bytes); expected a float32 \
             .npy file"
        ));
    }
    if data_start > len {
        return refuse(format!(
            "the file ends inside its .npy header: the header claims {data_start} bytes and \
             the file holds {len}; expected a float32 .npy file"
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    reader.read_exact(&mut header)?;
    let Some((descr, shape)) = descr_and_shape(&header) else {
        return Ok(());
    };
    // refused here, not by ndarray-npy: it allocates the values before it looks at the dtype
    if !matches!(descr.as_string().map(String::as_str), Some("<f4" | ">f4")) {
        return refuse(wrong_dtype(&descr.to_string()));
    }
    let holds = len - data_start;
    // ndarray takes a shape only if its non-zero sizes multiply to an addressable count,
    // even when another size is 0 and the array holds nothing
    let needs = shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(4u64, |n, &d| n.checked_mul(d))
        .filter(|&n| n <= isize::MAX as u64)
        .map(|n| if shape.contains(&0) { 0 } else { n });
    let shown = python_shape_u64(&shape);
    match needs {
        None => refuse(format!(
            "its header claims shape {shown} of float32, more bytes than this machine can \
             address, and the file holds {holds} bytes of data"
        )),
        Some(n) if n > holds => refuse(format!(
            "its header claims shape {shown} of float32, {n} bytes, and the file holds {holds} \
             bytes after its header: the data ends before the float32 values its shape needs; \
             the file is cut short"
        )),
        Some(n) if n < holds => refuse(format!(
            "its header claims shape {shown} of float32, {n} bytes, and the file holds {holds} \
             bytes after its header: {} bytes follow the float32 values its shape needs; \
             expected the file to end there",
            holds - n
        )),
        Some(_) => Ok(()),
    }
}
// ANCHOR_END: npy_size_check

/// Reads into `buf` until it is full or the reader ends; the bytes read.
fn read_up_to(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match reader.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// The `descr` and the `shape` of a `.npy` header dict, as NumPy writes it (a Python
/// literal ending in a newline); None for anything else.
fn descr_and_shape(header: &[u8]) -> Option<(py_literal::Value, Vec<u64>)> {
    let text = std::str::from_utf8(header.strip_suffix(b"\n")?).ok()?;
    let dict: py_literal::Value = text.parse().ok()?;
    let (mut descr, mut shape) = (None, None);
    for (key, value) in dict.as_dict()? {
        match key.as_string()?.as_str() {
            "descr" => descr = Some(value.clone()),
            "shape" => {
                let dims = value.as_tuple()?;
                shape = Some(
                    dims.iter()
                        .map(|d| d.as_integer()?.to_string().parse::<u64>().ok())
                        .collect::<Option<Vec<u64>>>()?,
                )
            }
            _ => {}
        }
    }
    Some((descr?, shape?))
}

fn python_shape_u64(shape: &[u64]) -> String {
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    if dims.iter().zip(shape).all(|(&a, &b)| a as u64 == b) {
        python_shape(&dims)
    } else {
        format!("{shape:?}")
    }
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
        WrongDescriptor(descr) => wrong_dtype(&descr.to_string()),
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

/// The error for a `descr` (as the header writes it, quoted) other than float32's.
fn wrong_dtype(descr: &str) -> String {
    let name = dtype_name(descr.trim_matches(['\'', '"']))
        .map(|n| format!(" ({n})"))
        .unwrap_or_default();
    format!("dtype is {descr}{name}; expected float32 ('<f4'): save x.astype(np.float32)")
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

/// Writes an array as a `.npy` file of little-endian `float32` in C order, whole or not at
/// all: on any error the file that was there is unchanged.
pub fn write_f32<D: Dimension>(
    path: &Path,
    array: ArrayView<f32, D>,
) -> Result<(), NpyError> {
    files::write_atomic_with(path, |w| write_f32_to(w, array))
        .map_err(|e| error(path, format!("cannot write it: {}", e.what)))
}

/// Writes an array as `.npy` bytes (little-endian `float32`, C order) into `w`.
pub fn write_f32_to<D: Dimension>(
    w: &mut dyn Write,
    array: ArrayView<f32, D>,
) -> io::Result<()> {
    // ndarray-npy writes a transposed array in Fortran order to save a copy; we read only C
    // order, so copy such an array into C order first (a C-order one is borrowed as it is)
    let array = array.as_standard_layout();
    array.write_npy(w).map_err(|e| match e {
        ndarray_npy::WriteNpyError::Io(e) => e,
        other => io::Error::other(other),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{Array, Array4};
    use proptest::prelude::*;
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

    fn parse(bytes: &[u8]) -> Result<ArrayD<f32>, String> {
        parse_f32(io::Cursor::new(bytes))
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

        let a = parse_f32(io::Cursor::new(&bytes[..])).unwrap();
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
            let a = parse(&npy_bytes(version, "<f4", "False", "(2,)", &data)).unwrap();
            assert_eq!(a.as_slice().unwrap(), &[1.5, -2.0]);
        }
        // '>f4' is converted as it is read, not refused
        let big: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_be_bytes())
            .collect();
        let a = parse(&npy_bytes(1, ">f4", "False", "(2,)", &big)).unwrap();
        assert_eq!(a.as_slice().unwrap(), &[1.5, -2.0]);
        // in one dimension Fortran and C order are the same bytes
        let a = parse(&npy_bytes(1, "<f4", "True", "(2,)", &data)).unwrap();
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
            let err = parse_f32(io::Cursor::new(&bytes[..])).unwrap_err();
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
    #[test]
    fn a_header_claiming_more_than_the_file_holds_is_refused_without_allocating() {
        // 1.6 TB claimed by a header in front of 64 bytes of data
        let huge = npy_bytes(1, "<f4", "False", "(100000, 100000, 40000)", &[0; 64]);
        let err = parse(&huge).unwrap_err();
        assert!(
            err.contains("1600000000000000 bytes") && err.contains("holds 64 bytes"),
            "{err}"
        );
        // so is any other dtype's (ndarray-npy would allocate before it looks at the dtype)
        let huge = npy_bytes(1, "<f8", "False", "(100000, 100000, 40000)", &[0; 64]);
        let err = parse(&huge).unwrap_err();
        assert!(err.contains("float64") && err.contains("'<f4'"), "{err}");
        // a size of 0 holds nothing, but the other sizes must still multiply to an
        // addressable count (ndarray's rule)
        let err = parse(&npy_bytes(
            1,
            "<f4",
            "False",
            "(1099511627776, 0, 8388608)",
            &[],
        ))
        .unwrap_err();
        assert!(
            err.contains("more bytes than this machine can address"),
            "{err}"
        );
        // a product past u64 is refused, not wrapped
        let shape = format!("({}, {})", u64::MAX, u64::MAX);
        let err = parse(&npy_bytes(1, "<f4", "False", &shape, &[0; 8])).unwrap_err();
        assert!(
            err.contains("more bytes than this machine can address"),
            "{err}"
        );
        // a version-2 header length of 4 GB in a file of 60 bytes
        let mut long = npy_bytes(2, "<f4", "False", "(2,)", &[0; 8]);
        long[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = parse(&long).unwrap_err();
        assert!(
            err.contains("ends inside its .npy header")
                && err.contains(&format!("holds {}", long.len())),
            "{err}"
        );
    }

    /// A `.npy` header as a test writes it: a dtype, an order and a shape.
    #[derive(Clone, Debug)]
    struct Header {
        version: u8,
        descr: &'static str,
        fortran: bool,
        shape: Vec<u64>,
    }

    fn header_bytes(h: &Header, data: &[u8]) -> Vec<u8> {
        let dims: Vec<String> = h.shape.iter().map(|d| d.to_string()).collect();
        let shape = match dims.as_slice() {
            [one] => format!("({one},)"),
            _ => format!("({})", dims.join(", ")),
        };
        let fortran = if h.fortran { "True" } else { "False" };
        npy_bytes(h.version, h.descr, fortran, &shape, data)
    }

    fn headers() -> impl Strategy<Value = Header> {
        // sizes small enough to hold, and any u64 (a header claims what it likes)
        let dim = prop_oneof![4 => 0u64..6, 1 => any::<u64>(), 1 => Just(1u64 << 40)];
        (
            1u8..=3,
            prop::sample::select(vec![
                "<f4", ">f4", "<f8", "<f2", "|u1", "<i4", "V2", "<U3",
            ]),
            any::<bool>(),
            prop::collection::vec(dim, 0..5),
        )
            .prop_map(|(version, descr, fortran, shape)| Header {
                version,
                descr,
                fortran,
                shape,
            })
    }

    /// The values' bytes a header's shape needs in float32, if they are few enough for a
    /// test file and the shape is one ndarray can hold (its non-zero sizes multiply to an
    /// addressable count, even where another size is 0).
    fn float32_bytes(shape: &[u64]) -> Option<usize> {
        let nonzero = shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(4u64, |n, &d| n.checked_mul(d))
            .filter(|&n| n <= isize::MAX as u64)?;
        let n = if shape.contains(&0) { 0 } else { nonzero };
        (n < 1 << 20).then_some(n as usize)
    }

    proptest! {
        /// Any header in front of any number of bytes gives an error or exactly the array
        /// the header describes; a float32 file in C order whose data is as long as its
        /// shape says is always read.
        #[test]
        fn any_header_gives_an_error_or_the_array_it_describes(
            h in headers(),
            exact in any::<bool>(),
            len in 0usize..200,
            seed in any::<u64>(),
        ) {
            let len = match float32_bytes(&h.shape) {
                Some(n) if exact => n,
                _ => len,
            };
            let data: Vec<u8> = (0..len)
                .map(|i| (seed.wrapping_mul(i as u64 + 1) >> 13) as u8)
                .collect();
            let bytes = header_bytes(&h, &data);
            match parse(&bytes) {
                Ok(a) => {
                    prop_assert!(h.descr.ends_with("f4"), "{h:?} read as float32");
                    let dims: Vec<u64> = a.shape().iter().map(|&d| d as u64).collect();
                    prop_assert_eq!(&dims, &h.shape);
                    prop_assert_eq!(Some(len), float32_bytes(&h.shape));
                    for (x, chunk) in a.iter().zip(data.chunks(4)) {
                        let b = [chunk[0], chunk[1], chunk[2], chunk[3]];
                        let want = if h.descr == "<f4" {
                            f32::from_le_bytes(b)
                        } else {
                            f32::from_be_bytes(b)
                        };
                        prop_assert_eq!(x.to_bits(), want.to_bits());
                    }
                }
                Err(e) => {
                    let well_formed = h.descr.ends_with("f4")
                        && (!h.fortran || h.shape.iter().filter(|&&d| d != 1).count() <= 1)
                        && float32_bytes(&h.shape) == Some(len);
                    prop_assert!(!well_formed, "{h:?} with {len} bytes refused: {e}");
                    prop_assert!(!e.is_empty());
                }
            }
        }

        /// A file cut anywhere or with any bytes overwritten gives an error or an array no
        /// larger than the file: never a panic, never an allocation the file cannot back.
        #[test]
        fn cut_or_garbled_files_never_panic(
            h in headers(),
            cut in any::<prop::sample::Index>(),
            garble in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        ) {
            let len = float32_bytes(&h.shape).unwrap_or(16);
            let mut bytes = header_bytes(&h, &vec![0x3f; len]);
            for (at, byte) in garble {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
            bytes.truncate(cut.index(bytes.len() + 1));
            if let Ok(a) = parse(&bytes) {
                prop_assert!(a.len() * 4 <= bytes.len());
            }
        }
    }
}
