"""Domain errors raised in a handler end the call with their status code and a one-line message
(gradps.errors.StatusInterceptor, installed by make_server), for unary and streaming calls."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from gradps.channel import bind, make_server, open_channel
from gradps.errors import Ended, GradpsError, Invalid, NotFound, TooLarge

_SERVICE = "test.Errors"


def _handlers() -> grpc.GenericRpcHandler:
    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        if request == b"ok":
            return b"fine"
        raise Invalid("bad\nrequest:   spread over lines")

    def streaming(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield b"first"
        raise Ended("run 'r' ended")

    def client_streaming(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        if sum(1 for _ in requests) > 2:
            raise TooLarge("more than 2 messages")
        raise NotFound("unknown run 'x'")

    def crashing(request: bytes, context: grpc.ServicerContext) -> bytes:
        raise RuntimeError("not a domain error")

    return grpc.method_handlers_generic_handler(
        _SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Streaming": grpc.unary_stream_rpc_method_handler(streaming),
            "ClientStreaming": grpc.stream_unary_rpc_method_handler(client_streaming),
            "Crashing": grpc.unary_unary_rpc_method_handler(crashing),
        },
    )


@pytest.fixture
def channel() -> Iterator[grpc.Channel]:
    server = make_server(max_workers=4)
    server.add_generic_rpc_handlers((_handlers(),))
    port = bind(server, 0)
    server.start()
    try:
        with open_channel(f"127.0.0.1:{port}") as ch:
            yield ch
    finally:
        server.stop(None)


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_unary_errors_get_their_code_and_one_line(channel):
    unary = channel.unary_unary(f"/{_SERVICE}/Unary")
    assert unary(b"ok", timeout=5) == b"fine"
    assert _status(lambda: unary(b"no", timeout=5)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "bad request: spread over lines",
    )


def test_a_stream_that_fails_midway_ends_with_the_errors_code(channel):
    streaming = channel.unary_stream(f"/{_SERVICE}/Streaming")
    received = []
    code, details = _status(lambda: received.extend(streaming(b"", timeout=5)))
    assert received == [b"first"] and (code, details) == (grpc.StatusCode.FAILED_PRECONDITION, "run 'r' ended")


def test_client_streaming_errors(channel):
    call = channel.stream_unary(f"/{_SERVICE}/ClientStreaming")
    assert _status(lambda: call(iter([b"a"]), timeout=5)) == (grpc.StatusCode.NOT_FOUND, "unknown run 'x'")
    assert _status(lambda: call(iter([b"a"] * 3), timeout=5))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_other_exceptions_are_not_dressed_up_as_refusals(channel):
    code, _ = _status(lambda: channel.unary_unary(f"/{_SERVICE}/Crashing")(b"", timeout=5))
    assert code == grpc.StatusCode.UNKNOWN


def test_every_domain_error_names_a_real_status_code():
    import gradps.errors as errors

    kinds = [
        v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, GradpsError) and v is not GradpsError
    ]
    assert len(kinds) >= 10
    assert all(k.code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN) for k in kinds)
