import os

import pytest
import torch

# NOTE: the processes the tests start (servers, CLIs, ranks, compile workers) take one intra-op
# thread too: beside the other test worker, more only spin-wait for a core (the CLI's default
# job used 30% more CPU with two).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # NOTE: the test models are tiny; intra-op threads only add spin-wait contention on a
    # 2-core machine (seen as 100x slower small ops when another process is busy).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# The files that take longest, longest first (a cold run on two cores, measured):
# `--dist loadfile` hands whole files to the workers in collection order (`pytest_configure`
# turns off xdist's reordering by test count, which put these few-test files last), so a long
# file starts while the other worker works through the short ones instead of running alone at
# the end, and the last files are short. A new file that takes more than about five seconds
# belongs here.
LONGEST_FIRST = (
    "test_compile.py",  # two inductor compiles, cold
    "test_parallel.py",  # torchrun launches
    "test_spec.py",
    "test_serve.py",  # five server processes
    "test_prefill_attention.py",
    "test_structured.py",
    "test_moe_kernels.py",
    "test_paged_attention.py",
    "test_plan.py",
    "test_plan_cost.py",
    "test_bench.py",
    "test_chunked_prefill.py",
    "test_prefix_cache_model.py",
    "test_serve_robust.py",
    "test_rehearse.py",
    "test_model.py",
    "test_gpu_check.py",
    "test_config.py",
    "test_repeat.py",
    "test_verify.py",
    "test_training.py",
    "test_serve_shutdown.py",
    "test_plan_ops.py",
    "test_serve_prefix.py",
    "test_graphs.py",
    "test_serve_anthropic.py",
    "test_serve_fields.py",
    "test_serve_responses.py",
    "test_golden.py",
    "test_toolcalls.py",
    "test_generate.py",
    "test_serve_tools.py",
    "test_profile.py",
)


def pytest_configure(config):
    # NOTE: what `--no-loadscope-reorder` sets (pytest-xdist 3.6 added both the flag and the
    # reordering; older versions keep the collection order and have no such option)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # NOTE: what collection imported (torch, the engine, the tests) lives to the end: out of
    # every later collection it costs none (`engine.heap`). Walking it took an eighth of the
    # planner's and the steps' tests' CPU time (23 of 183 s, measured), in the full collections
    # each rehearsal phase begins with and those their millions of small objects set off.
    from engine.heap import freeze_heap

    freeze_heap()
