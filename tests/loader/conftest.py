import pytest

from tests.loader.layouts import TINY, Written, write


@pytest.fixture(scope="session")
def writes(tmp_path_factory):
    """family -> its tiny model written by Sparrow (float release and MLX 4-bit), each
    written once."""
    done: dict[str, Written] = {}

    def get(name: str) -> Written:
        if name not in done:
            done[name] = write(name, tmp_path_factory.mktemp(name))
        return done[name]

    return get


@pytest.fixture(scope="session", params=sorted(TINY))
def written(request, writes):
    return writes(request.param)


@pytest.fixture(scope="session")
def m3(writes):
    return writes("minimax_m3")


@pytest.fixture(scope="session")
def qwen(writes):
    return writes("qwen3_5_moe")
