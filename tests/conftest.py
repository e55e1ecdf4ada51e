import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # NOTE: the test models are tiny; intra-op threads only add spin-wait contention on a
    # 2-core machine (seen as 100x slower small ops when another process is busy).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
