//! The bare XTS encryption of one buffer, again and again: MB/s per
//! sample, for comparing builds of the cipher under a profiler or side by
//! side (`bench xts` is the measurement; this is a probe).
//!
//! `cargo run --release -p iopages-crypt --example xts_loop -- SECTOR_BYTES KEY_BYTES MIB SAMPLES`

use iopages_crypt::XtsCipher;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| {
            a.parse()
                .expect("numbers: SECTOR_BYTES KEY_BYTES MIB SAMPLES")
        })
        .collect();
    let [sector, key_bytes, mib, samples] = args[..] else {
        eprintln!("usage: xts_loop SECTOR_BYTES KEY_BYTES MIB SAMPLES");
        std::process::exit(2);
    };
    let key: Vec<u8> = (0..key_bytes as u8)
        .map(|i| i.wrapping_mul(29) ^ 7)
        .collect();
    let mut cipher = XtsCipher::new(&key, sector, 0).expect("a valid key and sector size");
    let src: Vec<u8> = (0..1 << 20).map(|i| (i * 131 % 251) as u8).collect();
    let mut dst = vec![0u8; 1 << 20];
    let mut rates = Vec::with_capacity(samples);
    for _ in 0..samples {
        let start = Instant::now();
        for i in 0..mib {
            cipher
                .encrypt_sectors((i * (1 << 20) / sector) as u64, &src, &mut dst)
                .expect("whole sectors");
            std::hint::black_box(&mut dst);
        }
        rates.push(mib as f64 * 1.048576 / start.elapsed().as_secs_f64());
    }
    rates.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "sector {sector} key {key_bytes}: median {:.0} MB/s, best {:.0}, worst {:.0}",
        rates[rates.len() / 2],
        rates[rates.len() - 1],
        rates[0]
    );
}
