//! Compiles the gRPC API (`proto/custodian/v1`) with the vendored protoc: nothing is downloaded.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto");
    // SAFETY of intent: build scripts run single-threaded; the variable only tells
    // tonic-prost-build where the vendored protoc binary is.
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // `set_var` is safe in edition 2021.
    std::env::set_var("PROTOC", protoc);
    // The encoded descriptors, for server reflection (grpcurl without -proto).
    let descriptors = std::path::PathBuf::from(std::env::var("OUT_DIR")?).join("custodian_descriptor.bin");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .file_descriptor_set_path(descriptors)
        .compile_protos(&["../proto/custodian/v1/custodian.proto"], &["../proto"])?;
    Ok(())
}
