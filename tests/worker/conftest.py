import pytest
import torch
from tokenizers import Tokenizer, models

from sparrow.loader.random_checkpoint import PRESETS, write_random_checkpoint

# The built-in tiny model with a small vocabulary; weights std 0.1 so logits are spread out.
TINY = PRESETS["qwen3.6-tiny"].replace(vocab_size=300, initializer_range=0.1)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """An fp32 checkpoint of TINY with a word-level tokenizer.json (prompts go in as ids;
    it keeps the packaged Qwen vocabulary from loading)."""
    path = tmp_path_factory.mktemp("tiny")
    write_random_checkpoint(
        path, TINY, seed=4, dtype=torch.float32, tokenizer=False, progress=False
    )
    words = {f"t{i}": i for i in range(TINY.vocab_size)}
    Tokenizer(models.WordLevel(words, unk_token="t0")).save(str(path / "tokenizer.json"))
    return path
