"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tiny-model tests on one torch thread, then restore the setting.

    Tiny forwards are dominated by per-op overhead; on a busy 2-core machine thread spin-waiting
    made them ~200× slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_with_late_join(engine, prompts, max_new_tokens):
    """Two requests start, run two rounds, a third joins mid-stream; all run to completion.

    Returns (request ids in prompt order, {request id: Completion}).
    """
    rids = [engine.add_request(p, max_new_tokens=max_new_tokens) for p in prompts[:2]]
    engine.step()
    engine.step()
    rids.append(engine.add_request(prompts[2], max_new_tokens=max_new_tokens))  # joins mid-stream
    for _ in engine.stream():
        pass
    return rids, {c.request_id: c for c in engine.pop_finished()}
