"""Frame codecs of docs/CONTRACT.md and the torch-free client import."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest

from draftrelay.wire import protocol as P

CONTRACT = os.path.join(os.path.dirname(__file__), "..", "docs", "CONTRACT.md")


def test_client_import_pulls_no_torch():
    code = ("import sys; import draftrelay.wire, draftrelay.wire.client, draftrelay.wire.protocol, "
            "draftrelay.worker.process; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "print('TORCH' if bad else 'CLEAN', len(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("CLEAN"), out.stdout


def test_contract_tables_match_the_constants():
    """Every code and frame type named in CONTRACT.md has the number the code uses, and back."""
    text = open(CONTRACT).read()
    rows = re.findall(r"^\| (\d+) \| `?([A-Z_]+)`? \|", text, re.M)
    table = {name: int(num) for num, name in rows}
    for code, name in P.CODE_NAMES.items():
        assert table.get(name) == code, name
    for t, name in P.FRAME_NAMES.items():
        assert table.get(name) == t, name
    assert f"`0x{P.MAGIC:08X}`" in text and P.HEADER_SIZE == 16
    assert P.BLOCK_HEAD.size == 24 and P.RBLOCK_HEAD.size == 16 and P.REPLY_HEAD.size == 16


def test_header_checks():
    h = P.header(P.STEP, 100, 7)
    assert P.check_header(h, 1000) == (1, P.STEP, 100, 7)
    with pytest.raises(P.FrameError) as e:
        P.check_header(b"XXXX" + h[4:], 1000)
    assert e.value.code == P.BAD_MAGIC
    with pytest.raises(P.FrameError) as e:
        P.check_header(P.header(P.STEP, 10, 1, version=2), 1000)
    assert e.value.code == P.BAD_VERSION
    with pytest.raises(P.FrameError) as e:
        P.check_header(h, 99)
    assert e.value.code == P.FRAME_TOO_LARGE


def test_hello_ok_carries_its_flags_where_the_reserved_field_was():
    """The fifth fixed field was reserved and 0: a worker that sets no flag encodes what it did before, and
    a worker that draws every asked draft says so (HELLO_OK_FIXED_ROUNDS)."""
    plain = P.HelloOk(123, 1, 4, 8, 32000, 4096, 1 << 20, 60000, "m", "t", "info")
    fixed = P.HelloOk(123, 1, 4, 8, 32000, 4096, 1 << 20, 60000, "m", "t", "info", P.HELLO_OK_FIXED_ROUNDS)
    assert plain.flags == 0 and P.HelloOk.decode(plain.encode()).flags == 0
    assert P.HelloOk.decode(fixed.encode()) == fixed
    assert P.HELLO_OK_FIXED.unpack_from(fixed.encode(), 0)[4] == P.HELLO_OK_FIXED_ROUNDS
    # the rest of the frame is byte for byte the same
    a, b = plain.encode(), fixed.encode()
    assert a[:14] == b[:14] and a[16:] == b[16:] and a[14:16] == b"\x00\x00"


def test_hello_roundtrip_and_errors():
    h = P.Hello(1, 4, 5, 0, 32000, "model-x", "abc123", "proxy-ü")
    assert P.Hello.decode(h.encode()) == h
    ok = P.HelloOk(123, 1, 4, 8, 32000, 4096, 1 << 20, 60000, "m", "t", "info")
    assert P.HelloOk.decode(ok.encode()) == ok
    enc = h.encode()
    for bad in (enc[:5], enc[:-1], enc + b"x"):
        with pytest.raises(P.FrameError) as e:
            P.Hello.decode(bad)
        assert e.value.code == P.MALFORMED
    bad_utf8 = enc[:P.HELLO_FIXED.size] + struct.pack("<H", 2) + b"\xff\xfe" + enc[P.HELLO_FIXED.size + 9:]
    with pytest.raises(P.FrameError, match="utf-8|fit|trailing"):
        P.Hello.decode(bad_utf8)
    with pytest.raises(ValueError, match="exceeds"):
        P.pack_str("x" * 300)


def test_step_roundtrip_views_and_errors():
    blocks = [P.Block(2**63 + 5, 3, 100, np.array([1, 2, 3], np.int32), 4, P.FLAG_END),
              P.Block(7, 0, 0, np.arange(50), 0)]
    buf = bytearray(P.encode_step(blocks))
    out = P.decode_step(memoryview(buf), 4)
    assert [(b.request_id, b.generation, b.position, b.n_out, b.flags) for b in out] == \
        [(2**63 + 5, 3, 100, 4, 1), (7, 0, 0, 0, 0)]
    assert out[0].tokens.tolist() == [1, 2, 3] and out[1].tokens.tolist() == list(range(50))
    buf[P.STEP_HEAD.size + P.BLOCK_HEAD.size] = 9  # tokens are views into the receive buffer (no copy)
    assert out[0].tokens[0] == 9
    enc = P.encode_step(blocks)
    for bad, why in [(enc[:4], "at least"), (enc[:-4], "fit"), (enc + b"\0\0\0\0", "trailing"),
                     (P.STEP_HEAD.pack(0, 0, 0), "n_blocks"), (P.STEP_HEAD.pack(5, 0, 0) + enc[8:], "n_blocks"),
                     (P.STEP_HEAD.pack(2, 1, 0) + enc[8:], "flags"), (enc[:8] + enc[8:20], "truncated")]:
        with pytest.raises(P.FrameError, match=why) as e:
            P.decode_step(bad, 4)
        assert e.value.code == P.MALFORMED


def test_reply_and_error_codecs():
    d = np.array([[1, 2, 3], [0, 0, 0]], np.int32)
    c = np.array([[0.5, 0.25, 1.0], [0, 0, 0]], np.float32)
    enc = P.encode_step_reply(99, 1234, [5, 6], [1, 2], [P.OK, P.STALE_GENERATION], [3, 0], d, c)
    n, _, us, sid = P.REPLY_HEAD.unpack_from(enc, 0)
    assert (n, us, sid) == (2, 1234, 99)
    assert len(enc) == 16 + 16 + 24 + 16
    assert P.decode_error(P.encode_error(P.MALFORMED, "bad thing")) == (P.MALFORMED, "bad thing")
    with pytest.raises(P.FrameError):
        P.decode_error(P.encode_error(1, "abc")[:-1])
