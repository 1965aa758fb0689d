//! The standard probes beside the custodian services: `grpc.health.v1` (what grpc_health_probe
//! and Kubernetes call) and server reflection (what grpcurl uses without the .proto files).

use std::time::Duration;

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::ServerReflectionRequest;

use crate::support::Api;

#[tokio::test]
async fn grpc_health_v1_answers_for_the_server_and_each_service() {
    let api = Api::start().await;
    let mut health = HealthClient::new(api.channel.clone());
    for service in ["", "custodian.v1.Accounts", "custodian.v1.Withdrawals", "custodian.v1.Audit"] {
        let status = custodian_testkit::eventually("a serving answer", Duration::from_secs(10), || {
            let mut health = health.clone();
            async move {
                let answer = health.check(HealthCheckRequest { service: service.to_owned() }).await.ok()?;
                (answer.into_inner().status == ServingStatus::Serving as i32).then_some(())
            }
        })
        .await;
        assert_eq!(status, (), "{service:?}");
    }
    let unknown = health.check(HealthCheckRequest { service: "no.such.Service".into() }).await;
    assert_eq!(unknown.expect_err("an unknown service").code(), tonic::Code::NotFound);
}

#[tokio::test]
async fn reflection_lists_every_service_without_the_proto_files() {
    let api = Api::start().await;
    let mut reflection = ServerReflectionClient::new(api.channel.clone());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection.server_reflection_info(tokio_stream::iter([request])).await.unwrap().into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("not a service list: {answer:?}")
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for expected in [
        "custodian.v1.Accounts",
        "custodian.v1.Withdrawals",
        "custodian.v1.Audit",
        "custodian.v1.Admin",
        "custodian.v1.Health",
        "grpc.health.v1.Health",
    ] {
        assert!(names.iter().any(|n| n == expected), "{expected} in {names:?}");
    }
    // and a service's definition can be fetched by name, which is what grpcurl does next
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::FileContainingSymbol("custodian.v1.Withdrawals".into())),
    };
    let mut answers = reflection.server_reflection_info(tokio_stream::iter([request])).await.unwrap().into_inner();
    let answer = answers.message().await.unwrap().expect("one answer");
    assert!(
        matches!(answer.message_response, Some(MessageResponse::FileDescriptorResponse(ref files)) if !files.file_descriptor_proto.is_empty()),
        "{answer:?}"
    );
}
