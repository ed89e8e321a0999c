//! Reading a directory of labelled image files for the CNN models, in the
//! common class-per-folder layout:
//!
//! ```text
//! DIR/train/<class>/<image>.png|.jpg|.jpeg
//! DIR/dev/<class>/...      (or DIR/valid/)
//! DIR/test/<class>/...
//! ```
//!
//! The classes are the sub-folder names of `train/`, sorted (label `i` is the
//! `i`-th name); `dev/` and `test/` may only use those names. Files with
//! other extensions and hidden entries are skipped. Every image is decoded
//! (PNG or JPEG, through the `image` crate), converted to RGB (3 channels)
//! or grey (1 channel), resized to the model's `H×W` with a triangle filter
//! and scaled from `0..=255` to `[-1, 1]`, then becomes a single-vertex graph
//! like the built-in synthetic images.

use crate::result::AnyResult;
use std::path::{Path, PathBuf};

use image::imageops::FilterType;
use ramus_graph::images::image_graph;
use ramus_graph::{InputGraph, NO_LABEL};
use ramus_nn::ImageShape;

/// Extensions that are decoded (lower case).
const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// Visible entries of `dir`, sorted by name.
fn entries(dir: &Path) -> AnyResult<Vec<PathBuf>> {
    let read = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for entry in read {
        let path = entry.map_err(|e| format!("{}: {e}", dir.display()))?.path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_none_or(|n| n.starts_with('.'));
        if !hidden {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// The class names of a split folder: its sub-folders, sorted.
pub fn class_names(split: &Path) -> AnyResult<Vec<String>> {
    let names: Vec<String> = entries(split)?
        .into_iter()
        .filter(|p| p.is_dir())
        .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(str::to_string))
        .collect();
    if names.len() < 2 {
        return Err(format!(
            "{}: expected one sub-folder per class (at least 2), found {}",
            split.display(),
            names.len()
        )
        .into());
    }
    Ok(names)
}

/// A pixel value of `0..=255` as the models read it, in `[-1, 1]`.
fn unit(v: u8) -> f32 {
    f32::from(v) / 127.5 - 1.0
}

/// The inverse of [`unit`], clamped to `[-1, 1]` and rounded.
fn byte(x: f32) -> u8 {
    ((x.clamp(-1.0, 1.0) + 1.0) * 127.5).round() as u8
}

/// An image of `shape` (CHW floats, 1 or 3 channels) as PNG bytes, each
/// value clamped to `[-1, 1]` and quantized to 8 bits: what
/// [`load_image`] reads back (to within half a step of 1/127.5).
pub fn encode_png(pixels: &[f32], shape: ImageShape) -> AnyResult<Vec<u8>> {
    let plane = shape.height * shape.width;
    let color = match shape.channels {
        1 => image::ExtendedColorType::L8,
        3 => image::ExtendedColorType::Rgb8,
        c => {
            return Err(
                format!("images are written as 1 (grey) or 3 (RGB) channels, not {c}").into(),
            )
        }
    };
    if pixels.len() != shape.len() {
        return Err(format!("{} values for a {shape} image", pixels.len()).into());
    }
    // CHW to interleaved HWC
    let bytes: Vec<u8> = (0..plane * shape.channels)
        .map(|i| byte(pixels[(i % shape.channels) * plane + i / shape.channels]))
        .collect();
    let mut png = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut png),
        &bytes,
        shape.width as u32,
        shape.height as u32,
        color,
    )
    .map_err(|e| format!("encoding a PNG: {e}"))?;
    Ok(png)
}

/// Decodes one image file into `shape` (CHW floats in `[-1, 1]`).
pub fn load_image(path: &Path, shape: ImageShape) -> AnyResult<Vec<f32>> {
    let img = image::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let (h, w) = (shape.height as u32, shape.width as u32);
    let mut out = Vec::with_capacity(shape.len());
    match shape.channels {
        1 => {
            let g = image::imageops::resize(&img.to_luma8(), w, h, FilterType::Triangle);
            out.extend(g.pixels().map(|p| unit(p.0[0])));
        }
        3 => {
            let rgb = image::imageops::resize(&img.to_rgb8(), w, h, FilterType::Triangle);
            for c in 0..3 {
                out.extend(rgb.pixels().map(|p| unit(p.0[c])));
            }
        }
        c => {
            return Err(format!(
                "{}: image files are read as 1 (grey) or 3 (RGB) channels, the model wants {c}",
                path.display()
            )
            .into())
        }
    }
    Ok(out)
}

/// Reads a split folder whose sub-folders are named after `classes`.
pub fn read_split(
    split: &Path,
    classes: &[String],
    shape: ImageShape,
) -> AnyResult<Vec<InputGraph>> {
    let mut graphs = Vec::new();
    for dir in entries(split)?.into_iter().filter(|p| p.is_dir()) {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let label = classes.iter().position(|c| c == name).ok_or_else(|| {
            format!(
                "{}: class `{name}` is not one of the training classes ({})",
                dir.display(),
                classes.join(", ")
            )
        })?;
        for file in entries(&dir)?.into_iter().filter(|f| is_image(f)) {
            graphs.push(image_file(&file, shape, label as i32)?);
        }
    }
    if graphs.is_empty() {
        return Err(format!(
            "{}: no .png or .jpg images in class sub-folders",
            split.display()
        )
        .into());
    }
    Ok(graphs)
}

/// True for a file with one of the [`EXTENSIONS`] (any case).
fn is_image(path: &Path) -> bool {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    path.is_file() && ext.is_some_and(|e| EXTENSIONS.contains(&e.as_str()))
}

/// The image file `path` as a graph labelled `label` (or [`NO_LABEL`]),
/// its origin the file.
fn image_file(path: &Path, shape: ImageShape, label: i32) -> AnyResult<InputGraph> {
    let origin = ramus_graph::Origin {
        file: path.display().to_string().into(),
        line: 0,
    };
    Ok(image_graph(load_image(path, shape)?, label)?.with_origin(origin))
}

/// Images to predict: each of `paths` an image file, or a folder either of
/// class sub-folders named after `classes` (labelled, as [`read_split`]
/// reads them) or of image files (unlabelled).
pub fn read_inputs(
    paths: &[PathBuf],
    classes: &[String],
    shape: ImageShape,
) -> AnyResult<Vec<InputGraph>> {
    let mut graphs = Vec::new();
    for path in paths {
        if !path.exists() {
            return Err(format!("{}: no such file or folder", path.display()).into());
        }
        if !path.is_dir() {
            if !is_image(path) {
                return Err(format!(
                    "{}: not a .png or .jpg image file, nor a folder of them",
                    path.display()
                )
                .into());
            }
            graphs.push(image_file(path, shape, NO_LABEL)?);
            continue;
        }
        let listed = entries(path)?;
        if listed.iter().any(|p| p.is_dir()) {
            graphs.extend(read_split(path, classes, shape)?);
            continue;
        }
        let files: Vec<&PathBuf> = listed.iter().filter(|f| is_image(f)).collect();
        if files.is_empty() {
            return Err(format!(
                "{}: no .png or .jpg images, nor class sub-folders of them",
                path.display()
            )
            .into());
        }
        for f in files {
            graphs.push(image_file(f, shape, NO_LABEL)?);
        }
    }
    Ok(graphs)
}

/// The `train`, `dev` (or `valid`) and `test` folders of `dir`.
pub fn split_dirs(dir: &Path) -> AnyResult<[PathBuf; 3]> {
    let find = |names: &[&str]| -> AnyResult<PathBuf> {
        names
            .iter()
            .map(|n| dir.join(n))
            .find(|p| p.is_dir())
            .ok_or_else(|| {
                format!(
                    "{}: no {} folder of class sub-folders found",
                    dir.display(),
                    names.join(" or ")
                )
                .into()
            })
    };
    Ok([
        find(&["train"])?,
        find(&["dev", "valid"])?,
        find(&["test"])?,
    ])
}
