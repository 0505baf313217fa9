//! A request received in part: what a connection keeps of it while it
//! waits for the rest without a thread ([`Partial`]).
//!
//! A client that sends half a request header, or a WRITE's header and
//! half its payload, and then stops, would hold the thread reading it
//! until the request's deadline. Instead the reading side keeps what has
//! arrived here — the header's bytes so far, the payload's chunks so far
//! in their arena buffers, or how much of a refused payload is still to
//! be dropped — and the connection parks; whichever watcher it comes back
//! to reads on from where the last one stopped.
//!
//! Owns: the bytes of one request received so far, and its deadline (the
//! request must be whole by then, however it arrives). Must never: lose
//! or repeat a byte across interruptions (every byte a read returned is
//! kept, and reading resumes after the last), allocate a chunk's buffer
//! before the bytes before it have arrived (a stalled client holds only
//! what it sent, plus one chunk), or hand out a request before it is
//! whole.

use crate::proto::{Request, REQUEST_BYTES};
use crate::server::buffers::{Buf, Buffers};
use crate::server::shares::BudgetWait;
use std::io::{self, Read};
use std::time::Instant;

/// Bytes per request submitted to the crypt queue: a longer NBD request is
/// split so one submission never needs more out pages than the target's
/// mempool reserve holds (256 pages by default), which keeps a 32 MiB write
/// from waiting for pages only it could free.
pub const CHUNK_BYTES: usize = 1 << 20;

/// The chunks of `len` bytes at `offset`: (offset, length) pairs.
pub(crate) fn chunks(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize)> {
    let mut at = 0u64;
    std::iter::from_fn(move || {
        if at >= len {
            return None;
        }
        let n = (len - at).min(CHUNK_BYTES as u64);
        let r = (offset + at, n as usize);
        at += n;
        Some(r)
    })
}

/// A request received in part, and what is still to come.
pub(crate) enum Partial {
    /// `have` bytes of a request header.
    Header {
        head: [u8; REQUEST_BYTES],
        have: usize,
        by: Instant,
    },
    /// A WRITE's payload (its place and bytes in flight taken): the whole
    /// chunks so far, and the one being filled with `have` bytes in it.
    Write {
        req: Request,
        whole: Vec<(u64, Buf)>,
        filling: Option<(u64, Buf, usize)>,
        by: Instant,
    },
    /// A refused WRITE's payload, read and dropped (nothing held): `left`
    /// bytes still to come; then the request is answered `error`.
    Discard {
        req: Request,
        error: u32,
        left: u64,
        by: Instant,
    },
    /// A request received whole (its payload, if any, still to come) that
    /// waits for its place in the connection's bounds (a release brings it
    /// back; no deadline of its own) or, with `budget`, for bytes of its
    /// peer's share of the budget (its next look is its deadline, at which
    /// it is run, not closed): nothing to read, nothing held.
    Place {
        req: Request,
        budget: Option<Box<BudgetWait>>,
    },
    /// A WRITE_ZEROES of encrypted zeros whose next chunk waits for bytes
    /// of the budget (the work itself is kept with the connection):
    /// nothing to read, no deadline of its own here.
    Work,
}

/// A request received whole.
pub(crate) enum Whole {
    /// A request header (not yet decoded).
    Header([u8; REQUEST_BYTES]),
    /// A WRITE and its payload, chunk by chunk.
    Write(Request, Vec<(u64, Buf)>),
    /// A refused WRITE whose payload has been dropped: answer `.1`.
    Refused(Request, u32),
    /// A request to try for its place again, and its wait for bytes.
    Place(Request, Option<Box<BudgetWait>>),
    /// Work to take up again.
    Work,
}

impl Partial {
    /// A header of which nothing has been read, due `by`.
    pub(crate) fn header(by: Instant) -> Partial {
        Partial::Header {
            head: [0; REQUEST_BYTES],
            have: 0,
            by,
        }
    }

    /// When the request must be whole (`None`: waiting for its place),
    /// or, waiting for bytes, when it looks next.
    pub(crate) fn by(&self) -> Option<Instant> {
        match self {
            Partial::Header { by, .. }
            | Partial::Write { by, .. }
            | Partial::Discard { by, .. } => Some(*by),
            Partial::Place { budget, .. } => budget.as_ref().map(|w| w.next()),
            Partial::Work => None,
        }
    }

    /// Payload bytes in flight the request holds (given back, with its
    /// place, when it is dropped unfinished): a WRITE's length.
    pub(crate) fn held_bytes(&self) -> Option<u64> {
        match self {
            Partial::Write { req, .. } => Some(req.length as u64),
            _ => None,
        }
    }

    /// Read on from `r` until the request is whole, taking a WRITE's
    /// chunk buffers from `buffers` as their turn comes.
    ///
    /// **Returns:** the request; `Err` with `r`'s error (the bytes read
    /// before it kept here, to read on from later), or `UnexpectedEof`
    /// when the stream ends first.
    pub(crate) fn receive(&mut self, r: &mut impl Read, buffers: &Buffers) -> io::Result<Whole> {
        match self {
            Partial::Header { head, have, .. } => {
                fill(r, head, have)?;
                Ok(Whole::Header(*head))
            }
            Partial::Write {
                req,
                whole,
                filling,
                ..
            } => {
                let len = req.length as u64;
                loop {
                    let (_, buf, have) = match filling {
                        Some(f) => f,
                        None => {
                            let done: u64 =
                                whole.iter().map(|(_, b)| b.as_ref().len() as u64).sum();
                            let Some((off, n)) = chunks(req.offset + done, len - done).next()
                            else {
                                return Ok(Whole::Write(*req, std::mem::take(whole)));
                            };
                            filling.insert((off, buffers.get(n), 0))
                        }
                    };
                    fill(r, buf.as_mut(), have)?;
                    let (off, buf, _) = filling.take().expect("filled just now");
                    whole.push((off, buf));
                }
            }
            Partial::Discard {
                req, error, left, ..
            } => {
                skip(r, left)?;
                Ok(Whole::Refused(*req, *error))
            }
            Partial::Place { req, budget } => Ok(Whole::Place(*req, budget.take())),
            Partial::Work => Ok(Whole::Work),
        }
    }
}

/// Read and drop `*left` bytes from `r`, counting each read's bytes off
/// `left` as they come (so an interrupted skip goes on where it stopped).
pub(crate) fn skip(r: &mut impl Read, left: &mut u64) -> io::Result<()> {
    let mut sink = [0u8; 4096];
    while *left > 0 {
        let n = (*left).min(sink.len() as u64) as usize;
        match r.read(&mut sink[..n]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(got) => *left -= got as u64,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Read into `buf` from `*have` on until it is full, counting each read's
/// bytes into `have` as they come.
pub(crate) fn fill(r: &mut impl Read, buf: &mut [u8], have: &mut usize) -> io::Result<()> {
    while *have < buf.len() {
        match r.read(&mut buf[*have..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => *have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{CMD_WRITE, REQUEST_MAGIC};
    use proptest::prelude::*;
    use std::time::Duration;

    /// A stream that gives `steps[i]` bytes per read, and after each read
    /// listed in `stops` refuses the next read with `WouldBlock`.
    struct Stuttering<'a> {
        data: &'a [u8],
        steps: Vec<usize>,
        reads: usize,
        stop_every: usize,
        stopped: bool,
    }

    impl Read for Stuttering<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            if !self.stopped
                && self.stop_every > 0
                && self.reads % self.stop_every == self.stop_every - 1
            {
                self.stopped = true;
                return Err(io::ErrorKind::WouldBlock.into());
            }
            self.stopped = false;
            let step = self.steps[self.reads % self.steps.len()].max(1);
            self.reads += 1;
            let n = self.data.len().min(out.len()).min(step);
            out[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    fn arena() -> (iopages::PageAllocator, Buffers) {
        let a = iopages::PageAllocator::builder()
            .size_bytes(16 << 20)
            .build()
            .unwrap();
        let b = Buffers::new(&a);
        (a, b)
    }

    fn write_req(offset: u64, length: u32) -> Request {
        Request {
            flags: 0,
            command: CMD_WRITE,
            cookie: 9,
            offset,
            length,
        }
    }

    /// Receive `p` from `s`, resuming after every refusal as a parked
    /// connection would: the number of interruptions, and the request.
    fn resume_until_whole(p: &mut Partial, s: &mut Stuttering<'_>, b: &Buffers) -> (usize, Whole) {
        let mut stops = 0;
        loop {
            match p.receive(s, b) {
                Ok(w) => return (stops, w),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => stops += 1,
                Err(e) => panic!("{e}"),
            }
            assert!(stops < 1 << 20, "no progress");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        #[test]
        fn a_write_interrupted_anywhere_comes_out_whole_and_in_order(
            len in 1u32..(3 << 20),
            offset in 0u64..4096,
            steps in proptest::collection::vec(1usize..200_000, 1..6),
            stop_every in 0usize..5,
        ) {
            let (alloc, b) = arena();
            let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ (i >> 16) as u8).collect();
            let mut s = Stuttering { data: &data, steps, reads: 0, stop_every, stopped: false };
            let req = write_req(offset << 9, len);
            let mut p = Partial::Write {
                req,
                whole: Vec::new(),
                filling: None,
                by: Instant::now(),
            };
            let (_, w) = resume_until_whole(&mut p, &mut s, &b);
            let Whole::Write(got, bufs) = w else { panic!("not a write") };
            prop_assert_eq!(got.cookie, 9);
            // Chunks in order, each where the last ended, none over a chunk.
            let mut at = req.offset;
            let mut joined = Vec::new();
            for (off, buf) in &bufs {
                prop_assert_eq!(*off, at);
                prop_assert!(buf.as_ref().len() <= CHUNK_BYTES);
                at += buf.as_ref().len() as u64;
                joined.extend_from_slice(buf.as_ref());
            }
            prop_assert!(joined == data, "the payload changed on its way");
            prop_assert!(s.data.is_empty(), "a byte of the next request was taken");
            drop(bufs);
            drop(b);
            alloc.leak_check().unwrap();
        }

        #[test]
        fn a_header_and_a_discard_interrupted_anywhere_take_exactly_their_bytes(
            split in proptest::collection::vec(1usize..40, 1..5),
            left in 0u64..100_000,
        ) {
            let (_alloc, b) = arena();
            let mut data = REQUEST_MAGIC.to_be_bytes().to_vec();
            data.extend((0..REQUEST_BYTES - 4).map(|i| i as u8));
            data.extend(std::iter::repeat_n(7u8, left as usize));
            data.extend_from_slice(b"next");
            let mut s = Stuttering { data: &data, steps: split, reads: 0, stop_every: 2, stopped: false };
            let mut p = Partial::header(Instant::now());
            let (_, w) = resume_until_whole(&mut p, &mut s, &b);
            let Whole::Header(h) = w else { panic!("not a header") };
            prop_assert_eq!(&h[..], &data[..REQUEST_BYTES]);
            let mut p = Partial::Discard { req: write_req(0, left as u32), error: 22, left, by: Instant::now() };
            let (_, w) = resume_until_whole(&mut p, &mut s, &b);
            prop_assert!(matches!(w, Whole::Refused(_, 22)));
            prop_assert_eq!(s.data, &b"next"[..]);
        }
    }

    #[test]
    fn a_stream_that_ends_early_is_an_error_and_keeps_what_came() {
        let (_alloc, b) = arena();
        let data = [1u8; 10];
        let mut s = Stuttering {
            data: &data,
            steps: vec![4],
            reads: 0,
            stop_every: 0,
            stopped: false,
        };
        let mut p = Partial::header(Instant::now() + Duration::from_secs(1));
        let e = p.receive(&mut s, &b).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(matches!(p, Partial::Header { have: 10, .. }));
        assert_eq!(p.held_bytes(), None);
        let w = Partial::Write {
            req: write_req(0, 4096),
            whole: Vec::new(),
            filling: None,
            by: Instant::now(),
        };
        assert_eq!(w.held_bytes(), Some(4096));
    }
}
