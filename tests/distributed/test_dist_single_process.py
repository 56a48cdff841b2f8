"""Strategies in one process: environment parsing, scope(), batches, errors (no process group)."""
from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from mixprec.errors import ConfigError
from mixprec.strategies import (FSDPStrategy, MirroredStrategy, RankFailureError, SingleDeviceStrategy,
                                current_strategy, default_timeout, get_strategy, rank_failure_guard,
                                read_env)

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MIXPREC_DIST_TIMEOUT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in DIST_VARS:
        monkeypatch.delenv(var, raising=False)


def test_env_without_torchrun_is_one_process():
    env = read_env()
    assert (env.rank, env.local_rank, env.world_size, env.distributed) == (0, 0, 1, False)


def test_env_reads_torchrun_variables(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = read_env()
    assert (env.rank, env.local_rank, env.world_size, env.distributed) == (3, 1, 4, True)


@pytest.mark.parametrize("rank,world", [("4", "4"), ("-1", "2"), ("x", "2")])
def test_bad_rank_environment_is_a_config_error(monkeypatch, rank, world):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(ConfigError, match="RANK"):
        read_env()


def test_timeout_comes_from_the_environment(monkeypatch):
    assert default_timeout() == 300.0
    monkeypatch.setenv("MIXPREC_DIST_TIMEOUT", "12.5")
    assert default_timeout() == 12.5
    monkeypatch.setenv("MIXPREC_DIST_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="MIXPREC_DIST_TIMEOUT"):
        default_timeout()


def test_missing_rendezvous_address_is_a_config_error(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        MirroredStrategy()


def test_auto_is_single_device_in_one_process():
    s = get_strategy()
    assert isinstance(s, SingleDeviceStrategy) and s.is_main and s.world_size == 1
    assert get_strategy(s) is s
    assert isinstance(get_strategy("ddp"), MirroredStrategy)
    # DDP settings in one process: a mirrored strategy, which is single-device here
    s = get_strategy("auto", grad_compression="fp16")
    assert isinstance(s, MirroredStrategy) and s.compression == "fp16" and not s.is_distributed
    with pytest.raises(ConfigError, match="did you mean 'fsdp'"):
        get_strategy("fsdb")


def test_single_device_strategy_refuses_a_multi_process_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="MirroredStrategy"):
        SingleDeviceStrategy()


def test_scope_sets_default_device_and_current_strategy_and_restores_them():
    outer, inner = SingleDeviceStrategy("cpu"), SingleDeviceStrategy("meta")
    assert current_strategy() is None
    with outer.scope():
        assert current_strategy() is outer
        with inner.scope():
            assert current_strategy() is inner
            assert nn.Linear(2, 2).weight.device.type == "meta"
        assert current_strategy() is outer
        assert torch.empty(1).device.type == "cpu"
    assert current_strategy() is None
    with pytest.raises(RuntimeError):
        with inner.scope():
            raise RuntimeError("boom")
    assert current_strategy() is None and torch.empty(1).device.type == "cpu"


def test_to_device_moves_nested_batches():
    Pair = collections.namedtuple("Pair", "x y")
    s = SingleDeviceStrategy("meta")
    batch = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), 3)], "c": Pair(torch.ones(1), "s")}
    out = s.to_device(batch)
    assert out["a"].device.type == "meta" and out["b"][0].device.type == "meta"
    assert out["b"][1][1] == 3 and isinstance(out["c"], Pair) and out["c"].y == "s"


def test_one_process_mirrored_and_fsdp_are_plain_single_device():
    for s in (MirroredStrategy(grad_compression="topk"), FSDPStrategy("bf16-mixed")):
        model = nn.Linear(3, 1)
        wrapped, opt = s.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
        assert wrapped is model and opt.param_groups[0]["params"][0] is model.weight
        with s.no_sync(wrapped):
            pass
        assert s.reduce_mean(torch.tensor(2.0)) == 2.0
        sd = s.model_state_dict(wrapped)
        s.load_model_state_dict(wrapped, sd)
        assert s.comm_stats()["bytes_sent"] == 0
    mirrored = MirroredStrategy(grad_compression="topk")
    mirrored.setup(nn.Linear(3, 1))
    mirrored.load_state_dict(mirrored.state_dict())   # the trainer's checkpoint hooks


@pytest.mark.parametrize("kwargs,match", [({"grad_compression": "fp61"}, "did you mean 'fp16'"),
                                          ({"topk_ratio": 0.0}, "topk_ratio"),
                                          ({"bucket_cap_mb": -1}, "bucket_cap_mb")])
def test_mirrored_validates_its_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MirroredStrategy(**kwargs)


def test_compression_follows_the_policy_reduce_dtype():
    from mixprec.precision import get_policy
    s = MirroredStrategy()
    assert s.compression == "none"
    s.setup(nn.Linear(2, 2), policy=get_policy("bf16-mixed").replace(reduce_dtype=torch.bfloat16))
    assert s.compression == "bf16"
    assert MirroredStrategy(grad_compression="topk").compression == "topk"


def test_rank_failure_guard_rewrites_lost_peer_errors_only():
    with pytest.raises(RankFailureError, match="another rank crashed.*waited at most 5 s"):
        with rank_failure_guard(0, 5.0):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(ValueError, match="shape"):
        with rank_failure_guard(0, 5.0):
            raise ValueError("shape mismatch")
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        with rank_failure_guard(0, 5.0):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
