"""SequenceBatch, the plain multi-sequence loop the other tests take as reference."""

import pytest
import torch

from sparrow.loader.weights import load_checkpoint
from sparrow.worker.sequences import SequenceBatch
from tests.conftest import rel_err


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint, "cpu", torch.float32, progress=False)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunks_and_interleaved_sequences_give_one_pass_results(model):
    """A prompt fed in chunks of 21, 1 and 18 tokens, with another sequence's steps in
    between (`seqs` picks which sequence each input extends), gives the hidden states of
    one pass over the whole prompt."""
    prompt, other = _ids(40, 0), _ids(9, 1)
    whole = SequenceBatch(model, 1, 40).forward([prompt])
    batch = SequenceBatch(model, 2, 48)
    parts = [batch.forward([prompt[:21]], seqs=[1])]
    batch.forward([other], seqs=[0])
    parts.append(batch.forward([prompt[21:22], other[:1]], seqs=[1, 0])[:1])
    parts.append(batch.forward([prompt[22:]], seqs=[1]))
    assert batch.computed == [10, 40]
    assert rel_err(torch.cat(parts), whole) < 1e-5


def test_exceeding_max_len_raises_and_leaves_the_sequence(model):
    batch = SequenceBatch(model, 2, 20)
    batch.forward([_ids(15, 2), _ids(3, 3)])
    with pytest.raises(ValueError, match="max_len=20"):
        batch.forward([_ids(6, 4)], seqs=[0])
    assert batch.computed == [15, 3]
