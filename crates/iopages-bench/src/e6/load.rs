//! E6's loads and their figures, shared by every E6 run (local, remote,
//! sparse, tenants).
//!
//! Owns: [`Load`] (the loads in the order each server runs them, their
//! names and units) and [`Sample`] (one measurement). Must never: run a
//! tool — `fio.rs` and `measure.rs` turn a load into a sample.

/// The loads, in the order each server runs them (E6 and E6 remote).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Load {
    SeqWrite,
    SeqRead,
    RandRw,
    CopyRead,
    CopyWrite,
}

impl Load {
    pub(crate) const ALL: [Load; 5] = [
        Load::SeqWrite,
        Load::SeqRead,
        Load::RandRw,
        Load::CopyRead,
        Load::CopyWrite,
    ];

    pub(crate) fn key(self) -> &'static str {
        match self {
            Load::SeqWrite => "seq_write",
            Load::SeqRead => "seq_read",
            Load::RandRw => "randrw",
            Load::CopyRead => "nbdcopy_read",
            Load::CopyWrite => "nbdcopy_write",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Load::SeqWrite => "fio seq write 1M qd16",
            Load::SeqRead => "fio seq read 1M qd16",
            Load::RandRw => "fio randrw 4K 2x qd32",
            Load::CopyRead => "nbdcopy export -> null",
            Load::CopyWrite => "nbdcopy file -> export",
        }
    }

    /// The figure compared: IOPS for the random load, MiB/s otherwise.
    pub(crate) fn unit(self) -> &'static str {
        if self == Load::RandRw {
            "IOPS"
        } else {
            "MiB/s"
        }
    }

    /// Short name for the plot's axis.
    pub(super) fn short(self) -> &'static str {
        match self {
            Load::SeqWrite => "seq write",
            Load::SeqRead => "seq read",
            Load::RandRw => "randrw 4K",
            Load::CopyRead => "nbdcopy read",
            Load::CopyWrite => "nbdcopy write",
        }
    }
}

/// One measurement of one load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Sample {
    pub(crate) mib_s: f64,
    /// Requests per second (fio only; nbdcopy sizes its own requests).
    pub(crate) iops: Option<f64>,
}

impl Sample {
    /// The figure compared for `load`: IOPS for the random load, MiB/s
    /// otherwise.
    pub(crate) fn figure(&self, load: Load) -> f64 {
        match (load, self.iops) {
            (Load::RandRw, Some(i)) => i,
            _ => self.mib_s,
        }
    }
}
