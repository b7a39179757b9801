"""Frame layouts and codes of the drafter worker contract (docs/CONTRACT.md). numpy + struct only.

Both sides import this module: the torch-free client and the worker. Encoders build bytes;
decoders read from a memoryview without copying token arrays (np.frombuffer views).
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

import numpy as np

MAGIC = 0x594C5244  # b"DRLY" read as a little-endian u32
VERSION = 1
HEADER = struct.Struct("<IHHII")  # magic, version, type, length, seq
HEADER_SIZE = HEADER.size  # 16

# frame types
HELLO, HELLO_OK, STEP, STEP_REPLY, ERROR, PING, PONG, BYE = 1, 2, 3, 4, 5, 6, 7, 8
CHALLENGE, AUTH = 9, 10  # the shared-secret handshake (wire/security.py)
FRAME_NAMES = {1: "HELLO", 2: "HELLO_OK", 3: "STEP", 4: "STEP_REPLY", 5: "ERROR", 6: "PING", 7: "PONG", 8: "BYE",
               9: "CHALLENGE", 10: "AUTH", 11: "BRANCHES"}
# the speculation cache (draftrelay.speculation): a STEP with STEP_FLAG_BRANCHES and the fan-out F in its
# reserved word is answered STEP_REPLY, then a BRANCHES frame (same seq) carrying the branch table
BRANCHES = 11
STEP_FLAG_BRANCHES = 1
# the confidence stop: the payload ends with one float32 per block, the drafter probability of its own
# greedy token below which the worker stops drafting that block (the low token is still returned)
STEP_FLAG_MIN_CONF = 2
KNOWN_STEP_FLAGS = STEP_FLAG_BRANCHES | STEP_FLAG_MIN_CONF
MAX_FANOUT = 64

# per-block status codes
OK, PARTIAL = 0, 1
UNKNOWN_REQUEST, STALE_GENERATION, BAD_ENTRY, POSITION_GAP, OVER_LIMITS, DRAFTER_ERROR = 16, 17, 18, 19, 20, 21
# ERROR frame codes (OVER_LIMITS is also used for a handshake asking too much)
BAD_MAGIC, BAD_VERSION, BAD_TYPE, FRAME_TOO_LARGE, MALFORMED = 32, 33, 34, 35, 36
IDENTITY_MISMATCH, OVER_CAPACITY, SESSION_EXPIRED, FRAME_TIMEOUT, INTERNAL = 37, 38, 39, 40, 41
AUTH_REQUIRED, AUTH_FAILED = 42, 43  # no AUTH answer to the CHALLENGE / a wrong one

CODE_NAMES = {
    OK: "OK", PARTIAL: "PARTIAL", UNKNOWN_REQUEST: "UNKNOWN_REQUEST", STALE_GENERATION: "STALE_GENERATION",
    BAD_ENTRY: "BAD_ENTRY", POSITION_GAP: "POSITION_GAP", OVER_LIMITS: "OVER_LIMITS",
    DRAFTER_ERROR: "DRAFTER_ERROR", BAD_MAGIC: "BAD_MAGIC", BAD_VERSION: "BAD_VERSION", BAD_TYPE: "BAD_TYPE",
    FRAME_TOO_LARGE: "FRAME_TOO_LARGE", MALFORMED: "MALFORMED", IDENTITY_MISMATCH: "IDENTITY_MISMATCH",
    OVER_CAPACITY: "OVER_CAPACITY", SESSION_EXPIRED: "SESSION_EXPIRED", FRAME_TIMEOUT: "FRAME_TIMEOUT",
    INTERNAL: "INTERNAL", AUTH_REQUIRED: "AUTH_REQUIRED", AUTH_FAILED: "AUTH_FAILED",
}
# after these ERROR codes the worker closes the connection
CLOSING_ERRORS = frozenset({BAD_MAGIC, BAD_VERSION, FRAME_TOO_LARGE, IDENTITY_MISMATCH, OVER_CAPACITY,
                            SESSION_EXPIRED, FRAME_TIMEOUT, OVER_LIMITS, AUTH_REQUIRED, AUTH_FAILED})

FLAG_END = 1
KNOWN_BLOCK_FLAGS = FLAG_END
MAX_STR = 256

HELLO_FIXED = struct.Struct("<HHHHI")  # proto_version, max_requests, n_out_max, flags, vocab_size
HELLO_OK_FIXED = struct.Struct("<QHHHHIIII")  # session, version, max_req, n_out_max, flags, vocab, ctx, frame, idle
# HELLO_OK flags (a field that was reserved and 0: a client that does not know a bit ignores it)
# the drafter computes every draft a STEP asks whatever the confidence stop returns (static shapes, CUDA graphs,
# TP2, replay): a round asking k costs k drafts' time however few come back (engine.depth: fixed_rounds)
HELLO_OK_FIXED_ROUNDS = 1
STEP_HEAD = struct.Struct("<HHI")  # n_blocks, flags, reserved
BLOCK_HEAD = struct.Struct("<QIIIHH")  # request_id, generation, position, n_tokens, n_out, flags
REPLY_HEAD = struct.Struct("<HHIQ")  # n_blocks, reserved, worker_us, session_id
RBLOCK_HEAD = struct.Struct("<QIHH")  # request_id, generation, status, n
ERROR_HEAD = struct.Struct("<HHH")  # code, reserved, msg_len


class FrameError(ValueError):
    """A payload that does not parse; `code` is the ERROR code to answer with."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def code_name(code: int) -> str:
    return CODE_NAMES.get(code, f"code {code}")


def header(ftype: int, length: int, seq: int, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, ftype, length, seq & 0xFFFFFFFF)


def frame(ftype: int, payload: bytes | bytearray, seq: int) -> bytes:
    return header(ftype, len(payload), seq) + bytes(payload)


def check_header(buf, max_frame: int) -> tuple[int, int, int, int]:
    """(version, type, length, seq) of a 16-byte header; FrameError on bad magic/version/size."""
    magic, version, ftype, length, seq = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FrameError(BAD_MAGIC, f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x})")
    if version != VERSION:
        raise FrameError(BAD_VERSION, f"protocol version {version} not supported (this side speaks {VERSION})")
    if length > max_frame:
        raise FrameError(FRAME_TOO_LARGE, f"frame of {length} bytes exceeds max_frame {max_frame}")
    return version, ftype, length, seq


# ---- strings ---------------------------------------------------------------------------------------


def pack_str(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > MAX_STR:
        raise ValueError(f"string of {len(b)} bytes exceeds {MAX_STR}: {s[:40]!r}...")
    return struct.pack("<H", len(b)) + b


def unpack_str(buf, off: int, what: str) -> tuple[str, int]:
    if off + 2 > len(buf):
        raise FrameError(MALFORMED, f"{what}: truncated string length")
    (n,) = struct.unpack_from("<H", buf, off)
    if n > MAX_STR or off + 2 + n > len(buf):
        raise FrameError(MALFORMED, f"{what}: string of {n} bytes does not fit (max {MAX_STR})")
    try:
        return bytes(buf[off + 2:off + 2 + n]).decode("utf-8"), off + 2 + n
    except UnicodeDecodeError:
        raise FrameError(MALFORMED, f"{what}: not valid utf-8") from None


# ---- HELLO / HELLO_OK -----------------------------------------------------------------------------------


@dataclass
class Hello:
    proto_version: int = VERSION
    max_requests: int = 4
    n_out_max: int = 8
    flags: int = 0
    vocab_size: int = 0
    model_id: str = ""
    tokenizer_hash: str = ""
    client_name: str = ""

    def encode(self) -> bytes:
        return (HELLO_FIXED.pack(self.proto_version, self.max_requests, self.n_out_max, self.flags, self.vocab_size)
                + pack_str(self.model_id) + pack_str(self.tokenizer_hash) + pack_str(self.client_name))

    @classmethod
    def decode(cls, buf) -> Hello:
        if len(buf) < HELLO_FIXED.size:
            raise FrameError(MALFORMED, f"HELLO: {len(buf)} bytes, need at least {HELLO_FIXED.size}")
        v, mr, no, fl, vs = HELLO_FIXED.unpack_from(buf, 0)
        off = HELLO_FIXED.size
        mid, off = unpack_str(buf, off, "HELLO model_id")
        th, off = unpack_str(buf, off, "HELLO tokenizer_hash")
        cn, off = unpack_str(buf, off, "HELLO client_name")
        if off != len(buf):
            raise FrameError(MALFORMED, f"HELLO: {len(buf) - off} trailing bytes")
        return cls(v, mr, no, fl, vs, mid, th, cn)


@dataclass
class HelloOk:
    session_id: int
    proto_version: int
    max_requests: int
    n_out_max: int
    vocab_size: int
    max_ctx: int
    max_frame: int
    idle_timeout_ms: int
    model_id: str
    tokenizer_hash: str
    info: str
    flags: int = 0  # HELLO_OK_* bits

    def encode(self) -> bytes:
        return (HELLO_OK_FIXED.pack(self.session_id, self.proto_version, self.max_requests, self.n_out_max,
                                    self.flags, self.vocab_size, self.max_ctx, self.max_frame, self.idle_timeout_ms)
                + pack_str(self.model_id) + pack_str(self.tokenizer_hash) + pack_str(self.info))

    @classmethod
    def decode(cls, buf) -> HelloOk:
        if len(buf) < HELLO_OK_FIXED.size:
            raise FrameError(MALFORMED, "HELLO_OK: too short")
        sid, v, mr, no, flags, vs, ctx, mf, idle = HELLO_OK_FIXED.unpack_from(buf, 0)
        off = HELLO_OK_FIXED.size
        mid, off = unpack_str(buf, off, "HELLO_OK model_id")
        th, off = unpack_str(buf, off, "HELLO_OK tokenizer_hash")
        info, off = unpack_str(buf, off, "HELLO_OK info")
        if off != len(buf):
            raise FrameError(MALFORMED, "HELLO_OK: trailing bytes")
        return cls(sid, v, mr, no, vs, ctx, mf, idle, mid, th, info, flags)


# ---- STEP -------------------------------------------------------------------------------------------


@dataclass
class Block:
    """One request's entry of a STEP. tokens: int32 array (any int array-like is converted)."""

    request_id: int
    generation: int
    position: int
    tokens: np.ndarray
    n_out: int
    flags: int = 0
    # the confidence stop (0: off): the worker ends this block's drafting after the first draft whose
    # drafter probability is below it, returning fewer than n_out drafts (status PARTIAL)
    min_conf: float = 0.0


def check_min_conf(x: float, what: str = "min_conf") -> float:
    """A confidence-stop threshold as a float in [0, 1] (0: off); ValueError naming `what` otherwise."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {x!r} is not a number") from None
    if not 0.0 <= v <= 1.0:  # also refuses NaN
        raise ValueError(f"{what} {x!r}: must be within [0, 1] (0 turns the confidence stop off)")
    return v


def encode_step(blocks, fanout: int = 0) -> bytes:
    """fanout > 0: ask for a BRANCHES table of up to `fanout` branches per request after the reply.
    A block with min_conf > 0 makes the frame carry the thresholds (STEP_FLAG_MIN_CONF); a frame
    without any is byte for byte what it was before the flag existed."""
    if not 0 <= fanout <= MAX_FANOUT:
        raise ValueError(f"fanout {fanout} outside [0, {MAX_FANOUT}]")
    confs = [check_min_conf(getattr(b, "min_conf", 0.0), f"block {i} min_conf") for i, b in enumerate(blocks)]
    stop = any(confs)
    flags = (STEP_FLAG_BRANCHES if fanout else 0) | (STEP_FLAG_MIN_CONF if stop else 0)
    parts = [STEP_HEAD.pack(len(blocks), flags, fanout)]
    for b in blocks:
        toks = np.ascontiguousarray(b.tokens, dtype="<i4")
        parts.append(BLOCK_HEAD.pack(b.request_id, b.generation, b.position, toks.size, b.n_out, b.flags))
        parts.append(toks.tobytes())
    if stop:
        parts.append(np.asarray(confs, dtype="<f4").tobytes())
    return b"".join(parts)


def decode_step(buf, max_blocks: int) -> list[Block]:
    """Blocks of a STEP payload; token arrays are views into buf (valid until buf is reused)."""
    n_payload = len(buf)
    if n_payload < STEP_HEAD.size:
        raise FrameError(MALFORMED, f"STEP: {n_payload} bytes, need at least {STEP_HEAD.size}")
    n_blocks, flags, fanout = STEP_HEAD.unpack_from(buf, 0)
    if flags & ~KNOWN_STEP_FLAGS:
        raise FrameError(MALFORMED, f"STEP: unknown frame flags 0x{flags:x}")
    if bool(flags & STEP_FLAG_BRANCHES) != (fanout != 0) or fanout > MAX_FANOUT:
        raise FrameError(MALFORMED, f"STEP: fan-out {fanout} with flags 0x{flags:x} (needs the BRANCHES flag and "
                                    f"1..{MAX_FANOUT}, or neither)")
    if not 1 <= n_blocks <= max_blocks:
        raise FrameError(MALFORMED, f"STEP: n_blocks {n_blocks} outside [1, {max_blocks}] (session max_requests)")
    off = STEP_HEAD.size
    blocks = []
    for i in range(n_blocks):
        if off + BLOCK_HEAD.size > n_payload:
            raise FrameError(MALFORMED, f"STEP: block {i} header truncated")
        rid, gen, pos, nt, n_out, fl = BLOCK_HEAD.unpack_from(buf, off)
        off += BLOCK_HEAD.size
        if off + 4 * nt > n_payload:
            raise FrameError(MALFORMED, f"STEP: block {i} declares {nt} tokens, only {(n_payload - off) // 4} fit")
        toks = np.frombuffer(buf, dtype="<i4", count=nt, offset=off)
        off += 4 * nt
        blocks.append(Block(rid, gen, pos, toks, n_out, fl))
    if flags & STEP_FLAG_MIN_CONF:
        if off + 4 * n_blocks > n_payload:
            raise FrameError(MALFORMED, f"STEP: flags 0x{flags:x} (MIN_CONF) need {n_blocks} float32 thresholds "
                                        f"after the blocks, {n_payload - off} bytes left")
        confs = np.frombuffer(buf, dtype="<f4", count=n_blocks, offset=off)
        off += 4 * n_blocks
        for i, (b, c) in enumerate(zip(blocks, confs.tolist(), strict=True)):
            if not 0.0 <= c <= 1.0:
                raise FrameError(MALFORMED, f"STEP: block {i} min_conf {c!r} outside [0, 1]")
            b.min_conf = c
    if off != n_payload:
        raise FrameError(MALFORMED, f"STEP: {n_payload - off} trailing bytes after {n_blocks} blocks")
    return blocks


def step_fanout(buf) -> int:
    """The branch fan-out a (decoded, valid) STEP payload asks for; 0 for a plain STEP."""
    _, flags, fanout = STEP_HEAD.unpack_from(buf, 0)
    return fanout if flags & STEP_FLAG_BRANCHES else 0


def encode_step_reply(session_id: int, worker_us: int, request_ids, generations, status, counts,
                      drafts: np.ndarray, confidences: np.ndarray) -> bytes:
    """drafts/confidences: [B, >= max(counts)] arrays; row i contributes its first counts[i] entries."""
    B = len(request_ids)
    parts = [REPLY_HEAD.pack(B, 0, min(int(worker_us), 0xFFFFFFFF), session_id)]
    for i in range(B):
        n = int(counts[i])
        parts.append(RBLOCK_HEAD.pack(int(request_ids[i]), int(generations[i]), int(status[i]), n))
        if n:
            parts.append(np.ascontiguousarray(drafts[i, :n], dtype="<i4").tobytes())
            parts.append(np.ascontiguousarray(confidences[i, :n], dtype="<f4").tobytes())
    return b"".join(parts)


def encode_error(code: int, message: str) -> bytes:
    msg = message.encode("utf-8")[:1024]
    return ERROR_HEAD.pack(code, 0, len(msg)) + msg


def decode_error(buf) -> tuple[int, str]:
    if len(buf) < ERROR_HEAD.size:
        raise FrameError(MALFORMED, "ERROR: too short")
    code, _, n = ERROR_HEAD.unpack_from(buf, 0)
    if ERROR_HEAD.size + n != len(buf):
        raise FrameError(MALFORMED, "ERROR: message length mismatch")
    return code, bytes(buf[ERROR_HEAD.size:]).decode("utf-8", "replace")


def tokenizer_hash_of_dir(path: str) -> str:
    """sha256 (first 16 hex digits) of a model directory's tokenizer.json, '' if it has none."""
    fn = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(fn):
        return ""
    h = hashlib.sha256()
    with open(fn, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]
