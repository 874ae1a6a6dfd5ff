"""The tracing rules (imgserve/tracing.py): when the OTEL_* variables turn tracing on, what refuses the start, the
request id a caller may give, and the trace context that travels to the workers."""

from __future__ import annotations

import pytest

from imgserve import tracing

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("environ", "exporters"),
    [
        ({}, []),  # nothing set: off
        ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, []),  # no exporter, no endpoint: off
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
    ],
)
def test_tracing_is_on_only_when_an_exporter_or_endpoint_is_named(environ: dict, exporters: list) -> None:
    assert tracing.exporters(environ) == exporters
    assert tracing.enabled(environ) == bool(exporters)


def test_what_cannot_trace_refuses_the_start_and_what_can_does_not() -> None:
    assert tracing.check({}) is None
    assert tracing.check({"OTEL_TRACES_EXPORTER": "otlp"}) is None
    assert tracing.check({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) is None
    assert "zipkin" in (tracing.check({"OTEL_TRACES_EXPORTER": "zipkin"}) or "")
    assert "http/json" in (
        tracing.check({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}) or ""
    )


@pytest.mark.parametrize("given", ["req-42", "a" * 128, "3f2a:9b/x+y=z@host_1.2"])
def test_a_safe_request_id_is_kept(given: str) -> None:
    assert tracing.request_id(given) == given


@pytest.mark.parametrize(
    "given", [None, "", "a" * 129, "two words", "x\r\nSet-Cookie: a=b", "caf\u00e9", "tab\there", "nul\x00", "<script>"]
)
def test_an_unsafe_or_missing_request_id_is_replaced_by_a_new_one(given: str | None) -> None:
    made = tracing.request_id(given)
    assert made != given and len(made) == 32 and int(made, 16) >= 0
    assert tracing.request_id(given) != made  # a new one each time


def test_the_trace_context_round_trips_and_only_well_formed_ones_are_taken() -> None:
    text = tracing.carry(PARENT, "req-42")
    assert len(text) <= tracing.MAX_CARRIED
    assert tracing.carried(text) == ((0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1), "req-42")
    for bad in (
        "",
        PARENT,  # no request id
        PARENT.upper() + " req",
        "01" + PARENT[2:] + " req",  # an unknown version
        PARENT.replace("b7ad6b7169203331", "0" * 16) + " req",  # the invalid span id
        PARENT + " req\nX: y",
        PARENT + "  req",
    ):
        assert tracing.carried(bad) is None, bad
