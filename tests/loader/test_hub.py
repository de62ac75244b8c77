"""Hub ids (`owner/name`) wherever a model is taken, resolved through a Hub cache laid out as
huggingface_hub lays it out, offline: no test reaches the network."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from sparrow.assets import default_checkpoint
from sparrow.config import EngineConfig
from sparrow.core.sampling_params import SamplingParams
from sparrow.engine.llm import LLM
from sparrow.loader.hub import ModelNotFoundError, resolve_model
from sparrow.loader.model import checkpoint_dir

REPO = "sparrow-test/tiny-default"
MAIN = hashlib.sha1(b"main").hexdigest()
TAGGED = hashlib.sha1(b"v1").hexdigest()


def write_hub_cache(root: Path, repo: str, snapshots: dict[str, Path], refs: dict[str, str]):
    """`root/models--owner--name/`: each file's bytes once in `blobs/` (named by digest),
    `snapshots/<commit>/<file>` relative links to them, `refs/<ref>` the commit it names."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    for commit, src in snapshots.items():
        for f in sorted(src.iterdir()):
            data = f.read_bytes()
            blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = repo_dir / "snapshots" / commit / f.name
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    for ref, commit in refs.items():
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / ref).write_text(commit)
    return repo_dir


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A Hub cache holding the built-in model at two commits: main, and the tag v1."""
    root = tmp_path_factory.mktemp("hub")
    snapshots = {MAIN: default_checkpoint(), TAGGED: default_checkpoint()}
    write_hub_cache(root, REPO, snapshots, {"main": MAIN, "v1": TAGGED})
    return root


@pytest.fixture
def offline(cache, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def snapshot(cache: Path, commit: str) -> Path:
    return cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit


def test_llm_from_hub_id_generates_as_from_directory(offline):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["def fibonacci(n):", "import os\n"]
    hub = LLM(REPO, device="cpu")
    assert Path(hub.config.model) == snapshot(offline, MAIN)  # resolved once, for every rank
    local = LLM(default_checkpoint(), device="cpu")
    got = [c.token_ids for c in hub.generate(prompts, params)]
    assert got == [c.token_ids for c in local.generate(prompts, params)]
    assert hub.tokenizer.encode(prompts[0]) == local.tokenizer.encode(prompts[0])


def test_revision_picks_a_snapshot_by_ref_or_commit(offline, tmp_path, monkeypatch):
    assert resolve_model(REPO) == snapshot(offline, MAIN)
    assert resolve_model(REPO, revision="v1") == snapshot(offline, TAGGED)
    assert resolve_model(REPO, revision=TAGGED) == snapshot(offline, TAGGED)
    config = EngineConfig.from_kwargs(model=REPO, revision="v1")
    assert checkpoint_dir(config) == snapshot(offline, TAGGED)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # --download-dir takes over from it
    assert resolve_model(REPO, download_dir=offline) == snapshot(offline, MAIN)


def test_offline_uncached_id_is_a_clear_error(offline):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("sparrow-test/not-cached")
    text = str(e.value)
    assert "'sparrow-test/not-cached'" in text and str(offline) in text
    assert "HF_HUB_OFFLINE" in text
    with pytest.raises(ModelNotFoundError, match="revision 'v9'.*HF_HUB_OFFLINE"):
        resolve_model(REPO, revision="v9")


@pytest.mark.parametrize(
    "name", ["not/a/repo", "bad id/x", "/no/such/dir", "no-such-dir", "a/b--c"]
)
def test_name_neither_directory_nor_hub_id(name, offline):
    with pytest.raises(ModelNotFoundError, match="no such directory, and not a Hugging Face Hub"):
        resolve_model(name)


def test_hub_answers_read_clearly(monkeypatch, tmp_path):
    """Online, what the Hub answers becomes one sentence naming the id (snapshot_download
    stands in for the Hub here)."""
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    response = httpx.Response(404, request=httpx.Request("GET", "https://huggingface.co/api"))
    for error, says in (
        (RepositoryNotFoundError("404", response=response), "no such repo"),
        (GatedRepoError("403", response=response), "gated.*HF_TOKEN"),
    ):

        def refuse(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
        with pytest.raises(ModelNotFoundError, match=f"'owner/name'.*{says}"):
            resolve_model("owner/name")


def _cli(args: list[str], cache: Path, tmp_path: Path):
    env = os.environ | {
        "SPARROW_CACHE": str(tmp_path / "cache"),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
    }
    return subprocess.run(
        [sys.executable, "-m", "sparrow", *args], capture_output=True, text=True, env=env
    )


def test_cli_generate_from_hub_id(cache, tmp_path):
    prompt = ["--prompt", "x", "--max-tokens", "2", "--device", "cpu"]
    gen = _cli(["generate", "--model", REPO, "--revision", "v1", *prompt], cache, tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert "decode: 2 tokens" in gen.stdout
    missing = _cli(["generate", "--model", "sparrow-test/not-cached", *prompt], cache, tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "sparrow-test/not-cached" in missing.stderr and "HF_HUB_OFFLINE" in missing.stderr
