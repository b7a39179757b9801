"""The region: layout, header checks on open, and the round records (descriptor and reply)."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from draftrelay.handoff.region import (
    LINE,
    MAGIC,
    VERSION,
    DescriptorError,
    Layout,
    Region,
    RegionConfig,
    RegionError,
    W,
    decode_reply,
    pack_staging,
    unpack_staging,
    write_reply,
)
from draftrelay.round import RoundRequest, Status

CFG = RegionConfig(max_requests=4, max_tokens=64, max_drafts=5, vocab_size=1000)


def test_layout_words_on_own_lines_and_slots_aligned():
    L = Layout(CFG)
    offs = [L.word(w) for w in W]
    assert len(set(o // LINE for o in offs)) == len(offs)
    for s in (0, 1):
        assert L.staging(s) % LINE == 0 and L.reply(s) % LINE == 0
    assert L.staging(1) >= L.staging(0) + L.staging_size
    assert L.reply(0) >= L.staging(1) + L.staging_size
    assert L.total_size == L.reply(1) + L.reply_size


def test_create_open_share_memory():
    a = Region.create(CFG)
    try:
        b = Region.open(os.dup(a.fd))
        a.view(a.layout.word(W.GATHERED), 4).view("<u4")[0] = 42
        assert b.view(b.layout.word(W.GATHERED), 4).view("<u4")[0] == 42
        assert b.cfg == CFG
        b.close()
    finally:
        a.close()
    assert a.closed


def _foreign(payload: bytes, size: int) -> int:
    fd = os.memfd_create("foreign")
    os.ftruncate(fd, size)
    os.pwrite(fd, payload, 0)
    return fd


@pytest.mark.parametrize("case", ["magic", "version", "size", "tiny", "sizes"])
def test_open_refuses_foreign_or_corrupt_regions(case):
    size = Layout(CFG).total_size
    hdr = struct.Struct("<IIQIIII")
    fields = dict(magic=MAGIC, version=VERSION, size=size, r=4, t=64, d=5, v=1000)
    fsize = size
    if case == "magic":
        fields["magic"] = 0xDEADBEEF
    elif case == "version":
        fields["version"] = 99
    elif case == "size":
        fsize = size + 4096
    elif case == "sizes":
        fields["r"] = 0
    payload = hdr.pack(*fields.values())
    fd = _foreign(payload if case != "tiny" else b"xx", fsize if case != "tiny" else 2)
    try:
        with pytest.raises(RegionError) as info:
            Region.open(fd)
        msg = str(info.value)
        assert {"magic": "magic", "version": "version", "size": "bytes", "tiny": "too small",
                "sizes": "max_requests"}[case] in msg
    finally:
        os.close(fd)


def test_open_of_a_closed_fd_is_a_clear_error():
    with pytest.raises(RegionError, match="not open"):
        Region.open(987654)


def reqs():
    return [RoundRequest(7, 2, 100, np.array([1, 2, 3], np.int32), 4),
            RoundRequest(9, 1, 5, np.array([], np.int32), 2),
            RoundRequest(11, 3, 0, np.arange(10, dtype=np.int32), 5)]


def test_staging_roundtrip():
    L = Layout(CFG)
    buf = pack_staging(L, 12, reqs(), flags=1)
    flags, out = unpack_staging(L, buf, 12)
    assert flags == 1
    for a, b in zip(reqs(), out, strict=True):
        assert (a.req_id, a.generation, a.position, a.n_out) == (b.req_id, b.generation, b.position, b.n_out)
        assert np.array_equal(a.tokens, b.tokens)


def test_pack_refuses_what_does_not_fit():
    L = Layout(CFG)
    with pytest.raises(ValueError, match="requests"):
        pack_staging(L, 1, reqs() * 2)
    with pytest.raises(ValueError, match="tokens"):
        pack_staging(L, 1, [RoundRequest(1, 1, 0, np.zeros(65, np.int32), 1)])
    with pytest.raises(ValueError, match="n_out"):
        pack_staging(L, 1, [RoundRequest(1, 1, 0, np.zeros(1, np.int32), 6)])


@pytest.mark.parametrize("field,value,match", [
    ("round", 13, "round"), ("n_req", 99, "n_req"), ("n_tok", 10**6, "n_tok"),
    ("tok_off", 60, "beyond"), ("n_out", 50, "n_out"),
])
def test_unpack_checks_every_count(field, value, match):
    L = Layout(CFG)
    buf = pack_staging(L, 12, reqs())
    if field in ("round", "n_req", "n_tok"):
        idx = {"round": 0, "n_req": 1, "n_tok": 2}[field]
        buf[4 * idx:4 * idx + 4].view("<u4")[0] = value
    else:
        rec = buf[L.staging_req_off:L.staging_req_off + 32].view("<u4")
        rec[{"tok_off": 3, "n_out": 5}[field]] = value
    with pytest.raises(DescriptorError, match=match):
        unpack_staging(L, buf, 12)


def _reply(L: Layout, t: int, claim: int, status=Status.OK, counts=(2, 0, 5), ids=None):
    buf = np.zeros(L.reply_size, np.uint8)
    buf[:4].view("<u4")[0] = claim
    counts = np.array(counts, np.int32)
    drafts = np.arange(3 * CFG.max_drafts, dtype=np.int32).reshape(3, -1) if ids is None else ids
    write_reply(L, buf, t, status, counts, drafts, np.ones((3, CFG.max_drafts), np.float32))
    return buf


def test_decode_reply_accepts_only_the_proxys_claim_for_this_round():
    L = Layout(CFG)
    n_out = np.array([4, 2, 5], np.int32)
    ok = decode_reply(L, _reply(L, 6, 12), 6, n_out)
    assert ok.status == Status.OK and ok.counts.tolist() == [2, 0, 5]
    assert ok.drafts[0, :2].tolist() == [0, 1] and ok.drafts[0, 2:].tolist() == [0, 0, 0]
    assert decode_reply(L, _reply(L, 6, 13), 6, n_out).status == Status.WATCHDOG
    assert decode_reply(L, _reply(L, 6, 8), 6, n_out).status == Status.STALE  # round 4's claim
    assert decode_reply(L, _reply(L, 4, 12), 6, n_out).status == Status.STALE  # header of round 4
    assert decode_reply(L, _reply(L, 6, 12, Status.TIMEOUT), 6, n_out).status == Status.TIMEOUT
    bad_status = _reply(L, 6, 12)
    bad_status[LINE + 4:LINE + 8].view("<u4")[0] = 999
    assert decode_reply(L, bad_status, 6, n_out).status == Status.BAD_REPLY


@pytest.mark.parametrize("counts,ids,why", [
    ((5, 0, 5), None, "counts"),  # more than n_out
    ((-1, 0, 0), None, "counts"),
    ((2, 0, 5), np.full((3, 5), 1000, np.int32), "vocabulary"),
    ((2, 0, 5), np.full((3, 5), -3, np.int32), "vocabulary"),
])
def test_decode_reply_refuses_out_of_range_content(counts, ids, why):
    L = Layout(CFG)
    res = decode_reply(L, _reply(L, 6, 12, counts=counts, ids=ids), 6, np.array([4, 2, 5], np.int32))
    assert res.status == Status.BAD_REPLY and why in res.detail
    assert res.counts.sum() == 0


def test_decode_reply_request_count_mismatch():
    L = Layout(CFG)
    res = decode_reply(L, _reply(L, 6, 12), 6, np.array([4, 2], np.int32))
    assert res.status == Status.BAD_REPLY and res.counts.tolist() == [0, 0]


def test_a_failed_rounds_detail_travels_in_its_reply_slot_and_is_only_text():
    """The proxy writes what a failed round said (a timeout names the part of the round that ran out)
    where its drafts would be; the engine reads it back as printable text of at most the drafts area,
    and a length word beyond that area (a corrupt slot) leaves the generic detail."""
    L = Layout(CFG)
    n_out = np.array([4, 2, 5], np.int32)

    def failed(detail: str, n_said: int | None = None):
        buf = np.zeros(L.reply_size, np.uint8)
        buf[:4].view("<u4")[0] = 12
        write_reply(L, buf, 6, Status.TIMEOUT, None, None, None, detail)
        if n_said is not None:
            buf[LINE + 12:LINE + 16].view("<u4")[0] = n_said
        return decode_reply(L, buf, 6, n_out)

    said = "no reply within the timeout (waiting for the STEP's reply; 262.5 ms of 261.8 ms)"
    res = failed(said)
    area = 4 * CFG.max_requests * CFG.max_drafts  # 80 bytes here: the detail is cut to it
    assert res.status == Status.TIMEOUT and res.detail == said[:area] and res.counts.sum() == 0
    assert failed("bell\x07 and\nnewline").detail == "bell? and?newline"
    assert failed("x", n_said=area + 1).detail == "proxy reported failure"
    assert failed("").detail == "proxy reported failure"
    ok = decode_reply(L, _reply(L, 6, 12), 6, n_out)  # an answered round's drafts are not text
    assert ok.status == Status.OK and ok.detail == ""
