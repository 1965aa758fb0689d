//! The gRPC API of Custodian (`proto/custodian/v1`): filled in by the API work.

/// Generated protobuf and gRPC types.
pub mod pb {
    tonic::include_proto!("custodian.v1");
}
