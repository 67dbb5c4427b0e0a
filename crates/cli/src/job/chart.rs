//! The SVG chart: bandwidth (GB/s) against batch size (rows, log scale) for every method
//! and direction. Hand-written SVG, no dependencies.

use std::fmt::Write as _;

use super::measure::{Direction, Method, Point};
use super::report::short_rows;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 560.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 70.0;
const BOTTOM: f64 = 60.0;

fn color(method: Method) -> &'static str {
    match method {
        Method::Devarrow => "#d62728",
        Method::Pinned => "#1f77b4",
        Method::Pageable => "#2ca02c",
        Method::BufferByBuffer => "#9467bd",
    }
}

fn dash(direction: Direction) -> &'static str {
    match direction {
        Direction::HostToDevice => "",
        Direction::DeviceToHost => r##" stroke-dasharray="7 4""##,
    }
}

/// Escapes text for SVG content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// A round upper bound for the y axis and its tick step (1, 2 or 5 times a power of 10).
fn y_axis(max: f64) -> (f64, f64) {
    let max = if max.is_finite() && max > 0.0 {
        max
    } else {
        1.0
    };
    let raw = max / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    ((max / step).ceil() * step, step)
}

/// The chart of `points`: one series (a polyline with markers) per method and direction,
/// titled `title` and `subtitle`.
pub fn svg(points: &[Point], title: &str, subtitle: &str) -> String {
    let mut points: Vec<&Point> = points.iter().collect();
    points.sort_by_key(|p| p.batch_rows);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    // x: log2 of the batch size, padded half an octave on each side.
    let log = |rows: usize| (rows.max(1) as f64).log2();
    let (lo, hi) = match (points.first(), points.last()) {
        (Some(a), Some(b)) => (log(a.batch_rows) - 0.5, log(b.batch_rows) + 0.5),
        _ => (0.0, 1.0),
    };
    let x = |rows: usize| LEFT + (log(rows) - lo) / (hi - lo) * plot_w;
    let max = points
        .iter()
        .flat_map(|p| p.timings.iter().map(|t| t.gbps()))
        .fold(0.0, f64::max);
    let (y_max, y_step) = y_axis(max * 1.05);
    let y = |gbps: f64| TOP + plot_h - gbps / y_max * plot_h;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{LEFT}" y="28" font-size="16" font-weight="bold">{}</text>
<text x="{LEFT}" y="48" fill="#555">{}</text>"##,
        escape(title),
        escape(subtitle)
    );
    // Axes, grid and ticks.
    let _ = writeln!(s, r##"<g class="axes" stroke="#999" fill="none">"##);
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>"##
    );
    let mut tick = 0.0;
    while tick <= y_max + y_step / 2.0 {
        let yy = y(tick);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e5e5e5"/>"##,
            LEFT + plot_w
        );
        tick += y_step;
    }
    for p in &points {
        let xx = x(p.batch_rows);
        let _ = writeln!(
            s,
            r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" stroke="#e5e5e5"/>"##,
            TOP + plot_h
        );
    }
    let _ = writeln!(s, "</g>");
    let _ = writeln!(s, r##"<g class="labels" fill="#333">"##);
    let mut tick = 0.0;
    while tick <= y_max + y_step / 2.0 {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            LEFT - 8.0,
            y(tick) + 4.0,
            format_tick(tick, y_step)
        );
        tick += y_step;
    }
    for p in &points {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            x(p.batch_rows),
            TOP + plot_h + 18.0,
            short_rows(p.batch_rows)
        );
    }
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">rows per batch (log scale)</text>"##,
        LEFT + plot_w / 2.0,
        HEIGHT - 16.0
    );
    let _ = writeln!(
        s,
        r##"<text transform="translate(20 {:.1}) rotate(-90)" text-anchor="middle">bandwidth (GB/s)</text>"##,
        TOP + plot_h / 2.0
    );
    let _ = writeln!(s, "</g>");

    // One series per method and direction, and its legend entry.
    let mut legend_y = TOP + 8.0;
    let legend_x = LEFT + plot_w + 20.0;
    for method in Method::ALL {
        for direction in Direction::ALL {
            let series: Vec<(usize, f64)> = points
                .iter()
                .filter_map(|p| {
                    p.timing(method, direction)
                        .map(|t| (p.batch_rows, t.gbps()))
                })
                .collect();
            let (stroke, dash) = (color(method), dash(direction));
            let name = format!("{} {}", method.label(), direction.short());
            let _ = writeln!(
                s,
                r##"<g class="series" data-method="{}" data-direction="{}" stroke="{stroke}" fill="{stroke}">"##,
                method.key(),
                direction.key()
            );
            let _ = writeln!(s, "<title>{}</title>", escape(&name));
            let coords: Vec<String> = series
                .iter()
                .map(|&(rows, gbps)| format!("{:.1},{:.1}", x(rows), y(gbps)))
                .collect();
            let _ = writeln!(
                s,
                r##"<polyline fill="none" stroke-width="2"{dash} points="{}"/>"##,
                coords.join(" ")
            );
            for &(rows, gbps) in &series {
                let (cx, cy) = (x(rows), y(gbps));
                let tip = format!(
                    "{name}, {} rows per batch: {gbps:.2} GB/s",
                    short_rows(rows)
                );
                match direction {
                    Direction::HostToDevice => {
                        let _ = writeln!(
                            s,
                            r##"<circle cx="{cx:.1}" cy="{cy:.1}" r="3.5"><title>{}</title></circle>"##,
                            escape(&tip)
                        );
                    }
                    Direction::DeviceToHost => {
                        let _ = writeln!(
                            s,
                            r##"<rect x="{:.1}" y="{:.1}" width="7" height="7" fill="white" stroke-width="1.5"><title>{}</title></rect>"##,
                            cx - 3.5,
                            cy - 3.5,
                            escape(&tip)
                        );
                    }
                }
            }
            let _ = writeln!(
                s,
                r##"<line x1="{legend_x:.1}" y1="{legend_y:.1}" x2="{:.1}" y2="{legend_y:.1}" stroke-width="2"{dash}/>"##,
                legend_x + 30.0
            );
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" stroke="none" fill="#333">{}</text>"##,
                legend_x + 38.0,
                legend_y + 4.0,
                escape(&name)
            );
            let _ = writeln!(s, "</g>");
            legend_y += 20.0;
        }
    }
    let _ = writeln!(
        s,
        r##"<text x="{legend_x:.1}" y="{:.1}" fill="#555" font-size="11">solid: host to device</text>
<text x="{legend_x:.1}" y="{:.1}" fill="#555" font-size="11">dashed: device to host</text>
<text x="{legend_x:.1}" y="{:.1}" fill="#555" font-size="11">raw copies: all bytes in one copy</text>"##,
        legend_y + 12.0,
        legend_y + 28.0,
        legend_y + 44.0
    );
    s.push_str("</svg>\n");
    s
}

fn format_tick(value: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{value:.0}")
    } else {
        let decimals = (-step.log10().floor()) as usize;
        format!("{value:.decimals$}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::report::tests::sample_point;

    /// A small well-formedness check: every tag closes in order, attributes are quoted,
    /// no raw `<` or `&` in text.
    pub(crate) fn check_well_formed(xml: &str) -> Result<usize, String> {
        let mut stack: Vec<&str> = Vec::new();
        let mut elements = 0;
        let mut rest = xml;
        while let Some(open) = rest.find('<') {
            let text = &rest[..open];
            check_text(text)?;
            let close = rest[open..].find('>').ok_or("unterminated tag")? + open;
            let tag = &rest[open + 1..close];
            rest = &rest[close + 1..];
            if tag.starts_with('?') {
                if !tag.ends_with('?') {
                    return Err(format!("bad declaration <{tag}>"));
                }
                continue;
            }
            if let Some(name) = tag.strip_prefix('/') {
                match stack.pop() {
                    Some(open) if open == name.trim() => continue,
                    other => return Err(format!("</{name}> closes {other:?}")),
                }
            }
            let self_closing = tag.ends_with('/');
            let body = tag.trim_end_matches('/');
            let name = body.split_whitespace().next().ok_or("empty tag")?;
            if !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == ':')
            {
                return Err(format!("bad tag name {name:?}"));
            }
            if !body.matches('"').count().is_multiple_of(2) {
                return Err(format!("unbalanced quotes in <{tag}>"));
            }
            check_text(&body.replace('"', ""))?;
            elements += 1;
            if !self_closing {
                stack.push(name);
            }
        }
        check_text(rest)?;
        if stack.is_empty() {
            Ok(elements)
        } else {
            Err(format!("unclosed {stack:?}"))
        }
    }

    fn check_text(text: &str) -> Result<(), String> {
        if text.contains('<') || text.contains('>') {
            return Err(format!("raw angle bracket in {text:?}"));
        }
        for (i, _) in text.match_indices('&') {
            let entity = &text[i..];
            if !["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"]
                .iter()
                .any(|e| entity.starts_with(e))
            {
                return Err(format!("raw & in {text:?}"));
            }
        }
        Ok(())
    }

    #[test]
    fn the_checker_catches_bad_xml() {
        assert!(check_well_formed("<a><b/></a>").is_ok());
        assert!(check_well_formed("<a><b></a>").is_err());
        assert!(check_well_formed("<a>x & y</a>").is_err());
        assert!(check_well_formed(r##"<a x="1></a>"##).is_err());
    }

    #[test]
    fn a_well_formed_chart_with_a_series_per_method_and_direction() {
        let points = [
            sample_point(1 << 20, 0.25),
            sample_point(1024, 2.0),
            sample_point(64 << 10, 1.0),
        ];
        let svg = svg(&points, "lineitem <SF 0.1> & more", "devarrow \"x\"");
        let elements = check_well_formed(&svg).unwrap_or_else(|e| panic!("{e}\n{svg}"));
        assert!(elements > 50);
        assert!(svg.starts_with("<?xml"));
        assert!(svg.contains("lineitem &lt;SF 0.1&gt; &amp; more"));
        for method in Method::ALL {
            for direction in Direction::ALL {
                let tag = format!(
                    r##"data-method="{}" data-direction="{}""##,
                    method.key(),
                    direction.key()
                );
                assert_eq!(svg.matches(&tag).count(), 1, "{tag}");
            }
        }
        assert_eq!(svg.matches("<polyline").count(), 8);
        // Three points per series, in batch-size order.
        assert_eq!(svg.matches("<circle").count(), 4 * 3);
        for label in [">1K<", ">64K<", ">1M<"] {
            assert!(svg.contains(label), "{label}");
        }
        let i1 = svg.find(">1K<").unwrap();
        let i2 = svg.find(">64K<").unwrap();
        assert!(i1 < i2);
    }

    #[test]
    fn one_point_and_empty_charts_are_well_formed() {
        check_well_formed(&svg(&[sample_point(4096, 1.0)], "t", "s")).unwrap();
        check_well_formed(&svg(&[], "t", "s")).unwrap();
    }

    #[test]
    fn y_axis_is_round() {
        assert_eq!(y_axis(9.3), (10.0, 2.0));
        assert_eq!(y_axis(52.0), (60.0, 20.0));
        assert_eq!(y_axis(0.0), (1.0, 0.2));
        let (max, step) = y_axis(0.37);
        assert!((max - 0.4).abs() < 1e-9 && (step - 0.1).abs() < 1e-9);
        assert_eq!(format_tick(0.30000000000000004, 0.1), "0.3");
    }
}
