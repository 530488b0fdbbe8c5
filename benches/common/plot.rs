//! `--plot FILE.svg`: bus bandwidth against size (log x), one line per collective.

use std::path::Path;

use plotters::prelude::*;

use super::ranks::Result;
use super::report::{Collective, Measured, Row, RunInfo, MEASURED};

/// Draws the best of out-of-place and in-place bus bandwidth per size, per collective.
pub fn draw(path: &Path, info: &RunInfo, rows: &[Row]) -> Result<()> {
    let series: Vec<(Collective, Vec<(f64, f64)>)> = MEASURED
        .iter()
        .map(|&c| {
            let pts = rows
                .iter()
                .filter(|r| r.collective == c && r.size > 0)
                .map(|r| (r.size as f64, r.out_of_place.busbw.max(r.in_place.busbw)))
                .collect::<Vec<_>>();
            (c, pts)
        })
        .filter(|(_, p)| !p.is_empty())
        .collect();
    if series.is_empty() {
        return Err("nothing to plot: no row has a size above 0".into());
    }
    let all = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x0, mut x1, mut y1) = (f64::MAX, 0.0f64, 0.0f64);
    for &(x, y) in all {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    if x1 <= x0 {
        x1 = x0 * 2.0;
    }
    let y1 = if y1 > 0.0 { y1 * 1.1 } else { 1.0 };
    let title = format!(
        "bus bandwidth: backend {}, {}, NCCL {}",
        info.backend,
        info.device_summary(),
        info.nccl_version
    );
    let root = SVGBackend::new(path, (1000, 640)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(
            (x0..x1).log_scale().with_key_points(size_ticks(x0, x1)),
            0.0..y1,
        )?;
    chart
        .configure_mesh()
        .x_desc("size (bytes)")
        .y_desc("busbw (GB/s)")
        .x_label_formatter(&|v| human_bytes(*v))
        .draw()?;
    for (i, (c, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
            .label(c.bench_name())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// Powers of two from `x0` to `x1`, at most about a dozen (every other one, every fourth,
/// ... as the range grows): binary sizes as nccl-tests sweeps them.
fn size_ticks(x0: f64, x1: f64) -> Vec<f64> {
    let (lo, hi) = (
        x0.max(1.0).log2().floor() as i32,
        x1.max(1.0).log2().ceil() as i32,
    );
    let stride = ((hi - lo) / 12 + 1).max(1) as usize;
    (lo..=hi)
        .step_by(stride)
        .map(|e| 2f64.powi(e))
        .filter(|&v| v >= x0 && v <= x1)
        .collect()
}

/// `1024` -> `1K`, binary units as the sizes on the command line.
pub fn human_bytes(v: f64) -> String {
    let units = ["B", "K", "M", "G", "T"];
    let mut v = v;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if (v - v.round()).abs() < 1e-9 {
        format!("{}{}", v.round(), units[u])
    } else {
        format!("{v:.1}{}", units[u])
    }
}
