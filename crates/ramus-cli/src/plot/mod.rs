//! `ramus plot DIR... --output FILE.png`: the loss and accuracy curves of
//! one or several runs (`ramus train --log-dir DIR`), one colour per run,
//! in two panels (side by side on a wide canvas, stacked on a tall one);
//! and `ramus bench --plot`'s speed-up chart ([`bench_chart`]).

use std::path::PathBuf;

use plotters::prelude::*;

use crate::result::AnyResult;

pub(crate) mod bench_chart;
mod canvas;
mod pixel_font;
mod runs;

use canvas::{
    bounds, color, drawn, legend, legend_at, legend_size, lighter, padded, tick, Area, Corner,
    Entry, PlotRect, Sizes, Stroke,
};
use runs::{Curve, Run};

#[derive(clap::Args)]
pub(crate) struct PlotArgs {
    /// Run directories written by `ramus train --log-dir` (each with its
    /// metrics.jsonl; the legend names a run by its directory).
    #[arg(required = true)]
    dirs: Vec<PathBuf>,
    /// The PNG to write (written atomically).
    #[arg(long)]
    output: PathBuf,
    /// Width of the image in pixels.
    #[arg(long, default_value_t = 1200)]
    width: u32,
    /// Height of the image in pixels (taller than wide: the two panels
    /// are stacked).
    #[arg(long, default_value_t = 500)]
    height: u32,
}

pub(crate) fn run(a: PlotArgs) -> AnyResult {
    canvas::check_side(a.width, "--width")?;
    canvas::check_side(a.height, "--height")?;
    ramus_exec::atomic::check_writable(&a.output, "--output")?;
    let runs = runs::read_runs(&a.dirs)?;
    canvas::render(&a.output, "--output", (a.width, a.height), |root| {
        draw_runs(root, &runs)
    })
}

/// A curve of a panel: its points, colour and stroke, and whether its
/// points get markers.
struct Line<'a> {
    points: &'a Curve,
    color: RGBColor,
    stroke: Stroke,
    markers: bool,
}

/// A panel: its title, the name of its y axis, its lines and legend.
struct Panel<'a> {
    title: &'a str,
    y_name: &'a str,
    lines: Vec<Line<'a>>,
    legend: Vec<Entry>,
    corner: Corner,
}

/// The two panels of `runs` on `root`.
fn draw_runs(root: &Area, runs: &[Run]) -> AnyResult {
    drawn(root.fill(&WHITE))?;
    let (w, h) = root.dim_in_pixel();
    let areas = if w >= h {
        root.split_evenly((1, 2))
    } else {
        root.split_evenly((2, 1))
    };
    let (loss, accuracy) = panels(runs);
    draw_panel(root, &areas[0], &loss)?;
    draw_panel(root, &areas[1], &accuracy)
}

/// The loss panel (train loss solid, dev loss dashed, logged steps light)
/// and the accuracy panel (root accuracy solid, node accuracy dashed, as
/// the run's model reports them: a tagger its tags', a CNN its images').
fn panels(runs: &[Run]) -> (Panel<'_>, Panel<'_>) {
    let mut loss = Panel {
        title: "loss",
        y_name: "loss",
        lines: Vec::new(),
        legend: Vec::new(),
        corner: Corner::TopRight,
    };
    let mut accuracy = Panel {
        title: "dev accuracy",
        y_name: "accuracy (%)",
        lines: Vec::new(),
        legend: Vec::new(),
        corner: Corner::BottomRight,
    };
    for (i, run) in runs.iter().enumerate() {
        let c = color(i);
        let add = |panel: &mut Panel<'_>, points: &'_ Curve, stroke, what: &str| {
            if points.is_empty() {
                return;
            }
            panel.legend.push(Entry {
                label: format!("{} {what}", run.name).trim_end().to_string(),
                color: c,
                stroke,
            });
        };
        add(&mut loss, &run.train_loss, Stroke::Solid, "train");
        add(&mut loss, &run.dev_loss, Stroke::Dashed, "dev");
        let (root_name, node_name) = match (run.accuracies.root, run.accuracies.node) {
            (true, true) => ("root", "all nodes"),
            _ => ("", ""),
        };
        if run.accuracies.root {
            add(&mut accuracy, &run.root_accuracy, Stroke::Solid, root_name);
        }
        let node_stroke = if run.accuracies.root {
            Stroke::Dashed
        } else {
            Stroke::Solid
        };
        if run.accuracies.node {
            add(&mut accuracy, &run.node_accuracy, node_stroke, node_name);
        }
        // the steps first: the epochs' lines go over them
        if !run.step_loss.is_empty() {
            loss.lines.insert(
                0,
                Line {
                    points: &run.step_loss,
                    color: lighter(c, 0.45),
                    stroke: Stroke::Solid,
                    markers: false,
                },
            );
        }
        let line = |points, stroke| Line {
            points,
            color: c,
            stroke,
            markers: true,
        };
        loss.lines.push(line(&run.train_loss, Stroke::Solid));
        loss.lines.push(line(&run.dev_loss, Stroke::Dashed));
        if run.accuracies.root {
            accuracy.lines.push(line(&run.root_accuracy, Stroke::Solid));
        }
        if run.accuracies.node {
            accuracy.lines.push(line(&run.node_accuracy, node_stroke));
        }
    }
    if runs.iter().any(|r| !r.step_loss.is_empty()) {
        loss.legend.push(Entry {
            label: "logged steps".into(),
            color: lighter(RGBColor(0, 0, 0), 0.45),
            stroke: Stroke::Solid,
        });
    }
    (loss, accuracy)
}

/// Draws `panel` on `area` (the legend on `root`, in pixels).
fn draw_panel(root: &Area, area: &Area, panel: &Panel<'_>) -> AnyResult {
    let (w, h) = area.dim_in_pixel();
    let sizes = Sizes::of_panel(w, h);
    let points = || panel.lines.iter().flat_map(|l| l.points.iter());
    let Some(xs) = bounds(points().map(|p| p.0)) else {
        let (_, th) = sizes.measure("X");
        let note = format!("{}: nothing logged", panel.title);
        let at = (th, th);
        return drawn(area.draw(&Text::new(note, at, sizes.text())));
    };
    let ys = bounds(points().map(|p| p.1)).unwrap_or(xs);
    let (x0, x1) = padded(xs, 0.03);
    let (y0, y1) = padded(ys, 0.08);
    // enough decimals to tell the ticks of the range apart (trailing
    // zeros dropped), and room for the widest
    let decimals = (2.0 - (y1 - y0).log10().floor()).clamp(0.0, 6.0) as usize;
    let widest = [y0, y1, -1.0 / 3.0]
        .iter()
        .map(|&v| sizes.measure(&tick(v, decimals)).0)
        .max()
        .unwrap_or(0);
    let (_, th) = sizes.measure("0");
    let mut chart = drawn(
        ChartBuilder::on(area)
            .caption(panel.title, sizes.title(panel.title, w))
            .margin(th)
            .x_label_area_size(3 * th)
            .y_label_area_size(widest + 2 * th)
            .build_cartesian_2d(x0..x1, y0..y1),
    )?;
    // epochs are whole: a tick between two (1.5 on a short run) goes unlabelled
    let x_fmt = |v: &f64| match (v - v.round()).abs() < 1e-9 {
        true => tick(*v, 0),
        false => String::new(),
    };
    let y_fmt = |v: &f64| tick(*v, decimals);
    drawn(
        chart
            .configure_mesh()
            .x_desc("epoch")
            .y_desc(panel.y_name)
            .label_style(sizes.text())
            .axis_desc_style(sizes.text())
            .x_label_formatter(&x_fmt)
            // about one tick an epoch: whole epochs on short runs
            .x_labels(((x1 - x0).ceil() as usize + 1).clamp(2, 10))
            .y_label_formatter(&y_fmt)
            .light_line_style(BLACK.mix(0.05))
            .bold_line_style(BLACK.mix(0.15))
            .draw(),
    )?;
    let width = (th / 6).max(2) as u32;
    for line in &panel.lines {
        let pts = line.points.iter().copied();
        let style = line
            .color
            .stroke_width(if line.markers { width } else { 1 });
        match line.stroke {
            Stroke::Dashed => {
                let dash = th as u32;
                drawn(chart.draw_series(DashedLineSeries::new(pts, dash, dash / 2, style)))?;
            }
            _ => {
                drawn(chart.draw_series(LineSeries::new(pts, style)))?;
            }
        }
        if line.markers {
            let r = width + 1;
            let dots = line
                .points
                .iter()
                .map(|&p| Circle::new(p, r, line.color.filled()));
            drawn(chart.draw_series(dots))?;
        }
    }
    let plot = chart.plotting_area().get_pixel_range();
    let to_pixels = |p: (f64, f64)| chart.backend_coord(&p);
    let corner = quietest_corner(panel, &plot, sizes, to_pixels);
    legend(root, &plot, corner, &panel.legend, sizes)
}

/// The corner of the plotting area where the legend hides the fewest
/// points of the panel's lines (sampled along each segment), the panel's
/// preferred one on a tie.
fn quietest_corner(
    panel: &Panel<'_>,
    plot: &PlotRect,
    sizes: Sizes,
    to_pixels: impl Fn((f64, f64)) -> (i32, i32),
) -> Corner {
    let size = legend_size(&panel.legend, sizes);
    let mut samples = Vec::new();
    for line in &panel.lines {
        for pair in line.points.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            samples.extend((0..=20).map(|i| {
                let t = i as f64 / 20.0;
                to_pixels((a.0 + t * (b.0 - a.0), a.1 + t * (b.1 - a.1)))
            }));
        }
        samples.extend(line.points.iter().map(|&p| to_pixels(p)));
    }
    let hidden = |corner| {
        let (x, y) = legend_at(plot, corner, size, sizes);
        samples
            .iter()
            .filter(|p| (x..=x + size.0).contains(&p.0) && (y..=y + size.1).contains(&p.1))
            .count()
    };
    let order = [
        panel.corner,
        Corner::TopRight,
        Corner::BottomRight,
        Corner::TopLeft,
        Corner::BottomLeft,
    ];
    order
        .into_iter()
        .min_by_key(|&c| hidden(c))
        .unwrap_or(panel.corner)
}
