"""Target-thread detection, drafter placement and lending the target's cores (vllm_smurfs.cores)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_smurfs import cores
from vllm_smurfs.cores import ElasticThreads, parse_cpu_list, plan_placement, target_cpus


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-2,5\n") == {0, 1, 2, 5}
    assert parse_cpu_list("3") == {3}


def test_target_cpus_are_the_cores_of_the_bound_threads() -> None:
    # vLLM binds each compute thread to one core; other threads (tokenizer, Python) may float.
    assert target_cpus(2, [{0}, {0}, {1}, {0, 1, 2, 3}]) == [0, 1]
    assert target_cpus(1, [{0}, {0, 1}]) == [0]
    assert target_cpus(2, [{0, 1}, {0, 1}]) is None  # unbound threads: no core is the target's
    assert target_cpus(2, [{0}, {0}]) is None  # fewer bound cores than threads


@pytest.mark.parametrize(("target", "every", "requested", "threads", "pipelined", "expected"), [
    ([0], [0, 1], None, 1, True, ([1], 0)),  # a free core: no lending
    ([0, 1], [0, 1], None, 1, True, ([1], 1)),  # none free: borrow the target's last core
    ([0, 1, 2, 3], [0, 1, 2, 3], None, 2, True, ([2, 3], 2)),
    ([0, 1], [0, 1], None, 1, False, ([0, 1], 0)),  # synchronous: takes turns on all cores
    ([0], [0], None, 1, True, ([0], 0)),  # the target keeps at least one thread
    ([0, 1], [0, 1], [0], 1, True, ([0], 0)),  # a borrow of the first core cannot be lent
    ([0, 1, 2], [0, 1, 2, 3], [2, 3], 2, True, ([2, 3], 1)),  # asked for: partly borrowed
])
def test_plan_placement(target, every, requested, threads, pipelined, expected) -> None:
    assert plan_placement(target, every, requested, threads, pipelined) == expected


def test_elastic_threads_lend_and_take_back() -> None:
    import torch

    with pytest.raises(ValueError, match="lent_threads"):
        ElasticThreads(1, 1)
    before = torch.get_num_threads()
    elastic = ElasticThreads(2, 1)
    try:
        elastic.lend(True)
        assert torch.get_num_threads() == 1 and elastic.lending
        elastic.lend(True)  # unchanged: no switch
        elastic.lend(False)
        assert torch.get_num_threads() == 2 and elastic.switches == 2
    finally:
        torch._C.set_num_threads(before)
    off = ElasticThreads(2, 0)
    off.lend(True)
    assert not off.enabled and off.switches == 0


_PROBE = """
import json, os
from vllm_smurfs import cores
threads = cores.spin_up_threads()
before = cores.target_cpus(threads)
elastic = cores.ElasticThreads(threads, 1)
elastic.lend(True); cores.spin_up_threads()
elastic.lend(False); cores.spin_up_threads()
after = cores.target_cpus(threads)
print(json.dumps([threads, before, after]))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_bound_openmp_threads_keep_their_cores_through_lending() -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "close",
           "OMP_PLACES": ",".join(f"{{{c}}}" for c in cpus)}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    import json

    threads, before, after = json.loads(out.strip().splitlines()[-1])
    assert threads == 2 and before == cpus and after == cpus



def test_warm_gemms_calls_every_cpu_linear_layer_once_per_token_count(caplog):
    import torch

    from vllm_smurfs.cores import warm_gemms

    calls = []

    class Linear(torch.nn.Module):
        def __init__(self, name, k, n, removed):
            super().__init__()
            # vLLM's CPU linear layers drop their weight once the GEMM handler holds it.
            self.weight = torch.nn.Parameter(torch.empty(0 if removed else n, 0 if removed else k,
                                                         dtype=torch.bfloat16))
            if removed:
                self.input_size_per_partition = k
            self.cpu_linear = lambda x, w, b: calls.append((name, tuple(x.shape), x.dtype))

    model = torch.nn.Sequential(Linear("qkv", 8, 12, True), torch.nn.ReLU(),
                                Linear("lm_head", 8, 50, False))
    assert warm_gemms(model, [1, 3]) == 4
    assert calls == [("qkv", (1, 8), torch.bfloat16), ("qkv", (3, 8), torch.bfloat16),
                     ("lm_head", (1, 8), torch.bfloat16), ("lm_head", (3, 8), torch.bfloat16)]

    def broken(x, w, b):
        raise RuntimeError("no GEMM here")

    model[0].cpu_linear = broken
    with caplog.at_level("WARNING"):
        assert warm_gemms(model, [1]) == 0  # best effort: it stops, the engine goes on
    assert "no GEMM here" in caplog.text
