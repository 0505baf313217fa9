//! SVG plots: lines of cost against batch size, and grouped bars.
//!
//! Owns: drawing series of (batch, cost) points on log axes
//! ([`line_plot`]) and bars of several series over named categories, in
//! panels side by side ([`bar_chart`]). Reports reach both through
//! `harness::Plot`. Must never: change or smooth the figures it is given.

use crate::BenchError;
use plotters::prelude::*;
use std::path::Path;

/// One line: a label and (x, y) points.
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Points, x ascending.
    pub points: Vec<(f64, f64)>,
}

/// Draw `series` to an SVG file at `path`, both axes on log scales (costs
/// here span orders of magnitude).
pub fn line_plot(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> Result<(), BenchError> {
    let err = |e: &dyn std::fmt::Display| BenchError::Plot {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
    }
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let x_max = xs.fold(1.0f64, f64::max);
    let ys = || series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let y_max = ys().fold(1.0f64, f64::max) * 1.25;
    let y_min = ys().fold(f64::INFINITY, f64::min).clamp(1e-3, y_max / 2.0) * 0.8;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((1.0f64..x_max).log_scale(), (y_min..y_max).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| err(&e))?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, s) in series.iter().enumerate() {
        let color = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(s.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// One panel of a bar chart: categories along x, one bar per series in
/// each.
pub struct BarPanel {
    /// The y axis' label.
    pub y_label: String,
    /// Its width in pixels (the panels share a 1000 × 560 picture).
    pub width_px: u32,
    /// Category names along x.
    pub categories: Vec<String>,
    /// `values[series][category]`; `None` draws no bar.
    pub values: Vec<Vec<Option<f64>>>,
}

/// Grouped bars: the series (legend, in the first panel) and the panels.
pub struct Bars {
    /// Legend text of each series.
    pub series: Vec<String>,
    /// The panels, left to right.
    pub panels: Vec<BarPanel>,
}

/// Draw `bars` to an SVG file at `path`, linear y axes from 0.
pub fn bar_chart(path: &Path, title: &str, bars: &Bars) -> Result<(), BenchError> {
    let err = |e: &dyn std::fmt::Display| BenchError::Plot {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
    }
    let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut rest = root
        .titled(title, ("sans-serif", 20))
        .map_err(|e| err(&e))?;
    for (pi, panel) in bars.panels.iter().enumerate() {
        let area = if pi + 1 < bars.panels.len() {
            let (left, right) = rest.split_horizontally(panel.width_px);
            rest = right;
            left
        } else {
            rest.clone()
        };
        draw_panel(&area, panel, &bars.series, pi == 0).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The bars of series `si` (each `width` wide, in `color`), one per
/// category with a value.
fn bar_rects(
    values: &[Option<f64>],
    si: usize,
    width: f64,
    color: RGBColor,
) -> Vec<Rectangle<(f64, f64)>> {
    values
        .iter()
        .enumerate()
        .filter_map(|(ci, v)| {
            let x0 = ci as f64 - 0.4 + si as f64 * width;
            Some(Rectangle::new(
                [(x0, 0.0), (x0 + width * 0.9, (*v)?)],
                color.filled(),
            ))
        })
        .collect()
}

/// One panel of a bar chart in `area`: a bar per series in each category,
/// the legend (`legend`) in the first.
fn draw_panel(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    panel: &BarPanel,
    series: &[String],
    legend: bool,
) -> Result<(), String> {
    let colors = [BLUE, RED, GREEN, CYAN];
    let y_max = panel
        .values
        .iter()
        .flatten()
        .flatten()
        .copied()
        .fold(1.0f64, f64::max)
        * 1.35;
    let n = panel.categories.len() as f64;
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..n - 0.5, 0.0..y_max)
        .map_err(|e| e.to_string())?;
    let names = &panel.categories;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len())
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < names.len() {
                names[i as usize].clone()
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y:.0}"))
        .y_desc(panel.y_label.as_str())
        .draw()
        .map_err(|e| e.to_string())?;
    let width = 0.8 / series.len() as f64;
    for (si, label) in series.iter().enumerate() {
        let color = colors[si % colors.len()];
        let rects = bar_rects(&panel.values[si], si, width, color);
        let drawn = chart.draw_series(rects).map_err(|e| e.to_string())?;
        if legend {
            drawn.label(label.clone()).legend(move |(x, y)| {
                Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled())
            });
        }
    }
    if legend {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}
