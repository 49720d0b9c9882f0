//! Benchmark figures: one value with its unit and target, printed as a table for people
//! or as one JSON object per line for scripts.

use serde::Serialize;

/// Which direction is better for a figure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    Higher,
    Lower,
}

/// One measured figure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Figure {
    pub suite: String,
    pub name: String,
    pub value: f64,
    pub unit: String,
    pub better: Better,
    /// The target the project holds this figure to (`value` must reach it in the
    /// `better` direction), if any.
    pub target: Option<f64>,
    /// Whether the target is met; absent when there is no target.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub met: Option<bool>,
}

impl Figure {
    pub fn new(suite: &str, name: &str, value: f64, unit: &str, better: Better) -> Self {
        Figure {
            suite: suite.into(),
            name: name.into(),
            value,
            unit: unit.into(),
            better,
            target: None,
            met: None,
        }
    }

    pub fn target(mut self, target: f64) -> Self {
        self.target = Some(target);
        self.met = Some(match self.better {
            Better::Higher => self.value >= target,
            Better::Lower => self.value <= target,
        });
        self
    }
}

fn fmt_value(v: f64) -> String {
    if v.abs() >= 1e6 {
        format!("{v:.3e}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Prints figures as JSON lines.
pub fn print_json(figs: &[Figure]) {
    for f in figs {
        match serde_json::to_string(f) {
            Ok(s) => println!("{s}"),
            Err(e) => log::error!("cannot serialize figure {}: {e}", f.name),
        }
    }
}

/// Prints figures as an aligned table.
pub fn print_table(figs: &[Figure]) {
    let w = figs.iter().map(|f| f.name.len()).max().unwrap_or(4).max(4);
    println!(
        "{:<8} {:<w$} {:>12} {:<10} {:>16} {:>4}",
        "suite", "name", "value", "unit", "target", "met"
    );
    for f in figs {
        let target = match (f.target, f.better) {
            (Some(t), Better::Higher) => format!(">= {}", fmt_value(t)),
            (Some(t), Better::Lower) => format!("<= {}", fmt_value(t)),
            (None, _) => "-".into(),
        };
        let met = match f.met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "",
        };
        println!(
            "{:<8} {:<w$} {:>12} {:<10} {:>16} {:>4}",
            f.suite,
            f.name,
            fmt_value(f.value),
            f.unit,
            target,
            met
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_the_documented_fields() {
        let f = Figure::new("sim", "x", 2.0, "ns", Better::Lower).target(1.0);
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&f).unwrap()).unwrap();
        for key in ["suite", "name", "value", "unit", "better", "target"] {
            assert!(v.get(key).is_some(), "{key}");
        }
        assert_eq!(v["better"], "lower");
        assert_eq!(v["met"], false);
        let g = Figure::new("sim", "y", 1.0, "x", Better::Higher);
        let v: serde_json::Value =
            serde_json::from_str(&serde_json::to_string(&g).unwrap()).unwrap();
        assert!(v["target"].is_null());
    }
}
