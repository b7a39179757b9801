"""The confidence stop's rule (Job.min_conf > 0): a job's drafts end after the first one whose
confidence (the drafter's probability of its own greedy token) is below its threshold. The session
trims every drafter's output with `stop_counts`; the eager and lean loops ask `all_stopped` after each
step whether they may stop computing. Numpy only: no drafter, no torch."""

from __future__ import annotations

import numpy as np


def stop_counts(confs: np.ndarray, min_conf: np.ndarray | list[float], window: np.ndarray | list[int]) -> np.ndarray:
    """Drafts each row keeps under the confidence stop: up to and including its first draft with
    confidence below min_conf[b], at most window[b] (and the columns there are). Always >= 1 where the
    window is: the first draft costs no forward of its own (the extension's logits give it)."""
    confs = np.asarray(confs, np.float32)
    B, n = confs.shape
    out = np.zeros(B, np.int64)
    for b in range(B):
        w = min(int(window[b]), n)
        thr = np.float32(min_conf[b])
        low = np.flatnonzero(confs[b, :w] < thr) if thr > 0 else ()
        out[b] = int(low[0]) + 1 if len(low) else w
    return out


def all_stopped(conf_now, thresholds: np.ndarray) -> bool:
    """Whether every job's confidence stop has fired by this step. thresholds[b] is job b's stop, set to
    +inf here (in place) once its draft's confidence falls below it; a job without a stop (0) never fires."""
    c = np.asarray(conf_now, np.float32)
    thresholds[c < thresholds] = np.inf
    return bool(np.isinf(thresholds).all())
