"""Property tests of the wire format: what is encoded decodes to itself, and no byte string breaks the parser."""
from __future__ import annotations

import hashlib
import math
import struct

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from relay.protocol import (DTYPES, HEADER_LEN, MAX_PAYLOAD, RELAY, ErrorCode, Frame, FrameDecoder, FrameType,
                            ProtocolError, auth_mac, decode_control, decode_error, decode_hello, decode_tensor,
                            decode_tokens, encode_control, encode_error, encode_frame, encode_header, encode_hello,
                            encode_tensor, encode_tokens, fingerprint_of_der, normalize_fingerprint, session_id)

pytestmark = pytest.mark.timeout(300)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

frames = st.builds(Frame, type=st.sampled_from(FrameType), src=st.integers(0, 255), dst=st.integers(0, 255),
                   round_id=st.integers(0, 2 ** 64 - 1), flags=st.integers(0, 2 ** 16 - 1),
                   payload=st.binary(max_size=3000), session=st.integers(0, 2 ** 64 - 1))
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 53, 2 ** 53) | st.text(max_size=20)
                           | st.floats(allow_nan=False, allow_infinity=False),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)
metas = st.dictionaries(st.text(max_size=10), json_values, max_size=5)


def chunked(data: bytes, cuts: list) -> list:
    points = sorted({c % (len(data) + 1) for c in cuts})
    bounds = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


@SETTINGS
@given(st.lists(frames, max_size=6), st.lists(st.integers(0, 10 ** 6), max_size=12))
def test_frames_round_trip_in_any_chunking(fs, cuts):
    stream = b"".join(encode_frame(f) for f in fs)
    assert len(stream) == sum(HEADER_LEN + len(f.payload) for f in fs)
    decoder = FrameDecoder()
    out = []
    for chunk in chunked(stream, cuts):
        out += decoder.feed(chunk)
    assert out == fs


@SETTINGS
@given(st.binary(max_size=4000), st.lists(st.integers(0, 10 ** 6), max_size=12), st.integers(0, 5000))
def test_decoder_on_arbitrary_bytes_yields_frames_or_protocol_error(data, cuts, limit):
    decoder = FrameDecoder(max_payload=limit)
    try:
        for chunk in chunked(data, cuts):
            for f in decoder.feed(chunk):
                assert isinstance(f, Frame) and len(f.payload) <= limit
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)


@SETTINGS
@given(frames, st.binary(min_size=1, max_size=64))
def test_garbage_after_valid_frames_is_caught(frame, junk):
    assume(not junk.startswith(b"KT"[:len(junk)]))
    decoder = FrameDecoder()
    assert decoder.feed(encode_frame(frame)) == [frame]
    try:
        assert decoder.feed(junk) == []  # at most a partial header is buffered
        assert len(junk) < HEADER_LEN
    except ProtocolError as e:
        assert e.code == ErrorCode.BAD_MAGIC


def test_header_errors_have_codes():
    good = encode_header(FrameType.TENSOR, 0, 1, 2, 3, 4, 5)
    cases = {ErrorCode.BAD_MAGIC: b"XX" + good[2:], ErrorCode.BAD_VERSION: good[:2] + b"\x09" + good[3:],
             ErrorCode.BAD_TYPE: good[:3] + b"\xee" + good[4:],
             ErrorCode.TOO_LARGE: encode_header(FrameType.TENSOR, 0, 1, 2, 3, 4, MAX_PAYLOAD + 1)}
    for code, head in cases.items():
        with pytest.raises(ProtocolError) as e:
            FrameDecoder().feed(head)
        assert e.value.code == code
    with pytest.raises(ProtocolError) as e:
        FrameDecoder(max_payload=4).feed(good)
    assert e.value.code == ErrorCode.TOO_LARGE
    with pytest.raises(ValueError):
        encode_header(FrameType.TENSOR, 256, 0, 0, 0, 0, 0)


shapes = st.lists(st.integers(0, 6), max_size=4).map(tuple)


@SETTINGS
@given(metas, st.sampled_from(sorted(DTYPES)), shapes, st.randoms(use_true_random=False))
def test_tensor_payload_round_trip(meta, dtype, shape, rnd):
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    data = bytes(rnd.getrandbits(8) for _ in range(nbytes))
    payload = encode_tensor(meta, dtype, shape, data)
    meta2, dtype2, shape2, view = decode_tensor(payload)
    assert (meta2, dtype2, shape2, bytes(view)) == (meta, dtype, shape, data)
    assert (len(payload) - len(view)) % 8 == 0  # data starts 8-byte aligned
    with pytest.raises(ProtocolError):
        decode_tensor(payload + b"\0")
    if nbytes:
        with pytest.raises(ProtocolError):
            decode_tensor(payload[:-1])


def test_tensor_zero_copy_into_torch():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float16).reshape(3, 4)
    frame = FrameDecoder().feed(encode_frame(Frame(FrameType.TENSOR, 0, 1, payload=encode_tensor(
        {"r": 1}, "float16", tuple(t.shape), t.numpy().tobytes()))))[0]
    _, dtype, shape, view = decode_tensor(frame.payload)
    back = torch.frombuffer(view, dtype=getattr(torch, dtype)).reshape(shape)  # writable buffer: no warning
    assert torch.equal(back, t)


def test_tensor_encoder_rejects_mismatches():
    with pytest.raises(ValueError):
        encode_tensor({}, "float16", (2, 2), bytes(7))
    with pytest.raises(ValueError):
        encode_tensor({}, "complex32", (1,), bytes(4))
    with pytest.raises(ValueError):
        encode_tensor([], "uint8", (1,), b"x")


@SETTINGS
@given(st.lists(st.integers(0, 2 ** 32 - 1), max_size=50), metas)
def test_tokens_payload_round_trip(ids, meta):
    payload = encode_tokens(ids, meta)
    assert decode_tokens(payload) == (ids, meta)
    with pytest.raises(ProtocolError):
        decode_tokens(payload[:-1])


@SETTINGS
@given(metas)
def test_control_and_error_round_trip(obj):
    assert decode_control(encode_control(obj)) == obj
    err = decode_error(encode_error(ErrorCode.STAGE_UNAVAILABLE, "gone", stage=3))
    assert (err["code"], err["error"], err["stage"]) == (11, "stage_unavailable", 3)


@SETTINGS
@given(st.binary(max_size=300))
def test_payload_decoders_on_arbitrary_bytes(data):
    for decode in (decode_tensor, decode_tokens, decode_control, decode_error, decode_hello):
        try:
            decode(data)
        except ProtocolError:
            pass


@SETTINGS
@given(st.text(min_size=1, max_size=40), st.integers(1, 255), st.binary(min_size=32, max_size=32))
def test_hello_round_trip(name, stages, nonce):
    assume(len(name.encode()) <= 128)
    assert decode_hello(encode_hello(name, stages, nonce)) == (name, stages, nonce)


def test_auth_mac_binds_every_field():
    base = dict(token=b"t", role="node", client_nonce=b"c" * 32, server_nonce=b"s" * 32, name="s", stage=0, stages=2)
    mac = auth_mac(**base)
    for field, other in (("token", b"u"), ("role", "relay"), ("client_nonce", b"d" * 32),
                         ("server_nonce", b"r" * 32), ("name", "t"), ("stage", 1), ("stages", 3)):
        assert auth_mac(**{**base, field: other}) != mac, field
    assert len(mac) == 32


def test_session_id_and_fingerprint():
    assert session_id("kit-1234") == struct.unpack("<Q", hashlib.sha256(b"kit-1234").digest()[:8])[0]
    assert session_id("a") != session_id("b")
    fp = fingerprint_of_der(b"cert")
    assert fp.startswith("SHA256:") and len(fp) == 71 and normalize_fingerprint(fp.lower()) == fp
    assert RELAY == 255
