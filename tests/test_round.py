"""The round vocabulary: a leaf the torch-free proxy can import, and the check of a round function's output."""

from __future__ import annotations

import ast
import subprocess
import sys

import numpy as np
import pytest

from draftrelay.round import RoundFailure, RoundRequest, Status, check_drafts, end_block


def test_round_and_testing_load_no_other_package_module_and_no_torch():
    code = ("import sys, draftrelay.testing\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('draftrelay', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert ast.literal_eval(out.stdout) == ["draftrelay", "draftrelay.round", "draftrelay.testing"]


def _req(n_out: int) -> RoundRequest:
    return RoundRequest(7, 1, 0, np.array([1, 2], np.int32), n_out)


def test_check_drafts_lays_out_counts_drafts_and_confidences():
    reqs = [_req(3), _req(0), end_block(9, 2, 40)]
    out = [(np.array([4, 5], np.int32), np.array([0.5, 0.25], np.float32)), (np.zeros(0, np.int32), np.zeros(0)),
           (np.zeros(0, np.int32), np.zeros(0))]
    counts, drafts, conf = check_drafts(out, reqs, vocab_size=10, max_drafts=4)
    assert counts.tolist() == [2, 0, 0]
    assert drafts.tolist() == [[4, 5, 0, 0], [0] * 4, [0] * 4] and conf[0, :2].tolist() == [0.5, 0.25]
    assert reqs[2].n_out == 0 and len(reqs[2].tokens) == 0


@pytest.mark.parametrize("out, why", [
    ("not a list", "expected 1 draft blocks"),
    ([], "expected 1 draft blocks"),
    ([(np.array([1, 2, 3], np.int32), np.zeros(3))], "3 drafts for n_out=2"),
    ([(np.array([1], np.int32), np.zeros(2))], "1 drafts for n_out=2"),
    ([(np.array([10], np.int32), np.zeros(1))], r"outside \[0, 10\)"),
    ([(np.array([-1], np.int32), np.zeros(1))], r"outside \[0, 10\)"),
])
def test_check_drafts_refuses_a_bad_reply_by_name(out, why):
    with pytest.raises(RoundFailure, match=why) as e:
        check_drafts(out, [_req(2)], vocab_size=10, max_drafts=4)
    assert e.value.status == Status.BAD_REPLY
