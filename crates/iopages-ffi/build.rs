//! Generates include/iopages.h with cbindgen: always into OUT_DIR (the test
//! `the_checked_in_header_is_the_generated_one` compares it with the
//! checked-in copy), and into include/iopages.h when
//! IOPAGES_UPDATE_HEADER=1.

use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("iopages.h");
    println!("cargo:rerun-if-changed=src");
    // The shared library answers to libiopages.so, the name it is
    // installed and linked under.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libiopages.so");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-env-changed=IOPAGES_UPDATE_HEADER");
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        // lib.rs and the modules it declares.
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen could not generate iopages.h");
    bindings.write_to_file(&out);
    if std::env::var("IOPAGES_UPDATE_HEADER").as_deref() == Ok("1") {
        bindings.write_to_file(dir.join("include/iopages.h"));
    }
}
