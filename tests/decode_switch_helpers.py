"""The decode switches ($DFLASH_DECODE_*) of tests/test_decode_matvec.py, test_decode_attention.py and
test_decode_fused_projections.py: their setting, and a bf16 target's decode with one off and on (GPU)."""

import numpy as np
import pytest
import torch

from dflash_ipc.errors import ConfigError

from dflash_ipc.bench.assets import build_random_target
from dflash_ipc.decode.engine import DecodeEngine, EngineSettings
from dflash_ipc.decode.requests import Request, RequestList


def make_requests(n=11, seed=0, max_len=40, max_new=20) -> list[Request]:
    """``n`` requests of random prompts (3..max_len tokens) and budgets (1..max_new new tokens)."""
    rng = np.random.default_rng(seed)
    return [Request(key=(i, 0), prompt_ids=rng.integers(10, 1000, size=int(rng.integers(3, max_len))),
                    max_new_tokens=int(rng.integers(1, max_new))) for i in range(n)]


def greedy_tokens(target, requests, *, compile: str, max_rows: int) -> dict:
    """Each request's greedy tokens from the decoding core over ``target``, by request key."""
    engine = DecodeEngine(target, settings=EngineSettings(max_rows=max_rows, check_every=3, compile=compile))
    return {g.request.key: g.tokens for g in engine.run(RequestList(requests)).generations}


def check_switch_setting(monkeypatch, env: str, enabled) -> None:
    """``enabled(device)`` of the switch ``$env``: a value outside auto/off is a ConfigError that
    names it, off is off on CUDA, unset is off on CPU."""
    monkeypatch.setenv(env, "sometimes")
    with pytest.raises(ConfigError, match=f"{env}.*auto"):
        enabled("cuda:0")
    monkeypatch.setenv(env, "off")
    assert not enabled("cuda:0")
    monkeypatch.delenv(env)
    assert not enabled("cpu")


def decode_verdicts(tmp_path, monkeypatch, env: str, *, rows: int, max_prompt: int, max_new: int,
                    num_requests: int, switched_on, **target_kwargs) -> list[str]:
    """eval/lossless.py verdicts of each request's greedy decode with ``env`` on against off,
    compiled and captured, ``rows`` rows; ``switched_on(target)`` says whether the switch took."""
    from dflash_ipc.decode.target import BatchedTarget
    from dflash_ipc.eval.lossless import compare

    path = str(tmp_path / "target")
    build_random_target(path, shape="tiny", dtype="bfloat16", num_layers=2, seed=5)
    batch = make_requests(num_requests, max_len=max_prompt, max_new=max_new)
    runs = {}
    for setting in ("off", "auto"):
        monkeypatch.setenv(env, setting)
        torch._dynamo.reset()
        target = BatchedTarget(path, device="cuda:0", dtype="bfloat16", **target_kwargs)
        assert switched_on(target) == (setting == "auto")
        engine = DecodeEngine(target, settings=EngineSettings(max_rows=rows, check_every=3, compile="on",
                                                              keep_margins=True))
        runs[setting] = {g.request.key: g for g in engine.run(RequestList(batch)).generations}
        assert engine.graphs.enabled and not target._compiled_extend.failed
    torch._dynamo.reset()
    return [compare(runs["auto"][k], runs["off"][k], dtype=torch.bfloat16).verdict for k in runs["off"]]
