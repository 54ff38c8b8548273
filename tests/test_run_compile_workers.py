"""compile_in_process: no inductor compile-worker pool unless the user asks for one."""

from __future__ import annotations

import pytest
from torch._inductor import config

from dflash_ipc.run.compile_workers import ENV, compile_in_process


@pytest.fixture
def threads(monkeypatch):
    with config.patch(compile_threads=16):  # as inductor decides on a 16-core machine; restored after
        yield monkeypatch


def test_the_pool_is_off_unless_the_environment_sets_it(threads):
    threads.delenv(ENV, raising=False)
    assert compile_in_process() is True
    assert config.compile_threads == 1
    from torch._inductor.async_compile import get_compile_threads
    assert get_compile_threads() == 1  # what inductor reads before it starts a pool


def test_the_users_setting_is_kept(threads):
    threads.setenv(ENV, "8")
    assert compile_in_process() is False
    assert config.compile_threads == 16
