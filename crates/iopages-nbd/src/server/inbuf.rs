//! A connection's read buffer, kept by the thread that serves it:
//! [`InBuf`].
//!
//! Owns: buffering the stream's reads as `std::io::BufReader` does (a read
//! at least as large as the buffer, with nothing buffered, bypasses it),
//! over a buffer the serving thread keeps between connections. A parked
//! connection holds no buffer (it parks only with nothing buffered), so
//! each stretch of service takes one: a new `BufReader` every time cost a
//! 64 KiB allocation and, at its first read, a 64 KiB `memset` (the
//! standard reader initialises its buffer before reading into it) — per
//! request once busy connections park between their requests. Must never:
//! hand out bytes past what the stream read into the buffer this stretch
//! (a reused buffer holds an earlier connection's bytes beyond them).

use std::cell::Cell;
use std::io::{self, BufRead, Read};

thread_local! {
    /// The buffer this thread used last, free for its next stretch.
    static SPARE: Cell<Option<Box<[u8]>>> = const { Cell::new(None) };
}

/// `inner` read through a buffer of the serving thread's.
pub(crate) struct InBuf<R> {
    buf: Box<[u8]>,
    /// The buffered bytes are `buf[pos..filled]`.
    pos: usize,
    filled: usize,
    inner: R,
}

impl<R: Read> InBuf<R> {
    /// Read `inner` through a buffer of `capacity` bytes: the thread's
    /// spare one if it has one that size, else a new one (zeroed by the
    /// allocator, once).
    pub(crate) fn new(capacity: usize, inner: R) -> InBuf<R> {
        let buf = SPARE
            .take()
            .filter(|b| b.len() == capacity)
            .unwrap_or_else(|| vec![0u8; capacity].into_boxed_slice());
        InBuf {
            buf,
            pos: 0,
            filled: 0,
            inner,
        }
    }

    /// The bytes read from the stream and not consumed yet.
    pub(crate) fn buffer(&self) -> &[u8] {
        &self.buf[self.pos..self.filled]
    }

    /// Take the bytes read and not consumed yet (the buffer is empty
    /// after), to be put back by [`InBuf::put_back`] in a later one.
    pub(crate) fn take_buffered(&mut self) -> Vec<u8> {
        let v = self.buffer().to_vec();
        self.pos = self.filled;
        v
    }

    /// Put `bytes` (at most the capacity; taken from an earlier buffer of
    /// the same stream) in front of whatever is read next.
    ///
    /// **Panics:** if bytes are still buffered, or `bytes` exceeds the
    /// capacity.
    pub(crate) fn put_back(&mut self, bytes: &[u8]) {
        assert!(self.buffer().is_empty(), "bytes put back behind others");
        self.buf[..bytes.len()].copy_from_slice(bytes);
        self.pos = 0;
        self.filled = bytes.len();
    }

    pub(crate) fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }
}

impl<R> Drop for InBuf<R> {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if !buf.is_empty() {
            SPARE.set(Some(buf));
        }
    }
}

impl<R: Read> Read for InBuf<R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.filled && out.len() >= self.buf.len() {
            // Nothing buffered and a large read: straight to `out`.
            return self.inner.read(out);
        }
        let n = {
            let have = self.fill_buf()?;
            let n = have.len().min(out.len());
            out[..n].copy_from_slice(&have[..n]);
            n
        };
        self.consume(n);
        Ok(n)
    }
}

impl<R: Read> BufRead for InBuf<R> {
    fn fill_buf(&mut self) -> io::Result<&[u8]> {
        if self.pos == self.filled {
            let n = self.inner.read(&mut self.buf)?;
            assert!(n <= self.buf.len(), "a read returns more than it was given");
            self.pos = 0;
            self.filled = n;
        }
        Ok(self.buffer())
    }

    fn consume(&mut self, amount: usize) {
        self.pos = (self.pos + amount).min(self.filled);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream that hands out `data` at most `step` bytes a read.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
        reads: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            self.reads += 1;
            let n = self.data.len().min(out.len()).min(self.step);
            out[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    #[test]
    fn reads_come_back_in_order_whatever_their_sizes() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for step in [1, 5, 64, 100, 4096] {
            let mut r = InBuf::new(
                64,
                Trickle {
                    data: &data,
                    step,
                    reads: 0,
                },
            );
            let mut got = Vec::new();
            let mut sizes = [3usize, 28, 64, 65, 200, 1].into_iter().cycle();
            while got.len() < data.len() {
                let want = sizes.next().unwrap().min(data.len() - got.len());
                let mut chunk = vec![0u8; want];
                r.read_exact(&mut chunk).unwrap();
                got.extend_from_slice(&chunk);
            }
            assert_eq!(got, data, "step {step}");
            assert!(r.buffer().is_empty());
        }
    }

    #[test]
    fn a_large_read_with_nothing_buffered_bypasses_the_buffer() {
        let data = vec![9u8; 256];
        let mut r = InBuf::new(
            64,
            Trickle {
                data: &data,
                step: 256,
                reads: 0,
            },
        );
        let mut out = [0u8; 128];
        assert_eq!(r.read(&mut out).unwrap(), 128);
        assert!(r.buffer().is_empty(), "nothing went through the buffer");
        assert_eq!(r.get_mut().reads, 1);
    }

    #[test]
    fn a_reused_buffer_shows_none_of_its_earlier_bytes() {
        let secret = vec![0xAAu8; 64];
        {
            let mut r = InBuf::new(
                64,
                Trickle {
                    data: &secret,
                    step: 64,
                    reads: 0,
                },
            );
            r.fill_buf().unwrap();
        }
        // The same thread's next stretch takes that buffer back.
        let mut r = InBuf::new(
            64,
            Trickle {
                data: &[1, 2, 3],
                step: 64,
                reads: 0,
            },
        );
        assert_eq!(r.fill_buf().unwrap(), &[1, 2, 3]);
        r.consume(3);
        assert_eq!(r.fill_buf().unwrap(), &[] as &[u8], "the end of the stream");
    }

    #[test]
    fn bytes_taken_and_put_back_in_a_new_buffer_are_read_first_in_order() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i % 253) as u8).collect();
        let mut r = InBuf::new(
            64,
            Trickle {
                data: &data,
                step: 50,
                reads: 0,
            },
        );
        let mut first = [0u8; 10];
        r.read_exact(&mut first).unwrap();
        let left = r.take_buffered();
        assert_eq!(left, &data[10..50], "the rest of the first read");
        assert!(r.buffer().is_empty());
        let inner = std::mem::replace(
            r.get_mut(),
            Trickle {
                data: &[],
                step: 1,
                reads: 0,
            },
        );
        drop(r);
        let mut again = InBuf::new(64, inner);
        again.put_back(&left);
        let mut rest = Vec::new();
        again.read_to_end(&mut rest).unwrap();
        assert_eq!(&rest[..], &data[10..]);
    }
}
