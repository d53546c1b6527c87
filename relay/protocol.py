"""The kit's one wire format (docs/PROTOCOL.md), shared by the relay and the nodes.

Standard library only and Python >= 3.8: the relay VM has nothing but python3.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import secrets
import socket
import ssl
import struct
from dataclasses import dataclass, field

MAGIC = b"KT"
VERSION = 1
RELAY = 255  # the stage address of the relay itself (PING/PONG/BYE to the relay, frames the relay originates)
MAX_STAGES = 255  # stages are 0..254
MAX_PAYLOAD = 64 << 20  # hard ceiling of one frame's payload; relays may set a lower one
MAX_HANDSHAKE_PAYLOAD = 1024  # before authentication nothing bigger is read
NONCE_LEN = 32
MAC_LEN = 32
MAX_SESSION_NAME = 128  # bytes of UTF-8

# magic(2s) version(B) type(B) flags(H) src(B) dst(B) session(Q) round_id(Q) length(I), little-endian
HEADER = struct.Struct("<2sBBHBBQQI")
HEADER_LEN = HEADER.size  # 28


class FrameType(enum.IntEnum):
    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    WELCOME = 4
    ERROR = 5
    PING = 6
    PONG = 7
    TENSOR = 8
    TOKENS = 9
    CONTROL = 10
    BYE = 11


class ErrorCode(enum.IntEnum):
    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_TYPE = 3
    TOO_LARGE = 4
    BAD_PAYLOAD = 5
    BAD_STATE = 6
    HANDSHAKE_TIMEOUT = 7
    AUTH_FAILED = 8
    RATE_LIMITED = 9
    BAD_ROUTE = 10
    STAGE_UNAVAILABLE = 11
    REPLACED = 12
    IDLE_TIMEOUT = 13
    SHUTTING_DOWN = 14


class ProtocolError(ConnectionError):
    """A peer broke the wire format or refused us; `code` is the ErrorCode. A ConnectionError, so that callers
    that treat any connection failure alike (provisioning checks) need no special case."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = ErrorCode(code)


class AuthError(ProtocolError):
    """The handshake was refused (wrong token, rate limit, ...) or the relay could not prove itself."""


class FingerprintMismatch(AuthError):
    """The TLS peer's certificate is not the pinned one; nothing was sent over it."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.AUTH_FAILED, message)


@dataclass(frozen=True)
class Frame:
    """One frame. Received frames carry a writable bytearray payload (zero-copy torch.frombuffer)."""
    type: FrameType
    src: int
    dst: int
    round_id: int = 0
    flags: int = 0
    payload: bytes = b""
    session: int = 0
    received: float = field(default=0.0, compare=False)  # local perf_counter when it was read; not on the wire


def encode_header(type: int, src: int, dst: int, round_id: int, flags: int, session: int, length: int) -> bytes:
    """The 28-byte header alone, so that big payloads can be sent without joining them to it."""
    try:
        return HEADER.pack(MAGIC, VERSION, int(type), flags, src, dst, session, round_id, length)
    except struct.error as e:
        raise ValueError(f"frame field out of range: {e}") from None


def encode_frame(frame: Frame) -> bytes:
    payload = frame.payload
    return encode_header(frame.type, frame.src, frame.dst, frame.round_id, frame.flags, frame.session,
                         len(payload)) + payload


def parse_header(buf, max_payload: int = MAX_PAYLOAD) -> tuple:
    """Validate a header; return (type, flags, src, dst, session, round_id, length)."""
    magic, version, ftype, flags, src, dst, session, round_id, length = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC, f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"protocol version {version} (this side speaks {VERSION})")
    try:
        ftype = FrameType(ftype)
    except ValueError:
        raise ProtocolError(ErrorCode.BAD_TYPE, f"unknown frame type {ftype}") from None
    if length > max_payload:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"payload of {length} bytes exceeds the limit of {max_payload}")
    return ftype, flags, src, dst, session, round_id, length


class FrameDecoder:
    """Incremental parser: feed it bytes as they come, get whole frames back.

    After a ProtocolError the stream is out of sync and must be closed.
    """

    def __init__(self, max_payload: int = MAX_PAYLOAD):
        self.max_payload = max_payload
        self._head = bytearray()
        self._fields: tuple | None = None
        self._payload = bytearray()
        self._filled = 0

    def feed(self, data: bytes) -> list[Frame]:
        frames = []
        view = memoryview(data).cast("B")
        pos, end = 0, len(view)
        while pos < end:
            if self._fields is None:
                take = min(HEADER_LEN - len(self._head), end - pos)
                self._head += view[pos:pos + take]
                pos += take
                if len(self._head) < HEADER_LEN:
                    break
                self._fields = parse_header(self._head, self.max_payload)
                self._head = bytearray()
                self._payload = bytearray(self._fields[6])
                self._filled = 0
            length = len(self._payload)
            take = min(length - self._filled, end - pos)
            self._payload[self._filled:self._filled + take] = view[pos:pos + take]
            self._filled += take
            pos += take
            if self._filled == length:
                frames.append(_frame(self._fields, self._payload))
                self._fields = None
        return frames


def _frame(fields: tuple, payload: bytearray) -> Frame:
    ftype, flags, src, dst, session, round_id, _ = fields
    return Frame(ftype, src, dst, round_id, flags, payload, session)


# --- blocking socket helpers (nodes, provisioning checks, benchmarks) -------------------------------------------

def recv_exact_into(sock, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        view = view[n:]


def read_frame(sock, max_payload: int = MAX_PAYLOAD) -> Frame:
    """Read one frame from a blocking socket; ConnectionError on EOF, ProtocolError on a bad frame."""
    head = bytearray(HEADER_LEN)
    recv_exact_into(sock, memoryview(head))
    fields = parse_header(head, max_payload)
    payload = bytearray(fields[6])
    recv_exact_into(sock, memoryview(payload))
    return _frame(fields, payload)


def write_frame(sock, frame: Frame) -> None:
    sock.sendall(encode_frame(frame))


# --- payloads ----------------------------------------------------------------------------------------------------

DTYPES = {  # name: (code, itemsize)
    "float16": (1, 2), "bfloat16": (2, 2), "float32": (3, 4), "float64": (4, 8),
    "int8": (5, 1), "uint8": (6, 1), "int16": (7, 2), "int32": (8, 4), "int64": (9, 8), "bool": (10, 1),
    "float8_e4m3fn": (11, 1), "float8_e5m2": (12, 1),
}
_DTYPE_BY_CODE = {code: (name, size) for name, (code, size) in DTYPES.items()}
MAX_NDIM = 8
_TENSOR_HEAD = struct.Struct("<BBI")  # dtype code, ndim, meta length
_TOKENS_HEAD = struct.Struct("<II")  # count, meta length


def _json(obj: dict) -> bytes:
    if not isinstance(obj, dict):
        raise ValueError(f"expected a dict, got {type(obj).__name__}")
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _unjson(data) -> dict:
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, f"bad JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _align8(n: int) -> int:
    return (n + 7) & ~7


def encode_tensor(meta: dict, dtype: str, shape: tuple, data) -> bytes:
    """dtype code, ndim, meta length, dims (u32 each), meta JSON, zero padding to 8, raw little-endian data."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    code, itemsize = DTYPES[dtype]
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_NDIM or any(d < 0 or d >= 1 << 32 for d in shape):
        raise ValueError(f"bad shape {shape}: at most {MAX_NDIM} dims of 0..2^32-1")
    view = memoryview(data).cast("B")
    if len(view) != math.prod(shape) * itemsize:
        raise ValueError(f"{len(view)} bytes do not hold a {dtype} tensor of shape {shape}")
    meta_b = _json(meta)
    head = _TENSOR_HEAD.pack(code, len(shape), len(meta_b)) + struct.pack(f"<{len(shape)}I", *shape) + meta_b
    return b"".join((head, bytes(_align8(len(head)) - len(head)), view))


def decode_tensor(payload) -> tuple:
    """Return (meta, dtype, shape, data) where data is a memoryview into `payload` (no copy)."""
    view = memoryview(payload).cast("B")
    if len(view) < _TENSOR_HEAD.size:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, "tensor payload shorter than its header")
    code, ndim, meta_len = _TENSOR_HEAD.unpack_from(view)
    if code not in _DTYPE_BY_CODE:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, f"unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, f"tensor of {ndim} dims (max {MAX_NDIM})")
    dtype, itemsize = _DTYPE_BY_CODE[code]
    dims_end = _TENSOR_HEAD.size + 4 * ndim
    meta_end = dims_end + meta_len
    if meta_end > len(view):
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, "tensor header runs past the payload")
    shape = struct.unpack_from(f"<{ndim}I", view, _TENSOR_HEAD.size)
    start = _align8(meta_end)
    if len(view) - start != math.prod(shape) * itemsize:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD,
                            f"tensor data of {len(view) - start} bytes does not match {dtype} shape {shape}")
    return _unjson(view[dims_end:meta_end]), dtype, shape, view[start:]


def encode_tokens(ids: list, meta: dict) -> bytes:
    """count, meta length, ids (u32 each), meta JSON."""
    meta_b = _json(meta)
    try:
        ids_b = struct.pack(f"<{len(ids)}I", *ids)
    except struct.error:
        raise ValueError("token ids must be integers in 0..2^32-1") from None
    return _TOKENS_HEAD.pack(len(ids), len(meta_b)) + ids_b + meta_b


def decode_tokens(payload) -> tuple:
    view = memoryview(payload).cast("B")
    if len(view) < _TOKENS_HEAD.size:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, "tokens payload shorter than its header")
    count, meta_len = _TOKENS_HEAD.unpack_from(view)
    ids_end = _TOKENS_HEAD.size + 4 * count
    if ids_end + meta_len != len(view):
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, f"tokens payload of {len(view)} bytes does not hold "
                                                   f"{count} ids and {meta_len} bytes of meta")
    ids = list(struct.unpack_from(f"<{count}I", view, _TOKENS_HEAD.size))
    return ids, _unjson(view[ids_end:])


def encode_control(obj: dict) -> bytes:
    return _json(obj)


def decode_control(payload) -> dict:
    return _unjson(payload)


def encode_error(code: ErrorCode, message: str, **extra) -> bytes:
    """ERROR payload: a JSON object with the numeric code, its name and a human message (+ context)."""
    code = ErrorCode(code)
    return _json({"code": int(code), "error": code.name.lower(), "message": message, **extra})


def decode_error(payload) -> dict:
    obj = _unjson(payload)
    if not isinstance(obj.get("code"), int):
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, "ERROR payload without an integer code")
    return obj


# --- handshake -----------------------------------------------------------------------------------------------------

def session_id(name: str) -> int:
    """The 64-bit id of a session name that travels in every header: the first 8 bytes of its SHA-256."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "little")


def encode_hello(name: str, stages: int, nonce: bytes) -> bytes:
    """stages (u8), client nonce (32 bytes), session name (UTF-8, 1..128 bytes)."""
    name_b = name.encode("utf-8")
    if not 1 <= len(name_b) <= MAX_SESSION_NAME:
        raise ValueError(f"session name must be 1..{MAX_SESSION_NAME} bytes of UTF-8")
    if not 1 <= stages <= MAX_STAGES:
        raise ValueError(f"stages must be 1..{MAX_STAGES}")
    if len(nonce) != NONCE_LEN:
        raise ValueError(f"nonce must be {NONCE_LEN} bytes")
    return bytes([stages]) + nonce + name_b


def decode_hello(payload) -> tuple:
    """Return (name, stages, client nonce)."""
    data = bytes(payload)
    if not NONCE_LEN + 2 <= len(data) <= NONCE_LEN + 1 + MAX_SESSION_NAME:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, f"HELLO payload of {len(data)} bytes")
    try:
        name = data[1 + NONCE_LEN:].decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, "session name is not UTF-8") from None
    if data[0] == 0:
        raise ProtocolError(ErrorCode.BAD_PAYLOAD, "HELLO announces 0 stages")
    return name, data[0], data[1:1 + NONCE_LEN]


def auth_mac(token: bytes, role: str, client_nonce: bytes, server_nonce: bytes, name: str, stage: int,
             stages: int) -> bytes:
    """HMAC-SHA256 proof of the token bound to both nonces, the role ("node" or "relay") and the claimed place."""
    msg = (b"kit-auth-v1\x00" + role.encode() + b"\x00" + client_nonce + server_nonce
           + struct.pack("<QBB", session_id(name), stage, stages) + name.encode("utf-8"))
    return hmac.new(token, msg, hashlib.sha256).digest()


def clean_token(token) -> bytes:
    """Tokens come from files and secrets stores: surrounding whitespace is never part of them."""
    token = token.encode("utf-8") if isinstance(token, str) else bytes(token)
    token = token.strip()
    if not token:
        raise ValueError("the session token is empty")
    return token


def _expect(sock, wanted: FrameType) -> Frame:
    frame = read_frame(sock, MAX_HANDSHAKE_PAYLOAD)
    if frame.type == FrameType.ERROR:
        try:
            err = decode_error(frame.payload)
            code = ErrorCode(err["code"])
        except (ValueError, ProtocolError):
            raise AuthError(ErrorCode.BAD_PAYLOAD, "relay refused with an unreadable ERROR frame") from None
        raise AuthError(code, f"relay refused ({code.name.lower()}): {err.get('message', '')}")
    if frame.type != wanted:
        raise AuthError(ErrorCode.BAD_STATE, f"expected {wanted.name} from the relay, got {frame.type.name}")
    return frame


def client_handshake(sock, session: str, stage: int, stages: int, token) -> dict:
    """Authenticate on a connected blocking socket (plain or TLS); return the relay's WELCOME parameters.

    Raises AuthError when refused or when the relay cannot prove it holds the token too; the token never
    crosses the wire. Uses the socket's own timeout.
    """
    token = clean_token(token)
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not in 0..{stages - 1}")
    sid = session_id(session)
    client_nonce = secrets.token_bytes(NONCE_LEN)
    write_frame(sock, Frame(FrameType.HELLO, stage, RELAY, session=sid,
                            payload=encode_hello(session, stages, client_nonce)))
    challenge = _expect(sock, FrameType.CHALLENGE)
    if len(challenge.payload) != NONCE_LEN:
        raise AuthError(ErrorCode.BAD_PAYLOAD, "CHALLENGE without a 32-byte nonce")
    server_nonce = bytes(challenge.payload)
    mac = auth_mac(token, "node", client_nonce, server_nonce, session, stage, stages)
    write_frame(sock, Frame(FrameType.AUTH, stage, RELAY, session=sid, payload=mac))
    welcome = _expect(sock, FrameType.WELCOME)
    proof = bytes(welcome.payload[:MAC_LEN])
    if not hmac.compare_digest(proof, auth_mac(token, "relay", client_nonce, server_nonce, session, stage, stages)):
        raise AuthError(ErrorCode.AUTH_FAILED, "the relay could not prove it holds the session token")
    return decode_control(welcome.payload[MAC_LEN:])


# --- TLS with a pinned certificate ---------------------------------------------------------------------------------

def fingerprint_of_der(der: bytes) -> str:
    """Canonical form: "SHA256:" + 64 uppercase hex digits, no colons."""
    return "SHA256:" + hashlib.sha256(der).hexdigest().upper()


def normalize_fingerprint(s: str) -> str:
    """Accept SHA256:AB:CD.., ab:cd.., ABCD.., or openssl's "sha256 Fingerprint=AB:.."; return the canonical form."""
    text = s.strip()
    low = text.lower()
    for prefix in ("sha256 fingerprint=", "sha256:"):
        if low.startswith(prefix):
            text = text[len(prefix):]
            break
    hexed = text.replace(":", "").replace(" ", "").upper()
    if len(hexed) != 64 or any(c not in "0123456789ABCDEF" for c in hexed):
        raise ValueError(f"not a SHA-256 certificate fingerprint (64 hex digits): {s!r}")
    return "SHA256:" + hexed


def fingerprint_pretty(fp: str) -> str:
    """The canonical fingerprint with colons between byte pairs, for people."""
    hexed = normalize_fingerprint(fp)[7:]
    return "SHA256:" + ":".join(hexed[i:i + 2] for i in range(0, 64, 2))


def pinned_tls_wrap(sock: socket.socket, fingerprint: str) -> ssl.SSLSocket:
    """TLS without CA checks; the peer certificate must hash to `fingerprint`, else nothing is sent and
    FingerprintMismatch is raised (the socket is closed)."""
    want = normalize_fingerprint(fingerprint)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    tls = ctx.wrap_socket(sock)
    der = tls.getpeercert(binary_form=True)
    got = fingerprint_of_der(der) if der else "none"
    if not hmac.compare_digest(got, want):
        tls.close()
        raise FingerprintMismatch(f"relay certificate {fingerprint_pretty(got) if der else 'missing'} is not the "
                                  f"pinned {fingerprint_pretty(want)}; refusing to talk to it")
    return tls
