//! What the charts share: the canvas (an RGB buffer drawn through
//! plotters with the pixel font, encoded as PNG and written atomically),
//! the colours of the series, text sizes, and a legend.

use std::path::Path;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;

use super::pixel_font::{text_size, PixelText};
use crate::result::AnyResult;

/// The drawing area of a chart.
pub(crate) type Area<'a> = DrawingArea<PixelText<BitMapBackend<'a>>, Shift>;

/// One colour per run or series, in turn (after the last, the first again).
pub(crate) const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(230, 85, 13),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// The colour of run or series `i`.
pub(crate) fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// `c` mixed with white: `keep` of the colour is kept.
pub(crate) fn lighter(c: RGBColor, keep: f64) -> RGBColor {
    let mix = |v: u8| (255.0 - (255.0 - v as f64) * keep).round() as u8;
    RGBColor(mix(c.0), mix(c.1), mix(c.2))
}

/// The smallest and largest canvas side `--width` and `--height` take.
const SIDES: (u32, u32) = (200, 8000);

/// Checks a side of the canvas (`flag`: which one).
pub(crate) fn check_side(value: u32, flag: &str) -> AnyResult {
    if !(SIDES.0..=SIDES.1).contains(&value) {
        return Err(format!("{flag} {value}: expected {} to {} pixels", SIDES.0, SIDES.1).into());
    }
    Ok(())
}

/// A plotters result as ours.
pub(crate) fn drawn<T, E: std::fmt::Display>(r: Result<T, E>) -> AnyResult<T> {
    r.map_err(|e| format!("drawing the chart: {e}").into())
}

/// Draws the chart `draw` makes on a white `width` x `height` canvas and
/// writes it to `path` as a PNG, atomically (errors name `flag`).
pub(crate) fn render(
    path: &Path,
    flag: &str,
    (width, height): (u32, u32),
    draw: impl FnOnce(&Area) -> AnyResult,
) -> AnyResult {
    let mut rgb = vec![255u8; width as usize * height as usize * 3];
    {
        let root =
            PixelText(BitMapBackend::with_buffer(&mut rgb, (width, height))).into_drawing_area();
        draw(&root)?;
        drawn(root.present())?;
    }
    let mut png = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut png),
        &rgb,
        width,
        height,
        image::ExtendedColorType::Rgb8,
    )
    .map_err(|e| format!("{flag} {}: encoding the PNG: {e}", path.display()))?;
    ramus_exec::atomic::write_atomic(path, &png)
        .map_err(|e| format!("{flag} {}: {e}", path.display()).into())
}

/// Text sizes of a chart: the font size (in pixels, see
/// `pixel_font::scale`) of tick labels, legends and axis names, and of
/// titles; larger on larger panels.
#[derive(Clone, Copy)]
pub(crate) struct Sizes {
    pub text: f64,
    pub title: f64,
}

impl Sizes {
    /// For a panel of `w` x `h` pixels.
    pub fn of_panel(w: u32, h: u32) -> Self {
        let unit = (w.min(h) as f64 / 260.0).round().clamp(1.0, 4.0);
        Sizes {
            text: 9.0 * unit,
            title: 9.0 * (unit + 1.0),
        }
    }

    /// The text style of tick labels and legends.
    pub fn text(&self) -> TextStyle<'static> {
        ("sans-serif", self.text).into_font().color(&BLACK)
    }

    /// The style of title `text` on a canvas `width` wide: the title size,
    /// or the text size where the title would not fit.
    pub fn title(&self, text: &str, width: u32) -> TextStyle<'static> {
        let fits = text_size(text, self.title).0 <= width * 9 / 10;
        let size = if fits { self.title } else { self.text };
        ("sans-serif", size).into_font().color(&BLACK)
    }

    /// Width and height of `text` in the text style.
    pub fn measure(&self, text: &str) -> (i32, i32) {
        let (w, h) = text_size(text, self.text);
        (w as i32, h as i32)
    }
}

/// How a legend entry's sample line is drawn.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Stroke {
    Solid,
    Dashed,
    /// A filled box (a bar).
    Bar,
}

/// A line of a legend.
pub(crate) struct Entry {
    pub label: String,
    pub color: RGBColor,
    pub stroke: Stroke,
}

/// Where a legend goes: in a corner of the plotting area, or above it
/// (at its left, in room the chart's margin leaves).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Corner {
    TopRight,
    BottomRight,
    TopLeft,
    BottomLeft,
    Above,
}

/// Pixel ranges of a plotting area.
pub(crate) type PlotRect = (std::ops::Range<i32>, std::ops::Range<i32>);

/// Width and height of the legend of `entries`.
pub(crate) fn legend_size(entries: &[Entry], sizes: Sizes) -> (i32, i32) {
    let (_, line_h) = sizes.measure("X");
    let pad = line_h / 2;
    let widest = entries
        .iter()
        .map(|e| sizes.measure(&e.label).0)
        .max()
        .unwrap_or(0);
    let w = pad + 3 * line_h + pad + widest + pad;
    (w, pad + (line_h + pad) * entries.len() as i32)
}

/// The top left corner of a legend of `size` in `corner` of `plot`.
pub(crate) fn legend_at(
    plot: &PlotRect,
    corner: Corner,
    size: (i32, i32),
    sizes: Sizes,
) -> (i32, i32) {
    let pad = sizes.measure("X").1 / 2;
    let (xs, ys) = plot;
    let x = match corner {
        Corner::TopLeft | Corner::BottomLeft | Corner::Above => xs.start + pad,
        Corner::TopRight | Corner::BottomRight => xs.end - pad - size.0,
    };
    let y = match corner {
        Corner::TopLeft | Corner::TopRight => ys.start + pad,
        Corner::BottomLeft | Corner::BottomRight => ys.end - pad - size.1,
        Corner::Above => ys.start - pad - size.1,
    };
    (x, y)
}

/// Draws `entries` in a framed box in `corner` of the plotting area
/// `plot` (pixel ranges on `root`).
pub(crate) fn legend(
    root: &Area,
    plot: &PlotRect,
    corner: Corner,
    entries: &[Entry],
    sizes: Sizes,
) -> AnyResult {
    if entries.is_empty() {
        return Ok(());
    }
    let (_, line_h) = sizes.measure("X");
    let pad = line_h / 2;
    let sample = 3 * line_h;
    let (w, h) = legend_size(entries, sizes);
    let (x0, y0) = legend_at(plot, corner, (w, h), sizes);
    let frame = [(x0, y0), (x0 + w, y0 + h)];
    drawn(root.draw(&Rectangle::new(frame, WHITE.mix(0.85).filled())))?;
    drawn(root.draw(&Rectangle::new(frame, BLACK.mix(0.5))))?;
    let width = (line_h / 6).max(2) as u32;
    for (i, e) in entries.iter().enumerate() {
        let top = y0 + pad + (line_h + pad) * i as i32;
        let mid = top + line_h / 2;
        let (a, b) = ((x0 + pad, mid), (x0 + pad + sample, mid));
        let style = e.color.stroke_width(width);
        match e.stroke {
            Stroke::Solid => drawn(root.draw(&PathElement::new(vec![a, b], style)))?,
            Stroke::Dashed => {
                let dash = DashedPathElement::new(vec![a, b], line_h / 2, line_h / 3, style);
                drawn(root.draw(&dash))?
            }
            Stroke::Bar => {
                let bar = [(a.0, top + 1), (b.0, top + line_h - 1)];
                drawn(root.draw(&Rectangle::new(bar, e.color.filled())))?
            }
        }
        let at = (x0 + pad + sample + pad, top);
        drawn(root.draw(&Text::new(e.label.clone(), at, sizes.text())))?;
    }
    Ok(())
}

/// A tick label: `v` with at most `decimals` decimals, trailing zeros
/// dropped.
pub(crate) fn tick(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        &s
    };
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}

/// `lo..hi` widened by `share` of its length on each side (by ±0.5
/// where it is a point).
pub(crate) fn padded((lo, hi): (f64, f64), share: f64) -> (f64, f64) {
    if hi <= lo {
        return (lo - 0.5, hi + 0.5);
    }
    let d = (hi - lo) * share;
    (lo - d, hi + d)
}

/// The smallest and largest value of `values` (`None` if empty).
pub(crate) fn bounds(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    values.fold(None, |b, v| match b {
        None => Some((v, v)),
        Some((lo, hi)) => Some((lo.min(v), hi.max(v))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_ranges_and_colours() {
        assert_eq!(tick(2.0, 2), "2");
        assert_eq!(tick(0.126, 2), "0.13");
        assert_eq!(tick(0.5, 2), "0.5");
        assert_eq!(tick(-0.0001, 2), "0");
        assert_eq!(tick(150.0, 0), "150");
        assert_eq!(padded((1.0, 1.0), 0.1), (0.5, 1.5));
        assert_eq!(padded((0.0, 10.0), 0.1), (-1.0, 11.0));
        assert_eq!(bounds([3.0, -1.0, 2.0].into_iter()), Some((-1.0, 3.0)));
        assert_eq!(bounds(std::iter::empty()), None);
        assert_eq!(lighter(RGBColor(0, 100, 255), 0.5), RGBColor(128, 178, 255));
        assert_eq!(color(PALETTE.len()), color(0));
        assert!(check_side(100, "--width").is_err());
        assert!(check_side(640, "--width").is_ok());
    }
}
