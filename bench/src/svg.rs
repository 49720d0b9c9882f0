//! A tiny SVG line-plot writer, so the project renders its benchmark plots itself
//! without plotting libraries.

use std::fmt::Write;

/// One line of a plot.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Dashed (for reference lines such as an ideal share).
    pub dashed: bool,
}

/// A line plot.
#[derive(Debug, Clone)]
pub struct Plot {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    /// Y axis from 0 to at least this (the data's maximum otherwise).
    pub y_min_top: f64,
    pub series: Vec<Series>,
}

const W: f64 = 720.0;
const H: f64 = 420.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 180.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 55.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A "nice" step for about `n` ticks over `span`.
fn nice_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(f64::MIN_POSITIVE);
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

fn fmt_tick(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

impl Plot {
    /// The plot as an SVG document.
    pub fn render(&self) -> String {
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let finite: Vec<(f64, f64)> = pts
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite() && (!self.log_x || *x > 0.0))
            .collect();
        let tx = |x: f64| if self.log_x { x.log10() } else { x };
        let (mut x0, mut x1) = finite
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (x, _)| {
                (a.min(tx(*x)), b.max(tx(*x)))
            });
        if !x0.is_finite() {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        let ymax = finite
            .iter()
            .map(|p| p.1)
            .fold(self.y_min_top, f64::max)
            .max(f64::MIN_POSITIVE);
        let ystep = nice_step(ymax, 5.0);
        let y1 = (ymax / ystep).ceil() * ystep;
        let pw = W - LEFT - RIGHT;
        let ph = H - TOP - BOTTOM;
        let px = |x: f64| LEFT + (tx(x) - x0) / (x1 - x0) * pw;
        let py = |y: f64| TOP + ph - y / y1 * ph;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="14">{}</text>"#,
            W / 2.0,
            esc(&self.title)
        );
        // Y grid and ticks.
        let mut y = 0.0;
        while y <= y1 + ystep / 2.0 {
            let yy = py(y);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                yy + 4.0,
                fmt_tick(y)
            );
            y += ystep;
        }
        // X ticks: decades on a log axis, nice steps otherwise.
        let mut xt = Vec::new();
        if self.log_x {
            let mut d = x0.floor();
            while d <= x1.ceil() {
                for m in [1.0, 2.0, 5.0] {
                    let v = 10f64.powf(d) * m;
                    if v.log10() >= x0 - 1e-9 && v.log10() <= x1 + 1e-9 {
                        xt.push(v);
                    }
                }
                d += 1.0;
            }
        } else {
            let step = nice_step(x1 - x0, 8.0);
            let mut v = (x0 / step).ceil() * step;
            while v <= x1 + 1e-9 {
                xt.push(v);
                v += step;
            }
        }
        for v in xt {
            let xx = px(v);
            let _ = writeln!(
                s,
                r##"<line x1="{xx:.1}" y1="{TOP}" x2="{xx:.1}" y2="{:.1}" stroke="#eee"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + ph,
                TOP + ph + 16.0,
                fmt_tick(v)
            );
        }
        let _ = writeln!(
            s,
            r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 14.0,
            esc(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text x="16" y="{:.1}" text-anchor="middle" transform="rotate(-90 16 {:.1})">{}</text>"#,
            TOP + ph / 2.0,
            TOP + ph / 2.0,
            esc(&self.y_label)
        );
        for (i, ser) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let path: Vec<String> = ser
                .points
                .iter()
                .filter(|(x, y)| x.is_finite() && y.is_finite() && (!self.log_x || *x > 0.0))
                .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                .collect();
            let dash = if ser.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            };
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"/>"#,
                path.join(" ")
            );
            if !ser.dashed && ser.points.len() <= 40 {
                for p in &path {
                    if let Some((x, y)) = p.split_once(',') {
                        let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{color}"/>"#);
                    }
                }
            }
            let ly = TOP + 10.0 + i as f64 * 18.0;
            let lx = LEFT + pw + 12.0;
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="2"{dash}/><text x="{}" y="{}">{}</text>"#,
                lx + 22.0,
                lx + 28.0,
                ly + 4.0,
                esc(&ser.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_well_formed_document() {
        let p = Plot {
            title: "a < b".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_x: true,
            y_min_top: 1.0,
            series: vec![
                Series {
                    name: "one".into(),
                    points: vec![(0.1, 1.0), (1.0, 2.0), (10.0, 3.0), (0.0, 5.0)],
                    dashed: false,
                },
                Series {
                    name: "ref".into(),
                    points: vec![(0.1, 2.0), (10.0, 2.0)],
                    dashed: true,
                },
            ],
        };
        let s = p.render();
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert!(s.contains("a &lt; b"));
        assert_eq!(s.matches("<polyline").count(), 2);
        assert_eq!(
            s.matches("<circle").count(),
            3,
            "x=0 is dropped on a log axis"
        );
        assert!(!s.contains("NaN") && !s.contains("inf"));
    }
}
