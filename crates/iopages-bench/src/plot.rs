//! SVG line plots of cost against batch size.
//!
//! Owns: drawing series of (batch, cost) points on a log2 x axis. Must
//! never: change or smooth the figures it is given.

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
