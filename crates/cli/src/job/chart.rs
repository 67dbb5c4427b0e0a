//! The chart: bandwidth (GB/s) against batch size (rows, log scale) for every method and
//! direction, drawn with plotters as SVG or PNG (by the file's extension). Text is laid
//! out (and, in a PNG, drawn) with DejaVu Sans, embedded in the binary: no system
//! fonts or libraries are needed.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::measure::{Direction, Method, Point};
use super::options::ChartFormat;
use super::report::short_rows;
use super::JobError;

/// The size of the chart, in pixels.
pub const SIZE: (u32, u32) = (1024, 576);

fn color(method: Method) -> RGBColor {
    match method {
        Method::Devarrow => RGBColor(0xd6, 0x27, 0x28),
        Method::Pinned => RGBColor(0x1f, 0x77, 0xb4),
        Method::Pageable => RGBColor(0x2c, 0xa0, 0x2c),
        Method::BufferByBuffer => RGBColor(0x94, 0x67, 0xbd),
    }
}

/// One series of the chart: its legend, color, direction (line style) and points.
type Line = (String, RGBColor, Direction, Vec<(f64, f64)>);

/// The color of devarrow's series on device `index` of a run on several.
fn device_color(index: usize) -> RGBColor {
    const PALETTE: [RGBColor; 6] = [
        RGBColor(0xff, 0x7f, 0x0e),
        RGBColor(0x8c, 0x56, 0x4b),
        RGBColor(0xe3, 0x77, 0xc2),
        RGBColor(0x7f, 0x7f, 0x7f),
        RGBColor(0xbc, 0xbd, 0x22),
        RGBColor(0x17, 0xbe, 0xcf),
    ];
    PALETTE[index % PALETTE.len()]
}

/// Registers the embedded DejaVu Sans as plotters' sans-serif font, once.
fn register_font() -> Result<(), JobError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        let font = dejavu::sans::regular();
        plotters::style::register_font("sans-serif", FontStyle::Normal, font).is_ok()
            && plotters::style::register_font("sans-serif", FontStyle::Bold, dejavu::sans::bold())
                .is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(JobError::new("the chart's embedded font does not load"))
    }
}

/// A round upper bound for the y axis (1, 2 or 5 times a power of 10, times a whole
/// number of steps).
fn y_max(max: f64) -> f64 {
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
    (max / step).ceil() * step
}

/// Writes the chart of `points` to `path`, as SVG or PNG by its extension.
pub fn write(path: &Path, points: &[Point], title: &str, subtitle: &str) -> Result<(), JobError> {
    let format = ChartFormat::of_path(path).map_err(JobError::new)?;
    let fail = |e: &dyn std::fmt::Display| {
        JobError::new(format!("cannot write the chart to {}: {e}", path.display()))
    };
    register_font()?;
    match format {
        ChartFormat::Svg => {
            let root = SVGBackend::new(path, SIZE).into_drawing_area();
            draw(&root, points, title, subtitle).map_err(|e| fail(&e))?;
            root.present().map_err(|e| fail(&e))
        }
        ChartFormat::Png => {
            let root = BitMapBackend::new(path, SIZE).into_drawing_area();
            draw(&root, points, title, subtitle).map_err(|e| fail(&e))?;
            root.present().map_err(|e| fail(&e))
        }
    }
}

/// Draws the chart on `root`: one series per method and direction (solid with dots:
/// host to device; dashed with squares: device to host), a legend (upper left, where
/// small batches are slow), the title and the subtitle.
fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    points: &[Point],
    title: &str,
    subtitle: &str,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let mut points: Vec<&Point> = points.iter().collect();
    points.sort_by_key(|p| p.batch_rows);
    // x: log2 of the batch size, padded half an octave on each side.
    let log = |rows: usize| (rows.max(1) as f64).log2();
    let (lo, hi) = match (points.first(), points.last()) {
        (Some(a), Some(b)) => (log(a.batch_rows) - 0.5, log(b.batch_rows) + 0.5),
        _ => (9.5, 10.5),
    };
    let max = points
        .iter()
        .flat_map(|p| {
            let multi = p.multi.iter().flat_map(|m| {
                Direction::ALL.into_iter().flat_map(move |d| {
                    m.shares
                        .iter()
                        .map(move |s| s.gbps(d))
                        .chain(std::iter::once(m.gbps(d)))
                })
            });
            p.timings.iter().map(|t| t.gbps()).chain(multi)
        })
        .fold(0.0, f64::max);
    let top = y_max(max * 1.05);

    root.fill(&WHITE)?;
    let (header, body) = root.split_vertically(64);
    header.draw(&Text::new(
        title.to_string(),
        (16, 10),
        ("sans-serif", 20).into_font().style(FontStyle::Bold),
    ))?;
    header.draw(&Text::new(
        subtitle.to_string(),
        (16, 38),
        ("sans-serif", 14)
            .into_font()
            .color(&RGBColor(0x55, 0x55, 0x55)),
    ))?;

    let mut chart = ChartBuilder::on(&body)
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(lo..hi, 0.0..top)?;
    let whole = |x: &f64| (x - x.round()).abs() < 1e-9 && *x >= 0.0 && *x < 63.0;
    chart
        .configure_mesh()
        .x_labels(((hi - lo).ceil() as usize + 1).max(2))
        .x_label_formatter(&|x| {
            if whole(x) {
                short_rows(1usize << (x.round() as u32))
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|y| format!("{y}"))
        .x_desc("rows per batch (log scale)")
        .y_desc("bandwidth (GB/s)")
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 14))
        .x_max_light_lines(1)
        .y_max_light_lines(2)
        .light_line_style(RGBColor(0xf2, 0xf2, 0xf2))
        .bold_line_style(RGBColor(0xdd, 0xdd, 0xdd))
        .draw()?;

    // Every series: each method in each direction and, on several devices, devarrow on
    // each device and on all of them together.
    let mut lines: Vec<Line> = Vec::new();
    for method in Method::ALL {
        for direction in Direction::ALL {
            let series: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|p| {
                    p.timing(method, direction)
                        .map(|t| (log(p.batch_rows), t.gbps()))
                })
                .collect();
            let name = format!("{} {}", method.label(), direction.short());
            lines.push((name, color(method), direction, series));
        }
    }
    let devices = points
        .iter()
        .filter_map(|p| p.multi.as_ref())
        .map(|m| m.shares.len())
        .max()
        .unwrap_or(0);
    for direction in Direction::ALL {
        for d in 0..devices {
            let series: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|p| {
                    let share = p.multi.as_ref()?.shares.get(d)?;
                    Some((log(p.batch_rows), share.gbps(direction)))
                })
                .collect();
            let id = points
                .iter()
                .find_map(|p| Some(p.multi.as_ref()?.shares.get(d)?.id.clone()))
                .unwrap_or_default();
            let name = format!("devarrow on {id} {}", direction.short());
            lines.push((name, device_color(d), direction, series));
        }
        if devices > 0 {
            let series: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|p| Some((log(p.batch_rows), p.multi.as_ref()?.gbps(direction))))
                .collect();
            let name = format!("devarrow, all {devices} devices {}", direction.short());
            lines.push((name, RGBColor(0x22, 0x22, 0x22), direction, series));
        }
    }
    for (name, c, direction, series) in lines {
        if series.is_empty() {
            continue;
        }
        let style = c.stroke_width(2);
        match direction {
            Direction::HostToDevice => {
                chart.draw_series(LineSeries::new(series.iter().copied(), style))?;
                chart
                    .draw_series(series.iter().map(|&p| Circle::new(p, 4, c.filled())))?
                    .label(name)
                    .legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (24, 0)], style)
                            + Circle::new((12, 0), 4, c.filled())
                    });
            }
            Direction::DeviceToHost => {
                chart.draw_series(DashedLineSeries::new(series.iter().copied(), 8, 5, style))?;
                chart
                    .draw_series(series.iter().map(|&p| {
                        EmptyElement::at(p)
                            + Rectangle::new([(-4, -4), (4, 4)], WHITE.filled())
                            + Rectangle::new([(-4, -4), (4, 4)], c.stroke_width(2))
                    }))?
                    .label(name)
                    .legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (7, 0)], style)
                            + PathElement::new(vec![(17, 0), (24, 0)], style)
                            + Rectangle::new([(8, -4), (16, 4)], c.stroke_width(2))
                    });
            }
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 13))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(0xbb, 0xbb, 0xbb))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::input::tests::TempDir;
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
            if !["&amp;", "&lt;", "&gt;", "&quot;", "&apos;", "&#"]
                .iter()
                .any(|e| entity.starts_with(e))
            {
                return Err(format!("raw & in {text:?}"));
            }
        }
        Ok(())
    }

    /// The PNG signature and the size in its IHDR chunk.
    pub(crate) fn png_size(bytes: &[u8]) -> Option<(u32, u32)> {
        let signature = b"\x89PNG\r\n\x1a\n";
        if !bytes.starts_with(signature) || bytes.get(12..16)? != b"IHDR" {
            return None;
        }
        let be = |at: usize| Some(u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?));
        Some((be(16)?, be(20)?))
    }

    fn points() -> [Point; 3] {
        [
            sample_point(1 << 20, 0.25),
            sample_point(1024, 2.0),
            sample_point(64 << 10, 1.0),
        ]
    }

    #[test]
    fn the_checker_catches_bad_xml() {
        assert!(check_well_formed("<a><b/></a>").is_ok());
        assert!(check_well_formed("<a><b></a>").is_err());
        assert!(check_well_formed("<a>x & y</a>").is_err());
        assert!(check_well_formed(r##"<a x="1></a>"##).is_err());
    }

    #[test]
    fn an_svg_chart_is_well_formed_with_a_series_per_method_and_direction() {
        let dir = TempDir::new();
        let path = dir.path("chart.svg");
        write(
            &path,
            &points(),
            "lineitem <SF 0.1> & more",
            "devarrow \"x\"",
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        let elements = check_well_formed(&svg).unwrap_or_else(|e| panic!("{e}\n{svg}"));
        assert!(elements > 50);
        let root = svg.trim_start().trim_start_matches(|c| c != '<');
        assert!(root.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
        assert!(svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("lineitem &lt;SF 0.1&gt; &amp; more"), "{svg}");
        for method in Method::ALL {
            for direction in Direction::ALL {
                let name = format!("{} {}", method.label(), direction.short());
                assert!(svg.contains(&name), "{name}");
            }
        }
        // One line per series, one dot per host-to-device point and one per legend entry
        // of a host-to-device series.
        assert!(svg.matches("<polyline").count() >= 8);
        assert_eq!(svg.matches("<circle").count(), 4 * 3 + 4);
        // Text is an element of its own, on a line of its own.
        for label in ["1K", "64K", "1M", "rows per batch (log scale)"] {
            assert!(svg.contains(&format!("\n{label}\n</text>")), "{label}");
        }
        let i1 = svg.find("\n1K\n").unwrap();
        let i2 = svg.find("\n64K\n").unwrap();
        assert!(i1 < i2);
    }

    /// On several devices the chart shows devarrow on each device and on all of them
    /// together, in both directions, beside the single-device series.
    #[test]
    fn a_chart_of_several_devices_has_a_series_per_device_and_the_total() {
        use crate::job::measure::{DeviceShare, MultiPoint};
        use std::time::Duration;
        let dir = TempDir::new();
        let path = dir.path("several.svg");
        let mut points = points();
        for (i, point) in points.iter_mut().enumerate() {
            let ms = |n: u64| Duration::from_millis(n + i as u64);
            let share = |id: &str| DeviceShare {
                id: id.into(),
                batches: 2,
                bytes: 1_000_000,
                to_device: vec![ms(1)],
                to_host: vec![ms(2)],
            };
            point.multi = Some(MultiPoint {
                shares: vec![share("cuda:0"), share("cuda:1")],
                wall_to_device: vec![ms(1)],
                wall_to_host: vec![ms(2)],
            });
        }
        write(&path, &points, "t", "s").unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        check_well_formed(&svg).unwrap_or_else(|e| panic!("{e}"));
        for direction in Direction::ALL {
            for name in [
                format!("devarrow on cuda:0 {}", direction.short()),
                format!("devarrow on cuda:1 {}", direction.short()),
                format!("devarrow, all 2 devices {}", direction.short()),
            ] {
                assert!(svg.contains(&name), "{name}");
            }
        }
        // three more host-to-device series: 3 points and a legend dot each
        assert_eq!(svg.matches("<circle").count(), 7 * 3 + 7);
    }

    #[test]
    fn a_png_chart_is_a_png_of_the_chart_size() {
        let dir = TempDir::new();
        let path = dir.path("chart.PNG");
        write(&path, &points(), "title", "subtitle").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(png_size(&bytes), Some(SIZE));
        // Text and lines are drawn: far more than a blank image compresses to.
        assert!(bytes.len() > 10_000, "{} bytes", bytes.len());
    }

    #[test]
    fn one_point_and_empty_charts_are_drawn() {
        let dir = TempDir::new();
        for name in ["one.svg", "one.png"] {
            write(&dir.path(name), &[sample_point(4096, 1.0)], "t", "s").unwrap();
        }
        write(&dir.path("empty.svg"), &[], "t", "s").unwrap();
        check_well_formed(&std::fs::read_to_string(dir.path("empty.svg")).unwrap()).unwrap();
        check_well_formed(&std::fs::read_to_string(dir.path("one.svg")).unwrap()).unwrap();
    }

    #[test]
    fn other_extensions_are_refused() {
        assert_eq!(
            ChartFormat::of_path(Path::new("a/b.SVG")),
            Ok(ChartFormat::Svg)
        );
        assert_eq!(
            ChartFormat::of_path(Path::new("b.png")),
            Ok(ChartFormat::Png)
        );
        for bad in ["chart.jpg", "chart", "chart.svg.gz", ".png"] {
            let err = ChartFormat::of_path(Path::new(bad)).unwrap_err();
            assert!(err.contains(".svg or .png"), "{bad}: {err}");
        }
        let dir = TempDir::new();
        let path = dir.path("chart.gif");
        let err = write(&path, &points(), "t", "s").unwrap_err().to_string();
        assert!(err.contains(".gif"), "{err}");
        assert!(!path.exists());
    }

    #[test]
    fn y_axis_is_round() {
        assert_eq!(y_max(9.3), 10.0);
        assert_eq!(y_max(52.0), 60.0);
        assert_eq!(y_max(0.0), 1.0);
        assert!((y_max(0.37) - 0.4).abs() < 1e-9);
    }
}
