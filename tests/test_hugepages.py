"""Huge pages for CPU weights (draftrelay/hugepages.py): the loaders' values are the same with and without
them, the weights land in AnonHugePages where the kernel's THP mode allows it, the switch and the kernel's
`never` turn it off, and a dropped model leaves no mapping behind."""

from __future__ import annotations

import gc

import pytest
import torch

from draftrelay import greedy_head, hugepages
from draftrelay.checkpoint import gguf as G
from draftrelay.checkpoint.hf import empty_model, load_hf_dir, save_hf_dir
from draftrelay.model import ModelConfig, Transformer

THP_ON = hugepages.enabled()[0]
needs_thp = pytest.mark.skipif(not THP_ON, reason=f"huge pages off here: {hugepages.enabled()[1]}")


def mid_config() -> ModelConfig:
    """A model of ~9 MB in fp32: above hugepages.MIN_BYTES, with more than two 2 MiB pages inside."""
    return ModelConfig(vocab_size=4096, hidden_size=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64,
                       intermediate_size=512, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       max_position_embeddings=256, qkv_bias=True)


def mapped(lo: int) -> bool:
    """Whether address lo lies in any mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            a, b = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            if a <= lo < b:
                return True
    return False


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    p = tmp_path / "enabled"
    for text, want in (("always [madvise] never\n", "madvise"), ("[always] madvise never", "always"),
                       ("always madvise [never]", "never")):
        p.write_text(text)
        assert hugepages.thp_mode(str(p)) == want
    assert hugepages.thp_mode(str(tmp_path / "missing")) is None


def test_off_by_the_environment_or_the_kernel(monkeypatch):
    monkeypatch.setenv(hugepages.ENV, "0")
    assert hugepages.enabled() == (False, f"{hugepages.ENV}=0")
    assert hugepages.arena(64 << 20) is None
    monkeypatch.delenv(hugepages.ENV)
    monkeypatch.setattr(hugepages, "thp_mode", lambda path=hugepages.THP_ENABLED: "never")
    on, why = hugepages.enabled()
    assert not on and "never" in why
    with torch.device("meta"):
        m = Transformer(mid_config())
    assert not hugepages.materialize(m, torch.float32)  # declined: the caller allocates as usual
    assert all(p.is_meta for p in m.parameters())
    monkeypatch.setattr(hugepages, "thp_mode", lambda path=hugepages.THP_ENABLED: None)
    assert not hugepages.enabled()[0]


@needs_thp
def test_arena_is_aligned_advised_and_unmapped_when_dropped():
    n = 8 << 20
    buf = hugepages.arena(n)
    assert buf is not None and buf.numel() == n and buf.data_ptr() % hugepages.HUGE_PAGE == 0
    buf.fill_(1)  # first touch: the fault takes 2 MiB pages
    assert hugepages.huge_bytes(buf) >= 2 * hugepages.HUGE_PAGE
    lo = buf.data_ptr()
    view = buf[1 << 20:]  # a view keeps the mapping
    del buf
    gc.collect()
    assert mapped(lo) and int(view[0]) == 1
    del view
    gc.collect()
    assert not mapped(lo)


def test_empty_falls_back_below_the_minimum():
    t = hugepages.empty((16, 16), torch.float32)
    assert t.shape == (16, 16) and t.dtype == torch.float32


@needs_thp
def test_empty_model_puts_every_parameter_in_one_arena_of_huge_pages():
    m = empty_model(mid_config(), "cpu", torch.float32)
    params = list(m.parameters())
    bases = {p.untyped_storage().data_ptr() for p in params}
    assert len(bases) == 1  # one mapping holds them all
    assert all(p.data_ptr() % hugepages.ALIGN == 0 for p in params)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in params)
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans[:-1], spans[1:], strict=True))  # no two overlap
    with torch.no_grad():
        for p in params:
            p.fill_(0.5)
    total = sum(p.numel() * p.element_size() for p in params)
    assert hugepages.huge_bytes(params[0]) >= (total // hugepages.HUGE_PAGE - 1) * hugepages.HUGE_PAGE
    lo = params[0].untyped_storage().data_ptr()
    del m, params, p
    gc.collect()
    assert not mapped(lo)  # the model's last reference gone: the mapping is gone


def test_hf_and_gguf_loads_equal_with_and_without_huge_pages(tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType as Q

    from gguf_files import write_gguf

    src = Transformer.random(mid_config(), seed=3, std=0.05)
    save_hf_dir(src, tmp_path / "hf")
    write_gguf(src, tmp_path / "m.gguf", "qwen2", Q.Q8_0)
    loads = {}
    for flag in ("1", "0"):
        monkeypatch.setenv(hugepages.ENV, flag)
        loads[flag] = (load_hf_dir(tmp_path / "hf"), G.load_gguf(tmp_path / "m.gguf"))
    for a, b in zip(loads["1"], loads["0"], strict=True):
        sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    for k, v in dict(src.named_parameters()).items():
        assert torch.equal(dict(loads["1"][0].named_parameters())[k], v), k
    if THP_ON:
        on_hf, off_hf = loads["1"][0], loads["0"][0]
        assert len({p.untyped_storage().data_ptr() for p in on_hf.parameters()}) == 1
        assert len({p.untyped_storage().data_ptr() for p in off_hf.parameters()}) > 1


@needs_thp
def test_the_screened_heads_int8_copy_is_in_huge_pages():
    w = torch.randn(8192, 1024)  # 32 MB: over the screen's minimum
    sh = greedy_head.ScreenedHead(w)
    assert sh.q.data_ptr() % hugepages.HUGE_PAGE == 0
    assert hugepages.huge_bytes(sh.q) >= 2 * hugepages.HUGE_PAGE
