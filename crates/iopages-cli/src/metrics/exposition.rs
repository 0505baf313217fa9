//! The two text formats `/metrics` serves, written from one description
//! of a scrape's metric families: the Prometheus text format 0.0.4
//! (`text/plain; version=0.0.4`, what every scraper reads and what
//! `promtool check metrics` checks) and OpenMetrics 1.0.0 text
//! (`application/openmetrics-text; version=1.0.0`, for a scraper whose
//! `Accept` header prefers it).
//!
//! Owns: [`Family`], the description `metrics.rs` fills; the choice of
//! format from a request's `Accept` headers ([`Format::negotiate`]); and
//! each format's rules. The two differ in three places only:
//!
//! | | 0.0.4 | OpenMetrics 1.0.0 |
//! | --- | --- | --- |
//! | a counter's `# HELP`, `# TYPE` | the samples' name, `iopages_read_bytes_total` | the family's, `iopages_read_bytes` |
//! | `"` in help text | as it is | `\"` |
//! | the end | nothing | `# EOF` |
//!
//! The samples themselves are the same in both — a counter's is always
//! `NAME_total`, a histogram's `NAME_bucket{…,le="…"}` (cumulative, the
//! last `+Inf` and equal to `NAME_count`), `NAME_sum` and `NAME_count` —
//! so a series keeps its name whichever format a scraper asks for.
//!
//! Must never: give one format's body the other's content type, write a
//! sample that its family's `# TYPE` line does not name, or fail (it
//! writes into a `String`).

use std::fmt::Write;

/// What a family counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (samples `NAME_total`).
    Counter,
    /// A value now.
    Gauge,
    /// Observations in buckets (samples `NAME_bucket`, `_sum`, `_count`).
    Histogram,
}

impl Kind {
    fn type_name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Label names and values of one sample (`le` is added for buckets).
pub type Labels = Vec<(&'static str, String)>;

/// A histogram's observations.
#[derive(Clone, Debug, Default)]
pub struct Histogram {
    /// (upper bound in the family's unit, observations in that bucket
    /// alone — not cumulative), bounds ascending, the last `+Inf`.
    pub buckets: Vec<(f64, u64)>,
    /// The observations' sum.
    pub sum: f64,
}

/// One sample's value: a counter's or gauge's, or a histogram's.
#[derive(Clone, Debug)]
pub enum Value {
    /// A counter's or a gauge's value.
    Int(u64),
    /// A histogram's buckets and sum.
    Hist(Histogram),
}

/// A metric family: its name (without `_total`), help, kind and samples
/// (none is fine: the family is still described).
#[derive(Clone, Debug)]
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub samples: Vec<(Labels, Value)>,
}

/// Which text format a body is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4.
    Text004,
    /// OpenMetrics text 1.0.0.
    OpenMetrics,
}

/// The media type of OpenMetrics text, as an `Accept` header names it.
const OPENMETRICS: &str = "application/openmetrics-text";

impl Format {
    /// The `Content-Type` of a body in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::Text004 => "text/plain; version=0.0.4; charset=utf-8",
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    /// The format for a request whose `Accept` headers' values are
    /// `accepts`: OpenMetrics when a range names it with a quality above
    /// 0 and at least that of `text/plain` (Prometheus asks with
    /// OpenMetrics first: `application/openmetrics-text;version=1.0.0,…,
    /// text/plain;version=0.0.4;q=0.5,*/*;q=0.1`), else 0.0.4 — also for
    /// no `Accept` at all, `*/*`, or a header that cannot be read.
    pub fn negotiate<'a>(accepts: impl IntoIterator<Item = &'a str>) -> Format {
        let (mut openmetrics, mut text) = (0.0f64, 0.0f64);
        for range in accepts.into_iter().flat_map(|v| v.split(',')) {
            let mut params = range.split(';');
            let media = params.next().unwrap_or("").trim();
            let q = params
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .map_or(Some(1.0), |(_, v)| v.trim().parse::<f64>().ok())
                .filter(|q| (0.0..=1.0).contains(q))
                .unwrap_or(0.0);
            if media.eq_ignore_ascii_case(OPENMETRICS) {
                openmetrics = openmetrics.max(q);
            } else if media.eq_ignore_ascii_case("text/plain") {
                text = text.max(q);
            }
        }
        if openmetrics > 0.0 && openmetrics >= text {
            Format::OpenMetrics
        } else {
            Format::Text004
        }
    }
}

/// `families` as a body in `format`.
pub fn encode(families: &[Family], format: Format) -> String {
    // A family described twice is invalid in both formats.
    debug_assert!(
        (0..families.len()).all(|i| families[..i].iter().all(|g| g.name != families[i].name)),
        "a metric family named twice"
    );
    let mut out = String::new();
    for f in families {
        debug_assert!(valid_name(f.name), "metric name {:?}", f.name);
        // The family's name is the counter's; its samples add `_total`.
        debug_assert!(!(f.kind == Kind::Counter && f.name.ends_with("_total")));
        let described = match (format, f.kind) {
            (Format::Text004, Kind::Counter) => format!("{}_total", f.name),
            _ => f.name.to_string(),
        };
        let help = escape_help(f.help, format);
        // Writing to a String cannot fail (here and below).
        let _ = writeln!(out, "# HELP {described} {help}");
        let _ = writeln!(out, "# TYPE {described} {}", f.kind.type_name());
        for (labels, value) in &f.samples {
            match (f.kind, value) {
                (Kind::Counter, Value::Int(v)) => {
                    sample(&mut out, f.name, "_total", labels, None, &v.to_string())
                }
                (Kind::Gauge, Value::Int(v)) => {
                    sample(&mut out, f.name, "", labels, None, &v.to_string())
                }
                (Kind::Histogram, Value::Hist(h)) => histogram(&mut out, f.name, labels, h),
                // A family's samples are of its kind; one that is not is
                // left out rather than written under the wrong TYPE.
                (kind, v) => debug_assert!(false, "{}: a {kind:?} with {v:?}", f.name),
            }
        }
    }
    if format == Format::OpenMetrics {
        out.push_str("# EOF\n");
    }
    out
}

/// A histogram's samples: cumulative buckets (the last `+Inf`), then
/// `_sum` and `_count` (the `+Inf` bucket's count).
fn histogram(out: &mut String, name: &str, labels: &Labels, h: &Histogram) {
    debug_assert!(h.buckets.last().is_some_and(|b| b.0 == f64::INFINITY));
    debug_assert!(h.buckets.windows(2).all(|w| w[0].0 < w[1].0));
    let mut cumulative = 0u64;
    for &(bound, n) in &h.buckets {
        cumulative += n;
        let le = if bound == f64::INFINITY {
            "+Inf".to_string()
        } else {
            float(bound)
        };
        let count = cumulative.to_string();
        sample(out, name, "_bucket", labels, Some(&le), &count);
    }
    sample(out, name, "_sum", labels, None, &float(h.sum));
    sample(out, name, "_count", labels, None, &cumulative.to_string());
}

/// One sample line: `NAME SUFFIX{labels,le="…"} value`, a bare name
/// where there are no labels.
fn sample(out: &mut String, name: &str, suffix: &str, labels: &Labels, le: Option<&str>, v: &str) {
    out.push_str(name);
    out.push_str(suffix);
    let le = le.map(|b| ("le", b));
    let all = labels.iter().map(|(k, v)| (*k, v.as_str())).chain(le);
    for (i, (k, v)) in all.enumerate() {
        out.push(if i == 0 { '{' } else { ',' });
        let _ = write!(out, "{k}=\"{}\"", escape_label(v));
    }
    if !labels.is_empty() || le.is_some() {
        out.push('}');
    }
    out.push(' ');
    out.push_str(v);
    out.push('\n');
}

/// A float as both formats read it: the shortest text that reads back as
/// the same number, with `.0` on a whole one (`20.0`, `0.000004`).
fn float(v: f64) -> String {
    debug_assert!(v.is_finite(), "{v}");
    let s = v.to_string();
    match s.contains(['.', 'e', 'E']) {
        true => s,
        false => s + ".0",
    }
}

/// A label value escaped: `\`, `"` and line feed (both formats alike).
fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

/// Help text escaped: `\` and line feed, and in OpenMetrics `"` too.
fn escape_help(v: &str, format: Format) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            '"' if format == Format::OpenMetrics => s.push_str("\\\""),
            c => s.push(c),
        }
    }
    s
}

/// Whether `name` is a metric name both formats allow (no `:`, which is
/// for recording rules).
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn families() -> Vec<Family> {
        let hist = Histogram {
            buckets: vec![(0.5, 1), (1.0, 0), (f64::INFINITY, 2)],
            sum: 7.25,
        };
        vec![
            Family {
                name: "t_read_bytes",
                help: "Bytes \"read\" \\ here.\nSecond line.",
                kind: Kind::Counter,
                samples: vec![(vec![("export", "a\"b\\c\nd".into())], Value::Int(3))],
            },
            Family {
                name: "t_open",
                help: "Open now.",
                kind: Kind::Gauge,
                samples: vec![(Vec::new(), Value::Int(1))],
            },
            Family {
                name: "t_duration_seconds",
                help: "Time.",
                kind: Kind::Histogram,
                samples: vec![(vec![("export", "x".into())], Value::Hist(hist))],
            },
            Family {
                name: "t_empty",
                help: "No samples yet.",
                kind: Kind::Counter,
                samples: Vec::new(),
            },
        ]
    }

    #[test]
    fn text_004_names_a_counter_by_its_samples_and_has_no_eof() {
        let t = encode(&families(), Format::Text004);
        let want = "\
# HELP t_read_bytes_total Bytes \"read\" \\\\ here.\\nSecond line.
# TYPE t_read_bytes_total counter
t_read_bytes_total{export=\"a\\\"b\\\\c\\nd\"} 3
# HELP t_open Open now.
# TYPE t_open gauge
t_open 1
# HELP t_duration_seconds Time.
# TYPE t_duration_seconds histogram
t_duration_seconds_bucket{export=\"x\",le=\"0.5\"} 1
t_duration_seconds_bucket{export=\"x\",le=\"1.0\"} 1
t_duration_seconds_bucket{export=\"x\",le=\"+Inf\"} 3
t_duration_seconds_sum{export=\"x\"} 7.25
t_duration_seconds_count{export=\"x\"} 3
# HELP t_empty_total No samples yet.
# TYPE t_empty_total counter
";
        assert_eq!(t, want);
    }

    #[test]
    fn openmetrics_names_a_counter_by_its_family_and_ends_with_eof() {
        let t = encode(&families(), Format::OpenMetrics);
        assert!(t.starts_with(
            "# HELP t_read_bytes Bytes \\\"read\\\" \\\\ here.\\nSecond line.\n\
             # TYPE t_read_bytes counter\n\
             t_read_bytes_total{export=\"a\\\"b\\\\c\\nd\"} 3\n"
        ));
        assert!(t.contains("# TYPE t_empty counter\n"));
        assert!(t.ends_with("t_duration_seconds_count{export=\"x\"} 3\n# HELP t_empty No samples yet.\n# TYPE t_empty counter\n# EOF\n"));
        assert_eq!(t.matches("# EOF").count(), 1);
        // The samples are those of 0.0.4, line for line.
        let samples = |t: &str| -> Vec<String> {
            t.lines()
                .filter(|l| !l.starts_with('#'))
                .map(String::from)
                .collect()
        };
        assert_eq!(samples(&t), samples(&encode(&families(), Format::Text004)));
    }

    #[test]
    fn negotiation_prefers_openmetrics_only_when_asked_for() {
        use Format::{OpenMetrics as Om, Text004 as T};
        let prometheus2 = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        let prometheus3 = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.5,application/openmetrics-text;version=1.0.0;q=0.4,application/openmetrics-text;version=0.0.1;q=0.3,text/plain;version=1.0.0;q=0.2,text/plain;version=0.0.4;q=0.1,*/*;q=0.05";
        for (accepts, want) in [
            (vec![], T),
            (vec!["*/*"], T),
            (vec!["text/plain"], T),
            (vec![prometheus2], Om),
            (vec![prometheus3], Om),
            (vec!["application/openmetrics-text; version=1.0.0"], Om),
            (vec!["Application/OpenMetrics-Text"], Om),
            (vec!["application/openmetrics-text;q=0"], T),
            (vec!["application/openmetrics-text;q=0.3, text/plain"], T),
            (
                vec!["text/plain;q=0.2", "application/openmetrics-text;q=0.9"],
                Om,
            ),
            (vec!["application/openmetrics-text;q=nonsense"], T),
            (vec!["application/openmetrics-text;q=7"], T),
            (vec![";;,,=;q"], T),
        ] {
            assert_eq!(
                Format::negotiate(accepts.iter().copied()),
                want,
                "{accepts:?}"
            );
        }
    }

    #[test]
    fn floats_read_back_as_the_same_number() {
        for (v, s) in [
            (20.0, "20.0"),
            (0.000004, "0.000004"),
            (16.777216, "16.777216"),
            (0.1 + 0.2, "0.30000000000000004"),
            (0.0, "0.0"),
        ] {
            assert_eq!(float(v), s);
            assert_eq!(float(v).parse::<f64>().unwrap(), v);
        }
    }

    #[test]
    fn names_outside_the_metric_name_grammar_are_caught() {
        assert!(valid_name("iopages_read_bytes"));
        assert!(valid_name("_x9"));
        for bad in ["", "9a", "a-b", "a:b", "a b", "é"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
