//! `ramus bench --plot FILE.png`: the speed-ups the benchmark printed, as
//! bars per batch size, one colour per comparison, with the line of no
//! speed-up (1x).

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use serde_json::Value;

use super::canvas::{self, color, drawn, legend, padded, tick, Area, Corner, Entry, Sizes, Stroke};
use crate::result::AnyResult;

/// The size of the chart in pixels.
const SIZE: (u32, u32) = (1000, 560);

/// Where a comparison's speed-ups are in the bench's lines: the lines of
/// that `ratio` (`None`: timing lines, without one), under `key`.
struct Source {
    ratio: Option<&'static str>,
    key: &'static str,
    label: &'static str,
}

const SOURCES: [Source; 4] = [
    Source {
        ratio: Some("compiled_vs_batched"),
        key: "speedup",
        label: "compiled vs batched, inference",
    },
    Source {
        ratio: None,
        key: "speedup_vs_batched",
        label: "persistent vs batched, training",
    },
    Source {
        ratio: Some("ramus_vs_pytorch_levelbatch"),
        key: "infer_speedup",
        label: "Ramus vs PyTorch, inference",
    },
    Source {
        ratio: Some("ramus_vs_pytorch_levelbatch"),
        key: "train_speedup",
        label: "Ramus vs PyTorch, training",
    },
];

/// A comparison's speed-ups: (batch size, speed-up).
pub(crate) struct Series {
    pub label: &'static str,
    pub points: Vec<(u64, f64)>,
}

/// The speed-ups in the bench's printed `lines`: the comparisons with at
/// least one (a speed-up that is `null`, such as training's under
/// `--infer-only`, is left out).
pub(crate) fn speedups(lines: &[Value]) -> Vec<Series> {
    SOURCES
        .iter()
        .map(|s| Series {
            label: s.label,
            points: lines
                .iter()
                .filter(|l| l.get("ratio").and_then(Value::as_str) == s.ratio)
                .filter_map(|l| Some((l["batch"].as_u64()?, l[s.key].as_f64()?)))
                .filter(|(_, x)| x.is_finite())
                .collect(),
        })
        .filter(|s| !s.points.is_empty())
        .collect()
}

/// Draws the speed-ups of `lines` to `path` (the `--plot` of a bench
/// whose settings `title` names).
pub(crate) fn write(path: &Path, lines: &[Value], title: &str) -> AnyResult {
    let series = speedups(lines);
    if series.is_empty() {
        return Err(format!("--plot {}: the bench printed no speed-ups", path.display()).into());
    }
    canvas::render(path, "--plot", SIZE, |root| draw(root, &series, title))
}

fn draw(root: &Area, series: &[Series], title: &str) -> AnyResult {
    drawn(root.fill(&WHITE))?;
    let (w, h) = root.dim_in_pixel();
    let sizes = Sizes::of_panel(w / 2, h);
    let mut batches: Vec<u64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    batches.sort_unstable();
    batches.dedup();
    let highest = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(1.0, f64::max);
    let (_, y1) = padded((0.0, highest), 0.15);
    let n = batches.len() as f64;
    let (tw, th) = sizes.measure("00000");
    let entries = entries(series);
    // the legend goes above the bars, in room left between title and chart
    let (_, legend_h) = canvas::legend_size(&entries, sizes);
    let top = root.margin(th / 2, 0, 0, 0);
    let below = drawn(top.titled(title, sizes.title(title, w)))?;
    let mut chart = drawn(
        ChartBuilder::on(&below)
            .margin(th)
            .margin_top(legend_h + th)
            .x_label_area_size(3 * th)
            .y_label_area_size(tw + 2 * th)
            .build_cartesian_2d(-0.5..n - 0.5, 0.0..y1),
    )?;
    let y_fmt = |v: &f64| tick(*v, 2);
    // the batch sizes are drawn under their bars below, not as ticks
    drawn(
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .x_desc("batch size")
            .y_desc("speed-up (x)")
            .label_style(sizes.text())
            .axis_desc_style(sizes.text())
            .y_label_formatter(&y_fmt)
            .light_line_style(BLACK.mix(0.05))
            .bold_line_style(BLACK.mix(0.15))
            .draw(),
    )?;
    let group = 0.8;
    let bar = group / series.len() as f64;
    for (k, s) in series.iter().enumerate() {
        let c = color(k);
        for &(b, x) in &s.points {
            let Some(i) = batches.iter().position(|&v| v == b) else {
                continue;
            };
            let left = i as f64 - group / 2.0 + bar * k as f64;
            let rect = [(left, 0.0), (left + bar * 0.9, x)];
            drawn(chart.draw_series([Rectangle::new(rect, c.filled())]))?;
            let label = format!("{}x", tick(x, 2));
            let style = sizes.text().pos(Pos::new(HPos::Center, VPos::Bottom));
            let at = chart.backend_coord(&(left + bar * 0.45, x));
            drawn(root.draw(&Text::new(label, (at.0, at.1 - th / 3), style)))?;
        }
    }
    let parity = DashedLineSeries::new(
        [(-0.5, 1.0), (n - 0.5, 1.0)],
        th,
        th / 2,
        BLACK.stroke_width(2),
    );
    drawn(chart.draw_series(parity))?;
    for (i, b) in batches.iter().enumerate() {
        let at = chart.backend_coord(&(i as f64, 0.0));
        let style = sizes.text().pos(Pos::new(HPos::Center, VPos::Top));
        drawn(root.draw(&Text::new(b.to_string(), (at.0, at.1 + th / 2), style)))?;
    }
    let plot = chart.plotting_area().get_pixel_range();
    legend(root, &plot, Corner::Above, &entries, sizes)
}

/// The legend: a bar per comparison, the dashed line of 1x.
fn entries(series: &[Series]) -> Vec<Entry> {
    let mut entries: Vec<Entry> = series
        .iter()
        .enumerate()
        .map(|(k, s)| Entry {
            label: s.label.to_string(),
            color: color(k),
            stroke: Stroke::Bar,
        })
        .collect();
    entries.push(Entry {
        label: "no speed-up (1x)".into(),
        color: BLACK,
        stroke: Stroke::Dashed,
    });
    entries
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn speed_ups_are_found_in_each_comparison_s_lines() {
        let lines = [
            json!({"system": "ramus", "engine": "compiled", "batch": 1, "infer_ms": 0.5}),
            json!({"ratio": "compiled_vs_batched", "batch": 1, "speedup": 2.5}),
            json!({"ratio": "compiled_vs_batched", "batch": 8, "speedup": 4.0}),
            json!({"ratio": "ramus_vs_pytorch_levelbatch", "batch": 8, "infer_speedup": 3.0, "train_speedup": null}),
            json!({"engine": "persistent", "batch": 8, "speedup_vs_batched": 1.5}),
        ];
        let got: Vec<(&str, Vec<(u64, f64)>)> = speedups(&lines)
            .into_iter()
            .map(|s| (s.label, s.points))
            .collect();
        assert_eq!(
            got,
            vec![
                ("compiled vs batched, inference", vec![(1, 2.5), (8, 4.0)]),
                ("persistent vs batched, training", vec![(8, 1.5)]),
                ("Ramus vs PyTorch, inference", vec![(8, 3.0)]),
            ]
        );
        assert!(speedups(&lines[..1]).is_empty());
    }

    #[test]
    fn each_comparison_gets_its_colour_of_bars() {
        let lines = [
            json!({"ratio": "compiled_vs_batched", "batch": 1, "speedup": 2.5}),
            json!({"ratio": "compiled_vs_batched", "batch": 8, "speedup": 4.0}),
            json!({"ratio": "ramus_vs_pytorch_levelbatch", "batch": 8, "infer_speedup": 3.0}),
        ];
        let path =
            std::env::temp_dir().join(format!("ramus-bench-chart-{}.png", std::process::id()));
        write(&path, &lines, "test").unwrap();
        let img = image::open(&path).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), SIZE);
        let count = |c: RGBColor| img.pixels().filter(|p| p.0 == [c.0, c.1, c.2]).count();
        // the first comparison's two bars against the second's one
        let (first, second) = (count(color(0)), count(color(1)));
        assert!(second > 1000 && first > 2 * second, "{first} {second}");
        assert_eq!(count(color(2)), 0);
        std::fs::remove_file(&path).unwrap();
        let none = write(&path, &lines[..0], "test").unwrap_err().to_string();
        assert!(
            none.contains("--plot") && none.contains("no speed-ups"),
            "{none}"
        );
        assert!(!path.exists());
    }
}
