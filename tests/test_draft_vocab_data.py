"""scripts/build_draft_vocab.py: token ids counted over a corpus (markup and binary files skipped, a
duplicate file counted once), ranked by count with ties to the lower id, and the ranking file it writes
taken by the worker's --draft-vocab FILE.npy:N."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from draftrelay.draft_vocab import DraftVocab

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_draft_vocab.py"
spec = importlib.util.spec_from_file_location("build_draft_vocab", SCRIPT)
B = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = B  # its dataclasses look their module up
spec.loader.exec_module(B)


class ByteTokenizer:
    """One id per byte: enough to count with (the script only asks for ids and the vocabulary size)."""

    class Enc:
        def __init__(self, ids):
            self.ids = ids

    def get_vocab_size(self) -> int:
        return 256

    def encode_batch(self, texts, add_special_tokens=False):
        return [self.Enc(list(t.encode())) for t in texts]


def test_counts_skip_markup_and_duplicates_and_rank_ties_to_the_lower_id(tmp_path):
    (tmp_path / "a.txt").write_text("bbb a")
    (tmp_path / "copy.txt").write_text("bbb a")  # the same bytes: counted once
    (tmp_path / "page.html").write_text("zzzzzzzz")  # markup: never read
    counts, corpus = B.count_tokens(ByteTokenizer(), [str(tmp_path)], 1 << 20, 1 << 30)
    assert counts[ord("b")] == 3 and counts[ord("a")] == 1 and counts[ord(" ")] == 1 and counts[ord("z")] == 0
    assert corpus.duplicates == 1 and corpus.files == 1
    order = B.rank(counts)
    assert list(order[:3]) == [ord("b"), ord(" "), ord("a")]  # " " (32) and "a" (97) tie: the lower id first
    assert list(order[3:6]) == [0, 1, 2]  # then unseen ids in id order
    path = tmp_path / "ranking.npy"
    np.save(path, order.astype(np.uint32))
    assert DraftVocab.parse(f"{path}:2", 256).ids.tolist() == [ord(" "), ord("b")]
