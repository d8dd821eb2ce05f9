//! The ground floor of the worker's Prometheus metrics: the [`Registrar`] every wing registers its metric set
//! through (on a registry of the worker's own, never the process-global one, so each test app starts clean), the
//! [`Exposition`] served at `/metrics`, and the helpers the sets share. It imports nothing of the worker's.
//!
//! Each wing registers the metrics it records, and owns their outcome enums, beside its code (`source/metrics.rs`,
//! `source/ingest.rs`, `cache/metrics.rs`, `store/metrics.rs`, `http/metrics.rs`, `warm_up/metrics.rs`) and holds
//! its own handle. A set exports its labelled series at zero when it registers them, so a panel or an alert sees 0
//! rather than nothing; label values come from closed sets (the owner's enums' `label()`s), never from ids. The
//! wiring registers every set in one place (`startup/metrics.rs`); its tests pin every name and label.

use prometheus::core::{Collector, Desc, MetricVec, MetricVecBuilder};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Buckets of the read and store-query durations, in seconds: from a read answered from memory to the store timeout.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// The registry every set registered on, rendered for `/metrics`. Cloning is cheap.
#[derive(Clone)]
pub struct Exposition {
    registry: Registry,
}

impl Exposition {
    /// Every metric family as collected now.
    pub fn gather(&self) -> Vec<MetricFamily> {
        self.registry.gather()
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.gather(), &mut buffer);
        String::from_utf8(buffer).unwrap_or_default()
    }
}

/// The kind of a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One metric as its component registered it.
#[derive(Debug, Clone, Copy)]
pub struct Described {
    pub name: &'static str,
    pub labels: &'static [&'static str],
    /// What it counts or measures (the `# HELP` line).
    pub help: &'static str,
    pub kind: Kind,
}

/// Registers the wings' metrics on one registry and notes how each one is described.
///
/// Every method panics on an invalid definition or a name registered twice: a programming error that every test
/// run catches.
pub struct Registrar {
    registry: Registry,
    described: Vec<Described>,
}

impl Default for Registrar {
    fn default() -> Self {
        Self::new()
    }
}

impl Registrar {
    /// A registrar over a fresh registry.
    pub fn new() -> Self {
        Self {
            registry: Registry::new(),
            described: Vec::new(),
        }
    }

    /// What was registered: the exposition to serve, and every metric as described, in registration order.
    pub fn finish(self) -> (Exposition, Vec<Described>) {
        (
            Exposition {
                registry: self.registry,
            },
            self.described,
        )
    }

    /// Registers a collector that is not a described metric of the worker's own (the process collector).
    ///
    /// # Panics
    /// If its names clash with a registered metric's.
    pub fn collector(&mut self, collector: Box<dyn Collector>) {
        self.registry
            .register(collector)
            .expect("collector names are unique");
    }

    pub fn counter(&mut self, name: &'static str, help: &'static str) -> IntCounter {
        let metric = IntCounter::new(name, help).expect("valid metric");
        self.add(metric, name, &[], help, Kind::Counter)
    }

    /// A counter whose value is read from `read` (a total kept elsewhere) at each scrape.
    pub fn counter_read_at_scrape(
        &mut self,
        name: &'static str,
        help: &'static str,
        read: fn() -> u64,
    ) {
        let counter = IntCounter::new(name, help).expect("valid metric");
        self.add(
            ReadAtScrape { counter, read },
            name,
            &[],
            help,
            Kind::Counter,
        );
    }

    pub fn counter_vec(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> IntCounterVec {
        let metric = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
        self.add(metric, name, labels, help, Kind::Counter)
    }

    pub fn gauge(&mut self, name: &'static str, help: &'static str) -> IntGauge {
        let metric = IntGauge::new(name, help).expect("valid metric");
        self.add(metric, name, &[], help, Kind::Gauge)
    }

    pub fn gauge_vec(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
    ) -> IntGaugeVec {
        let metric = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
        self.add(metric, name, labels, help, Kind::Gauge)
    }

    /// A gauge of a fractional quantity (seconds).
    pub fn float_gauge(&mut self, name: &'static str, help: &'static str) -> Gauge {
        let metric = Gauge::new(name, help).expect("valid metric");
        self.add(metric, name, &[], help, Kind::Gauge)
    }

    pub fn histogram(
        &mut self,
        name: &'static str,
        help: &'static str,
        buckets: &[f64],
    ) -> Histogram {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        let metric = Histogram::with_opts(opts).expect("valid metric");
        self.add(metric, name, &[], help, Kind::Histogram)
    }

    pub fn histogram_vec(
        &mut self,
        name: &'static str,
        help: &'static str,
        labels: &'static [&'static str],
        buckets: &[f64],
    ) -> HistogramVec {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        let metric = HistogramVec::new(opts, labels).expect("valid metric");
        self.add(metric, name, labels, help, Kind::Histogram)
    }

    fn add<T: Collector + Clone + 'static>(
        &mut self,
        metric: T,
        name: &'static str,
        labels: &'static [&'static str],
        help: &'static str,
        kind: Kind,
    ) -> T {
        self.registry
            .register(Box::new(metric.clone()))
            .expect("metric names are unique and valid");
        self.described.push(Described {
            name,
            labels,
            help,
            kind,
        });
        metric
    }
}

/// A counter brought up to a total read elsewhere whenever it is collected ([`Registrar::counter_read_at_scrape`]).
#[derive(Clone)]
struct ReadAtScrape {
    counter: IntCounter,
    read: fn() -> u64,
}

impl Collector for ReadAtScrape {
    fn desc(&self) -> Vec<&Desc> {
        self.counter.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let total = (self.read)();
        self.counter
            .inc_by(total.saturating_sub(self.counter.get()));
        self.counter.collect()
    }
}

/// Exports the series of a one-label metric for each of `values` at zero.
pub fn preset<T: MetricVecBuilder>(metric: &MetricVec<T>, values: &[&str]) {
    for value in values {
        metric.with_label_values(&[value]);
    }
}

/// A count as an integer gauge's value (a count beyond `i64::MAX` shows as that).
pub fn gauge_value(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

/// A metric set registered alone, with the exposition that renders it, for the wings' tests.
#[cfg(test)]
pub(crate) fn registered<T>(register: impl FnOnce(&mut Registrar) -> T) -> (T, Exposition) {
    let mut registrar = Registrar::new();
    let set = register(&mut registrar);
    (set, registrar.finish().0)
}

/// The value of `series` (its name and labels as rendered) in a `/metrics` text, for the components' tests.
#[cfg(test)]
pub(crate) fn sample(rendered: &str, series: &str) -> Option<f64> {
    rendered
        .lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
