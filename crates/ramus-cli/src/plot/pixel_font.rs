//! The text of the charts, drawn with a built-in 5x7 pixel font.
//!
//! Why not a real font: plotters draws text through a font feature, `ttf`
//! (font-kit: fontconfig and the system's fonts) or `ab_glyph` (font bytes
//! the program registers). A CI machine or a container may have no fonts
//! at all, and then a chart would lose its labels and legend, or its
//! drawing would fail; bundling a TrueType file would add hundreds of
//! kilobytes and a licence to the repository. Plotters without a font
//! feature lays text out with estimates and cannot draw it, so
//! [`PixelText`] wraps the bitmap backend and draws every text itself: each
//! glyph of the table below (printable ASCII, designed for this file) is a
//! 5x7 grid of squares, scaled by a whole factor from the style's size.
//! The text is the same on every machine, needs nothing installed, and its
//! width is known exactly, which lays out axes and legends.

use plotters::prelude::DrawingBackend;
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendStyle, BackendTextStyle, DrawingErrorKind,
};

/// Columns of a glyph.
const COLS: i32 = 5;
/// Rows of a glyph: 7 above the baseline, 2 below (descenders).
const ROWS: i32 = 9;
/// Advance from one glyph to the next, in font pixels (one blank column).
const ADVANCE: i32 = COLS + 1;

/// Printable ASCII from ' ' to '~', in order: each glyph's rows from the
/// top, `#` drawn and `.` blank, rows left out at the end blank.
const GLYPHS: [(char, &str); 95] = [
    (' ', ""),
    ('!', "..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#.."),
    ('"', ".#.#. .#.#. .#.#."),
    ('#', ".#.#. .#.#. ##### .#.#. ##### .#.#. .#.#."),
    ('$', "..#.. .#### #.#.. .###. ..#.# ####. ..#.."),
    ('%', "##... ##..# ...#. ..#.. .#... #..## ...##"),
    ('&', ".##.. #..#. #.#.. .#... #.#.# #..#. .##.#"),
    ('\'', "..#.. ..#.. .#..."),
    ('(', "...#. ..#.. .#... .#... .#... ..#.. ...#."),
    (')', ".#... ..#.. ...#. ...#. ...#. ..#.. .#..."),
    ('*', "..... ..#.. #.#.# .###. #.#.# ..#.. ....."),
    ('+', "..... ..#.. ..#.. ##### ..#.. ..#.. ....."),
    (',', "..... ..... ..... ..... ..... ..##. ..##. ...#. ..#.."),
    ('-', "..... ..... ..... ##### ..... ..... ....."),
    ('.', "..... ..... ..... ..... ..... .##.. .##.."),
    ('/', "..... ....# ...#. ..#.. .#... #.... ....."),
    ('0', ".###. #...# #..## #.#.# ##..# #...# .###."),
    ('1', "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###."),
    ('2', ".###. #...# ....# ...#. ..#.. .#... #####"),
    ('3', "##### ...#. ..#.. ...#. ....# #...# .###."),
    ('4', "...#. ..##. .#.#. #..#. ##### ...#. ...#."),
    ('5', "##### #.... ####. ....# ....# #...# .###."),
    ('6', "..##. .#... #.... ####. #...# #...# .###."),
    ('7', "##### ....# ...#. ..#.. .#... .#... .#..."),
    ('8', ".###. #...# #...# .###. #...# #...# .###."),
    ('9', ".###. #...# #...# .#### ....# ...#. .##.."),
    (':', "..... .##.. .##.. ..... .##.. .##.. ....."),
    (';', "..... .##.. .##.. ..... .##.. .##.. ..#.. .#..."),
    ('<', "...#. ..#.. .#... #.... .#... ..#.. ...#."),
    ('=', "..... ..... ##### ..... ##### ..... ....."),
    ('>', ".#... ..#.. ...#. ....# ...#. ..#.. .#..."),
    ('?', ".###. #...# ....# ...#. ..#.. ..... ..#.."),
    ('@', ".###. #...# ....# .##.# #.#.# #.#.# .###."),
    ('A', ".###. #...# #...# #...# ##### #...# #...#"),
    ('B', "####. #...# #...# ####. #...# #...# ####."),
    ('C', ".###. #...# #.... #.... #.... #...# .###."),
    ('D', "###.. #..#. #...# #...# #...# #..#. ###.."),
    ('E', "##### #.... #.... ####. #.... #.... #####"),
    ('F', "##### #.... #.... ####. #.... #.... #...."),
    ('G', ".###. #...# #.... #.### #...# #...# .####"),
    ('H', "#...# #...# #...# ##### #...# #...# #...#"),
    ('I', ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###."),
    ('J', "..### ...#. ...#. ...#. ...#. #..#. .##.."),
    ('K', "#...# #..#. #.#.. ##... #.#.. #..#. #...#"),
    ('L', "#.... #.... #.... #.... #.... #.... #####"),
    ('M', "#...# ##.## #.#.# #.#.# #...# #...# #...#"),
    ('N', "#...# #...# ##..# #.#.# #..## #...# #...#"),
    ('O', ".###. #...# #...# #...# #...# #...# .###."),
    ('P', "####. #...# #...# ####. #.... #.... #...."),
    ('Q', ".###. #...# #...# #...# #.#.# #..#. .##.#"),
    ('R', "####. #...# #...# ####. #.#.. #..#. #...#"),
    ('S', ".#### #.... #.... .###. ....# ....# ####."),
    ('T', "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#.."),
    ('U', "#...# #...# #...# #...# #...# #...# .###."),
    ('V', "#...# #...# #...# #...# #...# .#.#. ..#.."),
    ('W', "#...# #...# #...# #.#.# #.#.# #.#.# .#.#."),
    ('X', "#...# #...# .#.#. ..#.. .#.#. #...# #...#"),
    ('Y', "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#.."),
    ('Z', "##### ....# ...#. ..#.. .#... #.... #####"),
    ('[', ".###. .#... .#... .#... .#... .#... .###."),
    ('\\', "..... #.... .#... ..#.. ...#. ....# ....."),
    (']', ".###. ...#. ...#. ...#. ...#. ...#. .###."),
    ('^', "..#.. .#.#. #...#"),
    ('_', "..... ..... ..... ..... ..... ..... ..... #####"),
    ('`', ".#... ..#.. ...#."),
    ('a', "..... ..... .###. ....# .#### #...# .####"),
    ('b', "#.... #.... #.##. ##..# #...# #...# ####."),
    ('c', "..... ..... .###. #.... #.... #...# .###."),
    ('d', "....# ....# .##.# #..## #...# #...# .####"),
    ('e', "..... ..... .###. #...# ##### #.... .###."),
    ('f', "..##. .#..# .#... ###.. .#... .#... .#..."),
    ('g', "..... ..... .#### #...# #...# #...# .#### ....# .###."),
    ('h', "#.... #.... #.##. ##..# #...# #...# #...#"),
    ('i', "..#.. ..... .##.. ..#.. ..#.. ..#.. .###."),
    ('j', "...#. ..... ..##. ...#. ...#. ...#. ...#. #..#. .##.."),
    ('k', "#.... #.... #..#. #.#.. ##... #.#.. #..#."),
    ('l', ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###."),
    ('m', "..... ..... ##.#. #.#.# #.#.# #.#.# #.#.#"),
    ('n', "..... ..... #.##. ##..# #...# #...# #...#"),
    ('o', "..... ..... .###. #...# #...# #...# .###."),
    ('p', "..... ..... ####. #...# #...# #...# ####. #.... #...."),
    ('q', "..... ..... .#### #...# #...# #...# .#### ....# ....#"),
    ('r', "..... ..... #.##. ##..# #.... #.... #...."),
    ('s', "..... ..... .###. #.... .###. ....# ####."),
    ('t', ".#... .#... ###.. .#... .#... .#..# ..##."),
    ('u', "..... ..... #...# #...# #...# #..## .##.#"),
    ('v', "..... ..... #...# #...# #...# .#.#. ..#.."),
    ('w', "..... ..... #...# #...# #.#.# #.#.# .#.#."),
    ('x', "..... ..... #...# .#.#. ..#.. .#.#. #...#"),
    ('y', "..... ..... #...# #...# #...# #...# .#### ....# .###."),
    ('z', "..... ..... ##### ...#. ..#.. .#... #####"),
    ('{', "...#. ..#.. ..#.. .#... ..#.. ..#.. ...#."),
    ('|', "..#.. ..#.. ..#.. ..#.. ..#.. ..#.. ..#.."),
    ('}', ".#... ..#.. ..#.. ...#. ..#.. ..#.. .#..."),
    ('~', "..... ..... .#... #.#.# ...#. ..... ....."),
];

/// The rows of `c`'s glyph (a character outside printable ASCII is drawn
/// as `?`).
fn glyph(c: char) -> &'static str {
    let i = (c as usize).wrapping_sub(' ' as usize);
    GLYPHS
        .get(i)
        .map_or(GLYPHS['?' as usize - ' ' as usize].1, |g| g.1)
}

/// The drawn cells of `c`: (column, row) from the glyph's top left.
fn cells(c: char) -> impl Iterator<Item = (i32, i32)> {
    glyph(c).split(' ').enumerate().flat_map(|(row, bits)| {
        bits.bytes()
            .enumerate()
            .filter(|&(_, b)| b == b'#')
            .map(move |(col, _)| (col as i32, row as i32))
    })
}

/// Screen pixels per font pixel for a text style of `size` (plotters'
/// font size in pixels): a glyph is about `size` high, at least 1.
pub(crate) fn scale(size: f64) -> i32 {
    ((size / 9.0).round() as i32).max(1)
}

/// Width and height in pixels of `text` at `size`.
pub(crate) fn text_size(text: &str, size: f64) -> (u32, u32) {
    let n = text.chars().count() as i32;
    let s = scale(size);
    let w = if n == 0 { 0 } else { n * ADVANCE - 1 };
    ((w * s) as u32, (ROWS * s) as u32)
}

/// A backend that draws text with the pixel font and everything else
/// with the backend it wraps.
pub(crate) struct PixelText<B>(pub B);

impl<B: DrawingBackend> PixelText<B> {
    /// Draws the font pixel at (`x`, `y`) of the unrotated text box
    /// (relative to the anchor `pos`), rotated with the style's transform,
    /// as an `s` x `s` square, pixel by pixel (backends differ on whether
    /// a filled rectangle includes its bottom right corner).
    fn cell<T: BackendTextStyle>(
        &mut self,
        style: &T,
        pos: BackendCoord,
        (x, y, s): (i32, i32, i32),
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        let t = style.transform();
        let (w, h) = self.0.get_size();
        for dy in 0..s {
            for dx in 0..s {
                let (px, py) = t.transform(x + dx, y + dy);
                let (px, py) = (pos.0 + px, pos.1 + py);
                if px >= 0 && py >= 0 && px < w as i32 && py < h as i32 {
                    self.0.draw_pixel((px, py), color)?;
                }
            }
        }
        Ok(())
    }
}

impl<B: DrawingBackend> DrawingBackend for PixelText<B> {
    type ErrorType = B::ErrorType;

    fn get_size(&self) -> (u32, u32) {
        self.0.get_size()
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.ensure_prepared()
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.present()
    }

    fn draw_pixel(
        &mut self,
        point: BackendCoord,
        color: BackendColor,
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.draw_pixel(point, color)
    }

    fn draw_line<S: BackendStyle>(
        &mut self,
        from: BackendCoord,
        to: BackendCoord,
        style: &S,
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.draw_line(from, to, style)
    }

    fn draw_rect<S: BackendStyle>(
        &mut self,
        upper_left: BackendCoord,
        bottom_right: BackendCoord,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.draw_rect(upper_left, bottom_right, style, fill)
    }

    fn draw_path<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        path: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.draw_path(path, style)
    }

    fn draw_circle<S: BackendStyle>(
        &mut self,
        center: BackendCoord,
        radius: u32,
        style: &S,
        fill: bool,
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.draw_circle(center, radius, style, fill)
    }

    fn fill_polygon<S: BackendStyle, I: IntoIterator<Item = BackendCoord>>(
        &mut self,
        vert: I,
        style: &S,
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.fill_polygon(vert, style)
    }

    fn blit_bitmap(
        &mut self,
        pos: BackendCoord,
        size: (u32, u32),
        src: &[u8],
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        self.0.blit_bitmap(pos, size, src)
    }

    fn draw_text<T: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &T,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<B::ErrorType>> {
        let color = style.color();
        if color.alpha == 0.0 {
            return Ok(());
        }
        let (w, h) = text_size(text, style.size());
        let (w, h) = (w as i32, h as i32);
        let dx = match style.anchor().h_pos {
            HPos::Left => 0,
            HPos::Right => -w,
            HPos::Center => -w / 2,
        };
        let dy = match style.anchor().v_pos {
            VPos::Top => 0,
            VPos::Center => -h / 2,
            VPos::Bottom => -h,
        };
        let s = scale(style.size());
        for (i, c) in text.chars().enumerate() {
            let left = dx + i as i32 * ADVANCE * s;
            for (col, row) in cells(c) {
                self.cell(style, pos, (left + col * s, dy + row * s, s), color)?;
            }
        }
        Ok(())
    }

    fn estimate_text_size<T: BackendTextStyle>(
        &self,
        text: &str,
        style: &T,
    ) -> Result<(u32, u32), DrawingErrorKind<B::ErrorType>> {
        Ok(text_size(text, style.size()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use plotters::prelude::*;

    #[test]
    fn the_table_is_printable_ascii_in_order_with_5x9_glyphs() {
        for (i, (c, rows)) in GLYPHS.iter().enumerate() {
            assert_eq!(*c as usize, ' ' as usize + i, "{c:?}");
            let rows: Vec<&str> = rows.split(' ').filter(|r| !r.is_empty()).collect();
            assert!(rows.len() as i32 <= ROWS, "{c:?}");
            for r in rows {
                assert_eq!(r.len() as i32, COLS, "{c:?}: {r}");
                assert!(r.bytes().all(|b| b == b'#' || b == b'.'), "{c:?}: {r}");
            }
            // every printable glyph but the space draws something
            assert_eq!(cells(*c).next().is_none(), *c == ' ', "{c:?}");
        }
        // distinct glyphs for distinct characters
        for (i, a) in GLYPHS.iter().enumerate() {
            for b in &GLYPHS[i + 1..] {
                assert_ne!(a.1, b.1, "{:?} and {:?}", a.0, b.0);
            }
        }
        assert_eq!(glyph('é'), glyph('?'));
    }

    /// The pixels of `text` drawn black at `size` on a white canvas, with
    /// `transform`.
    fn drawn(text: &str, size: f64, transform: FontTransform) -> Vec<(u32, u32)> {
        let (w, h) = (120u32, 120u32);
        let mut buf = vec![255u8; (w * h * 3) as usize];
        {
            let root = PixelText(BitMapBackend::with_buffer(&mut buf, (w, h))).into_drawing_area();
            let style = TextStyle::from(("sans-serif", size).into_font())
                .transform(transform)
                .color(&BLACK);
            root.draw_text(text, &style, (60, 60)).unwrap();
            root.present().unwrap();
        }
        (0..w * h)
            .filter(|i| buf[(*i * 3) as usize] == 0)
            .map(|i| (i % w, i / w))
            .collect()
    }

    #[test]
    fn text_is_drawn_cell_by_cell_at_its_scale_and_rotation() {
        let plus = cells('+').count();
        assert_eq!(drawn("+", 9.0, FontTransform::None).len(), plus);
        // at 18 pixels each font pixel is a 2x2 square
        let big = drawn("+-", 18.0, FontTransform::None);
        assert_eq!(big.len(), 4 * (plus + cells('-').count()));
        let (x0, x1) = (
            big.iter().map(|p| p.0).min().unwrap(),
            big.iter().map(|p| p.0).max().unwrap(),
        );
        // '+' spans columns 0..5, '-' columns 6..11: 11 font pixels
        assert_eq!(x1 - x0 + 1, 2 * (2 * ADVANCE - 1) as u32);
        assert_eq!(text_size("+-", 18.0), (22, 18));
        // rotated a quarter turn, the text runs down the canvas
        let turned = drawn("--", 9.0, FontTransform::Rotate90);
        let xs: std::collections::BTreeSet<u32> = turned.iter().map(|p| p.0).collect();
        let ys: std::collections::BTreeSet<u32> = turned.iter().map(|p| p.1).collect();
        assert_eq!((xs.len(), ys.len()), (1, 2 * COLS as usize));
    }
}
